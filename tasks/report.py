"""What a person reads: the text report, the Prefect artifacts, and the loss/accuracy/cost plot."""
from __future__ import annotations

import base64
import io

from tasks.job import RunSummary


def plot_curves(epochs: list[dict]) -> bytes:
    """PNG of training/validation loss, validation accuracy and cumulative cost per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e["epoch"] for e in epochs]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    axes[0].plot(xs, [e["train_loss"] for e in epochs], marker="o", label="train")
    axes[0].plot(xs, [e.get("val_loss") for e in epochs], marker="o", label="validation")
    axes[0].set(title="loss", xlabel="epoch")
    axes[0].legend()
    axes[1].plot(xs, [e.get("val_accuracy") for e in epochs], marker="o", color="tab:green")
    axes[1].set(title="validation accuracy", xlabel="epoch")
    cum, total = [], 0.0
    for e in epochs:
        total += e["cost_usd"]
        cum.append(total)
    axes[2].plot(xs, cum, marker="o", color="tab:red")
    axes[2].set(title="cumulative cost (USD)", xlabel="epoch")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def epoch_table(epochs: list[dict]) -> list[dict]:
    """Rows for the per-epoch table (strings and numbers only)."""
    return [{"epoch": e["epoch"], "workers": e["workers"], "stages": e.get("stages", 1),
             "train_loss": round(e["train_loss"], 5), "val_loss": e.get("val_loss") and round(e["val_loss"], 5),
             "val_accuracy": e.get("val_accuracy") and round(e["val_accuracy"], 4),
             "seconds": round(e["seconds"], 2), "samples_per_s": round(e["samples_per_s"], 1),
             "predicted_s": e.get("predicted_epoch_s") and float(f"{e['predicted_epoch_s']:.3g}"),
             "predicted_iter_s": e.get("predicted_iteration_s") and round(e["predicted_iteration_s"], 5),
             "measured_iter_s": e.get("measured_iteration_s") and round(e["measured_iteration_s"], 5),
             "cost_usd": round(e["cost_usd"], 6)} for e in epochs]


def co_optimizer_lines(co: dict) -> list[str]:
    """What the co-optimiser compared (or why it was not needed), as markdown lines."""
    if not co:
        return []
    if "sizes_gb" not in co:
        return [f"Co-optimiser not used: {co.get('reason')}."]

    def gb(sizes) -> str:
        return "/".join(f"{g:g}" for g in sizes) + " GB"

    lines = [f"Co-optimiser ({co.get('solver')}, worker sizes {gb(co['sizes_gb'])}; {co.get('assumption')}): "
             f"{'used' if co.get('used') else 'not used'}, {co.get('reason')}.", "",
             "| compared | D | stages | cuts | stage sizes | iteration s | $ / iteration | epoch s | $ / epoch |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [("co-optimised", co.get("co_optimised"))] + [(f"best uniform at {u['memory_gb']:g} GB", u)
                                                          for u in co.get("uniform_by_size", ())]
    for name, r in rows:
        if not r or "t_iter_s" not in r:
            lines.append(f"| {name} | - | - | - | does not fit | - | - | - | - |")
            continue
        lines.append(f"| {name} | {r['data_parallel']} | {r['stages']} | {r['cuts']} | {gb(r['stage_memory_gb'])} | "
                     f"{r['t_iter_s']:.3g} | {r['c_iter_usd']:.3g} | {r['epoch_s']:.3g} | {r['cost_per_epoch_usd']:.3g} |")
    u, c = co.get("uniform"), co.get("co_optimised")
    if u:
        lines += ["", f"The uniform plan it would otherwise run: {u['strategy']} D={u['data_parallel']} "
                      f"M={u['stages']} at {u['worker_memory_gb']:g} GB, {u['predicted_epoch_s']:.3g} s and "
                      f"${u['predicted_cost_per_epoch_usd']:.3g} per epoch (workers' compute)."]
    if c and "predicted_epoch_s" in c:
        sizes = ", ".join(f"{g:g}" for g in c.get("stage_memory_gb") or [c["worker_memory_gb"]])
        lines += [f"The co-optimised plan as launched (stage sizes {sizes} GB): {c['predicted_epoch_s']:.3g} s and "
                  f"${c['predicted_cost_per_epoch_usd']:.3g} per epoch."]
    return lines


def infrastructure_ids(rows: list[dict]) -> list[str]:
    """Each worker's infrastructure id (task, container group, pod or container) as the
    cloud-clock rows name it (`worker ... on <id>`), in the order they were billed."""
    return list(dict.fromkeys(r["resource"].rsplit(" on ", 1)[1] for r in rows
                              if r["kind"] in ("worker", "failed_attempt") and " on " in r["resource"]))


def text_report(summary: RunSummary, ledger: dict | None = None) -> str:
    """The report printed at the end of `make run` and `python -m flows.train`."""
    p = summary.plan
    lines = [f"Zooid run {summary.run_id}: {summary.status}",
             f"plan: {p.get('strategy')} D={p.get('data_parallel')} M={p.get('stages')} "
             f"k={p.get('sync_period') or 'epoch'} steps/epoch={p.get('steps_per_epoch')} "
             f"batch={p.get('batch_size')} offer={p.get('offer')} "
             f"predicted {_fmt(p.get('predicted_epoch_s'), '.3g')} s/epoch, "
             f"${_fmt(p.get('predicted_cost_per_epoch_usd'), '.3g')}/epoch; "
             f"run {_fmt(p.get('predicted_run_s'), '.3g')} s, ${_fmt(p.get('predicted_run_cost_usd'), '.3g')}",
             *([f"stage sizes: {'/'.join(f'{g:g}' for g in p['stage_memory_gb'])} GB (co-optimiser: "
                f"{(p.get('co_optimizer') or {}).get('reason')})"] if p.get("stage_memory_gb") else []),
             "", f"{'epoch':>5} {'workers':>7} {'train_loss':>10} {'val_loss':>9} {'val_acc':>8} "
             f"{'seconds':>8} {'predicted':>9} {'samples/s':>10} {'cost_usd':>10}"]
    for e in summary.epochs:
        lines.append(f"{e.epoch:>5} {e.workers:>7} {e.train_loss:>10.4f} {_fmt(e.val_loss):>9} "
                     f"{_fmt(e.val_accuracy):>8} {e.seconds:>8.3g} {_fmt(e.predicted_epoch_s, '.3g'):>9} "
                     f"{e.samples_per_s:>10.1f} {e.cost_usd:>10.3g}")
        if (e.replan or {}).get("switched"):
            lines.append(f"      re-planned after epoch {e.epoch}: {e.replan.get('reason')}")
    infra = infrastructure_ids(ledger["rows"]) if ledger else []
    if infra:
        lines += ["", "workers ran on: " + ", ".join(infra)]
    ws = summary.worker_seconds
    if ws:
        lines += ["", "worker-seconds billed: " + ", ".join(f"{k} {v:.1f}" for k, v in ws.items() if v)]
    lines += ["", f"final loss {_fmt(summary.final_loss)}, final accuracy {_fmt(summary.final_accuracy)}",
              f"total cost ${summary.total_cost_usd:.3g} (predicted ${_fmt(p.get('predicted_run_cost_usd'), '.3g')})"
              + (f" ({len(ledger['rows'])} ledger rows)" if ledger else "")]
    if summary.error:
        lines.append(f"error: {summary.error}")
    return "\n".join(lines)


def markdown_report(summary: RunSummary, ledger_rows: list[dict], png: bytes | None) -> str:
    """The markdown artifact: plan, alternatives, per-epoch table, bill and the plot."""
    p = summary.plan
    md = [f"# Zooid run `{summary.run_id}`: {summary.status}", "",
          "## Plan", "", "| field | value |", "|---|---|"]
    for k in ("strategy", "data_parallel", "stages", "sync_period", "steps_per_epoch", "batch_size",
              "offer", "worker_vcpu", "worker_memory_gb", "stage_memory_gb", "worker_gpu", "predicted_iteration_s",
              "predicted_epoch_s", "predicted_first_epoch_s", "predicted_cost_per_epoch_usd", "predicted_run_s",
              "predicted_run_cost_usd"):
        v = p.get(k)
        md.append(f"| {k} | {format(v, '.3g') if isinstance(v, float) else v} |")
    if p.get("run_terms"):
        t = p["run_terms"]
        md.append("| run terms | " + ", ".join(f"{k} {t[k]:.3g} s ({'measured' if t['measured'].get(k) else 'assumed'})"
                                           for k in t if k != "measured" and t[k] is not None) + " |")
    if p.get("co_optimizer"):
        md += ["", "### Co-optimiser", "", *co_optimizer_lines(p["co_optimizer"])]
    if p.get("alternatives"):
        md += ["", "### Alternatives considered", "", "| strategy | workers | iteration s | epoch s | $/epoch | "
               "run s | run $ | chosen |", "|---|---|---|---|---|---|---|---|"]
        for a in p["alternatives"]:
            md.append(f"| {a.get('strategy')} | {a.get('workers')} | {_fmt(a.get('predicted_iteration_s'), '.3g')} | "
                      f"{_fmt(a.get('predicted_epoch_s'), '.3g')} | {_fmt(a.get('predicted_cost_per_epoch_usd'), '.3g')} | "
                      f"{_fmt(a.get('predicted_run_s'), '.3g')} | {_fmt(a.get('predicted_run_cost_usd'), '.3g')} | "
                      f"{a.get('chosen', '')} |")
    md += ["", "## Epochs", "", "| epoch | workers | train loss | val loss | val acc | s | predicted s | samples/s | "
           "predicted iter s | measured iter s | $ |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary.epochs:
        md.append(f"| {e.epoch} | {e.workers} | {e.train_loss:.4f} | {_fmt(e.val_loss)} | {_fmt(e.val_accuracy)} | "
                  f"{e.seconds:.3g} | {_fmt(e.predicted_epoch_s, '.3g')} | {e.samples_per_s:.1f} | "
                  f"{_fmt(e.predicted_iteration_s, '.3g')} | {_fmt(e.measured_iteration_s, '.3g')} | {e.cost_usd:.3g} |")
    md += ["", "| epoch | pre-started | start-up hidden s | exposed s | idle s | relaunched workers | worker pids |",
           "|---|---|---|---|---|---|---|"]
    for e in summary.epochs:
        st = e.startup or {}
        md.append(f"| {e.epoch} | {e.prestarted} | {st.get('hidden_s', 0):.2f} | {st.get('exposed_s', 0):.2f} | "
                  f"{st.get('idle_s', 0):.2f} | {len(e.relaunches)} | "
                  f"{' '.join(str(v) for _, v in sorted(e.worker_pids.items()))} |")
    if summary.worker_seconds:
        md += ["", "Worker-seconds billed: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.worker_seconds.items())]
    md += ["", "## Bill", "", "| resource | kind | status | epoch | offer | seconds | $/s | $ |",
           "|---|---|---|---|---|---|---|---|"]
    for r in ledger_rows:
        md.append(f"| {r['resource']} | {r['kind']} | {r.get('status', '')} | {_fmt(r.get('epoch'), 'd')} | "
                  f"{r['offer']} | {r['seconds']:.2f} | {r['unit_price_per_s']:.3e} | {r['usd']:.6f} |")
    md += ["", f"**Total: ${summary.total_cost_usd:.3g}** (predicted before the first epoch: "
           f"${_fmt(p.get('predicted_run_cost_usd'), '.3g')})"]
    replans = [e for e in summary.epochs if e.replan]
    if replans:
        md += ["", "## Re-planning", "", "| after epoch | step x | layer x | sync x | transfer x | switched | why |",
               "|---|---|---|---|---|---|---|"]
        for e in replans:
            c = e.replan.get("calibration") or {}
            md.append(f"| {e.epoch} | {_fmt(c.get('step_scale'), '.3g')} | {_fmt(c.get('layer_scale'), '.3g')} | "
                      f"{_fmt(c.get('sync_scale'), '.3g')} | "
                      f"{_fmt(c.get('transfer_scale'), '.3g')} | {e.replan.get('switched')} | {e.replan.get('reason')} |")
    if png:
        md += ["", f"![loss, accuracy and cost per epoch](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(md)


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return f"zooid-{what}-{run_id}".lower().replace("_", "-")
