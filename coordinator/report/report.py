"""What a person reads: the text report, the Prefect artifacts, and the plots.

Every rendering follows one order, meant to be read in 30 seconds: a headline (status, final
accuracy or loss, wall time and bill, each beside its prediction), the plan in words and then
in detail, the alternatives the planner considered (each once, one chosen), the co-optimiser's
comparison on one basis, the epochs and the bill. Values go through one formatter per kind
(`money`, `duration`, `number`, `percent`, `yes_no`, `text`), so no Python repr (None, (),
True) reaches a person, and tables wider than a 1,000-pixel pane (`MAX_WIDTH` characters) are
split in two (`table_lines`).
"""
from __future__ import annotations

import base64
import io
import textwrap

from coordinator.bill.cost import spot_line, store_lines
from coordinator.report.sync_words import outer_sync_row, outer_sync_words
from coordinator.run.job import RunSummary
from core.epoch_summary import EpochSummary
from core.formats import NONE, duration, gigabytes, money, number, percent, sig, text, yes_no
from core.kinds import Strategy
from core.store_ops import StoreOps
from planners.store_prices import requests_words

MAX_WIDTH = 120
"""Characters a line of the text report, or a table's row, may take (a 1,000-pixel pane)."""
STRATEGY_NAMES = {Strategy.LOCAL_SGD: "Local-SGD", Strategy.PIPELINE: "pipeline", Strategy.HYBRID: "hybrid"}


def strategy_name(s) -> str:
    return STRATEGY_NAMES.get(s, text(s))


# --- tables ----------------------------------------------------------------------------------

def _width(headers: list[str], rows: list[list[str]], cols: list[int], markdown: bool) -> int:
    """Characters a row takes: aligned text puts 2 spaces between cells, markdown ` | `."""
    cells = sum(max(len(headers[c]), *(len(r[c]) for r in rows)) for c in cols)
    return cells + (3 * len(cols) + 1 if markdown else 2 * (len(cols) - 1))


def _split(headers: list[str], rows: list[list[str]], width: int, keep: int, markdown: bool) -> list[list[int]]:
    """Column groups that each fit `width`, the first `keep` columns repeated in each."""
    groups, current = [], list(range(keep))
    for c in range(keep, len(headers)):
        if len(current) > keep and _width(headers, rows, current + [c], markdown) > width:
            groups.append(current)
            current = list(range(keep))
        current.append(c)
    groups.append(current)
    return groups


def table_lines(headers: list[str], rows: list[list[str]], markdown: bool, width: int = MAX_WIDTH,
                keep: int = 1) -> list[str]:
    """A table as markdown or aligned text; split into tables that each fit `width` characters,
    the first `keep` (identifying) columns repeated in each."""
    rows = [[c if isinstance(c, str) else text(c) for c in r] for r in rows]
    out: list[str] = []
    for cols in _split(headers, rows, width, keep, markdown):
        if out:
            out.append("")
        if markdown:
            out.append("| " + " | ".join(headers[c] for c in cols) + " |")
            out.append("|" + "|".join("---" for _ in cols) + "|")
            out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
        else:
            w = {c: max(len(headers[c]), *(len(r[c]) for r in rows)) for c in cols}
            out += [_aligned(cells, cols, w, keep) for cells in [headers, *rows]]
    return out


def _aligned(cells: list[str], cols: list[int], w: dict[int, int], keep: int) -> str:
    """One row of an aligned text table: identifying columns to the left, values to the right."""
    return "  ".join(cells[c].ljust(w[c]) if i < keep else cells[c].rjust(w[c]) for i, c in enumerate(cols)).rstrip()


def _wrap(line: str, width: int = MAX_WIDTH) -> list[str]:
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_on_hyphens=False) or [line]


# --- what the run measured -------------------------------------------------------------------

def run_seconds(summary: RunSummary, ledger_rows: list[dict] | None) -> tuple[float | None, str]:
    """The run's measured wall time and where it came from: a field of the summary where it has
    one, else the coordinator's ledger row (its start to its stop), else the epochs' sum."""
    for name in ("wall_s", "run_s", "seconds"):
        v = getattr(summary, name, None)
        if isinstance(v, (int, float)):
            return float(v), "wall time"
    coordinator = [r for r in ledger_rows or () if r.get("kind") == "coordinator"]
    if coordinator:
        start = min(r["start"] for r in coordinator)
        stop = max(r["stop"] for r in coordinator)
        return max(0.0, stop - start), "wall time"
    if summary.epochs:
        return sum(e.seconds for e in summary.epochs), "epochs' time"
    return None, "wall time"


def cost_curve(ledger_rows: list[dict]) -> list[tuple[float, float]]:
    """The run's cumulative bill over time: (seconds since the first row started, dollars so
    far), from (0, 0) to the last stop and the ledger's total, every row counted (coordinator,
    start-up, busy, idle, failed attempts). Exact at each point: between two of them every open
    interval bills linearly."""
    rows = [r for r in ledger_rows if r.get("start") is not None and r.get("stop") is not None]
    if not rows:
        return [(0.0, 0.0)]
    t0 = min(r["start"] for r in rows)
    times = sorted({r["start"] for r in rows} | {max(r["start"], r["stop"]) for r in rows})

    def billed(t: float) -> float:  # a store's requests (`fixed_usd`) are billed at the row's stop
        return sum(max(0.0, min(t, r["stop"]) - r["start"]) * r["unit_price_per_s"]
                   + (r.get("fixed_usd") or 0.0) * (t >= r["stop"]) for r in rows)

    points = [(t - t0, billed(t)) for t in times]
    total = sum(r.get("usd", max(0.0, r["stop"] - r["start"]) * r["unit_price_per_s"]) for r in ledger_rows)
    points[-1] = (points[-1][0], total)  # the ledger's own total, rounding and all
    return points if points[0] == (0.0, 0.0) else [(0.0, 0.0)] + points


PAID_FOR = {"startup": "start-up", "busy": "training", "idle": "idle", "profile": "profiling",
            "completed": "workers", "cold": "workers", "failed": "failed attempts"}
"""What a worker's ledger status (or a `worker_seconds` key) paid for, in words."""


def bill_by_kind(ledger_rows: list[dict]) -> list[tuple[str, float, float]]:
    """(what it paid for, seconds, dollars) over the ledger: workers' start-up, busy, idle,
    whole cold attempts, failed attempts, the coordinator; empty groups left out."""
    groups: dict[str, list[float]] = {}
    for r in ledger_rows:
        if r.get("kind") in ("coordinator", "store"):
            name = r["kind"]
        elif r.get("kind") == "worker":
            name = PAID_FOR.get(r.get("status"), text(r.get("status")))
        else:
            name = "failed attempts"
        g = groups.setdefault(name, [0.0, 0.0])
        g[0] += r.get("seconds", 0.0) if name != "store" else 0.0  # a store row's interval is the run's
        g[1] += r.get("usd", 0.0)
    last = ["idle", "failed attempts", "coordinator", "store"]
    order = ["profiling", "start-up", "training", "workers"]
    order += [k for k in groups if k not in order + last]
    return [(k, *groups[k]) for k in order + last if k in groups]


# --- plots -----------------------------------------------------------------------------------

def _figure_png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def plot_curves(epochs: list[EpochSummary], ledger_rows: list[dict] | None = None) -> bytes:
    """PNG of training/validation loss and validation accuracy (perplexity, for token targets)
    per epoch; with `ledger_rows`, beside them the cumulative bill over the whole ledger
    (`cost_curve`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e.epoch for e in epochs]
    fig, axes = plt.subplots(1, 3 if ledger_rows else 2, figsize=(11 if ledger_rows else 7.5, 3.2))
    axes[0].plot(xs, [e.train_loss for e in epochs], marker="o", label="train")
    if any(e.val_loss is not None for e in epochs):
        axes[0].plot(xs, [e.val_loss for e in epochs], marker="o", label="validation")
    axes[0].set(title="loss", xlabel="epoch")
    axes[0].legend()
    if trains_tokens(epochs):
        axes[1].plot(xs, [e.val_perplexity for e in epochs], marker="o", color="tab:green")
        axes[1].set(title="validation perplexity", xlabel="epoch")
    else:
        axes[1].plot(xs, [e.val_accuracy for e in epochs], marker="o", color="tab:green")
        axes[1].set(title="validation accuracy", xlabel="epoch")
    if ledger_rows:
        _cost_axes(axes[2], ledger_rows)
    return _figure_png(fig)


def _cost_axes(ax, ledger_rows: list[dict]) -> None:
    points = cost_curve(ledger_rows)
    ax.plot([t for t, _ in points], [c for _, c in points], color="tab:red")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set(title=f"cumulative bill, {money(points[-1][1])} in all", xlabel="seconds since the run started",
           ylabel="USD")


def plot_cost(ledger_rows: list[dict]) -> bytes:
    """PNG of the cumulative bill over the whole ledger, from 0 to its total (`cost_curve`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    _cost_axes(ax, ledger_rows)
    return _figure_png(fig)


# --- the plan ----------------------------------------------------------------------------------

def _size(p: dict) -> str:
    stage = p.get("stage_memory_gb")
    return gigabytes(stage) + " per stage" if stage else gigabytes(p.get("worker_memory_gb"))


def _vcpu(v) -> str:
    return NONE if v is None else f"{float(v):g}"


def _schedule(p: dict) -> str:
    if (p.get("stages") or 1) <= 1:
        return NONE
    return text(p.get("pipeline_schedule"))


def _sync(p: dict) -> str:
    if (p.get("data_parallel") or 1) <= 1:
        return "none (one replica)"
    k = p.get("sync_period")
    ring = " over the ring" if p.get("collective") == "ring" else ""
    note = f" (the ring not compared: {p['collective_note']})" if p.get("collective_note") else ""
    return ("once per epoch" if not k else f"every {k} steps") + ring + note


def plan_in_words(p: dict) -> str:
    """One sentence: what runs, on what, how it synchronises."""
    if not p:
        return "No plan was made."
    d, m = p.get("data_parallel") or 1, p.get("stages") or 1
    workers = p.get("workers") or d * m
    size = f"{_vcpu(p.get('worker_vcpu'))} vCPU and {_size(p)}"
    steps = (f"{p['steps_per_epoch']} steps of {p.get('batch_size')} samples per replica per epoch"
             if p.get("steps_per_epoch") else "")
    if p.get("strategy") == Strategy.LOCAL_SGD and d == 1:
        what = f"Local-SGD on one worker ({size}): one replica, nothing to average"
    elif p.get("strategy") == Strategy.LOCAL_SGD:
        what = (f"Local-SGD: {d} replicas, one per worker ({size} each), "
                f"averaging the model {_sync(p)}")
    else:
        pipe = (f"a {m}-stage pipeline ({text(p.get('pipeline_schedule'))} schedule, "
                f"{p.get('microbatches', 1)} micro-batches)")
        what = (f"{pipe[0].upper()}{pipe[1:]} on {workers} workers ({size})" if d == 1 else
                f"{strategy_name(p.get('strategy'))}: {d} replicas of {pipe}, {workers} workers ({size}), "
                f"averaging the replicas {_sync(p)}")
    if sync := outer_sync_words(p):
        what += f"; {sync}"
    scaled = p.get("predicted_workers_by_epoch")
    if scaled:
        what += f"; the scaling policy runs {', '.join(map(str, scaled))} workers in the epochs to come"
    return what + (f"; {steps}." if steps else ".")


TERM_NAMES = {"startup_s": "start-up", "epoch_overhead_s": "epoch overhead", "gap_s": "gap between epochs",
              "provision_s": "provisioning", "teardown_s": "teardown", "stop_s": "stop", "warmup_s": "warm-up",
              "exposed_s": "exposed start-up", "startup_one_s": "one worker's start-up"}


def run_terms_text(terms: dict) -> str:
    """The run's terms outside the workers' compute, each marked when assumed, not measured."""
    measured = terms.get("measured") or {}
    how = {"profile": " (from the profile)", True: "", False: " (assumed)"}
    words = [f"{TERM_NAMES.get(k, k)} {duration(v)}{how.get(measured.get(k) or False, '')}"
             for k, v in terms.items() if k not in ("measured", "own_store_ops") and v is not None]
    own = terms.get("own_store_ops") or {}
    if own:  # counts by part and store role (`coordinator.plan.own_requests`), as requests in all
        words.append("the run's own store requests " + ", ".join(
            f"{OWN_PARTS[part]} {sum(max(0, n) for ops in own[part].values() for n in ops.values()):,}"
            for part in OWN_PARTS if part in own))
    return ", ".join(words)


OWN_PARTS = {"epoch": "an epoch", "staging": "staging", "teardown": "teardown"}


def plan_details(summary: RunSummary) -> list[tuple[str, str]]:
    """The plan, field by field, in words and units."""
    p = summary.plan
    if not p:
        return []
    d, m = p.get("data_parallel") or 1, p.get("stages") or 1
    workers = p.get("workers") or d * m
    chunks = p.get("chunks") or 1
    schedule = NONE if m <= 1 else (f"{text(p.get('pipeline_schedule'))}, {p.get('microbatches', 1)} micro-batches, "
                                    f"{chunks} model chunk{'s' if chunks != 1 else ''} per worker")
    price = p.get("price_per_worker_s")
    offer = text(p.get("offer")) + (f" ({money(price * 3600)} per worker-hour)" if price else "")
    offer += ("; " + p["offer_reason"]) if p.get("offer_reason") else \
        "; the target's billing offer unless the job names one (`offer`)"
    term_text = run_terms_text(p.get("run_terms") or {})
    rows = [("strategy", f"{strategy_name(p.get('strategy'))}, D={d} replica{'s' if d != 1 else ''} x "
                         f"{m} stage{'s' if m != 1 else ''}"),
            ("workers x size", f"{workers} x {_vcpu(p.get('worker_vcpu'))} vCPU, {_size(p)}"
                               + (f", {p['worker_gpu']} GPU" if p.get("worker_gpu") else "")),
            ("schedule", schedule),
            ("sync period", _sync(p)),
            *outer_sync_row(p, summary.epochs),
            ("steps per epoch", f"{text(p.get('steps_per_epoch'))} x batch {text(p.get('batch_size'))}"),
            ("store", text(p.get("store") or summary.store_url)),
            *([("target", text(p["target"]))] if p.get("target") else []),
            ("offer", offer),
            ("predicted epoch", f"{duration(p.get('predicted_epoch_s'))}, {money(p.get('predicted_cost_per_epoch_usd'))}"
                                f" (first epoch {duration(p.get('predicted_first_epoch_s'))}; iteration "
                                f"{duration(p.get('predicted_iteration_s'))})"),
            ("predicted run", f"{duration(p.get('predicted_run_s'))}, {money(p.get('predicted_run_cost_usd'))}"),
            *([("predicted store", store_prediction_words(p))] if p.get("predicted_store_ops") else [])]
    if term_text:
        rows.append(("run terms", term_text))
    return rows


def store_prediction_words(p: dict) -> str:
    """The plan's store prediction: its dollars in the run and one epoch's requests."""
    ops = StoreOps.from_dict(p.get("predicted_store_ops"))
    return (f"{money(p.get('predicted_store_usd'))} in the run's bill; each epoch "
            f"{requests_words(ops) or 'no requests'} (syncs, hand-offs and checkpoints), with its warm channel and "
            f"the run's own requests where an earlier run on the target measured them")


def _uniform_gb(plan: dict) -> float | None:
    """The size the planner's uniform alternatives were planned at: the target's (the plan's
    own, unless the co-optimiser gave its stages sizes of their own)."""
    uniform = (plan.get("co_optimizer") or {}).get("uniform") or {}
    return uniform.get("worker_memory_gb") or (None if plan.get("stage_memory_gb") else plan.get("worker_memory_gb"))


def _alt_size(a: dict, plan: dict) -> tuple:
    if a is plan:
        return tuple(plan.get("stage_memory_gb") or ()) or (plan.get("worker_memory_gb"),)
    return tuple(a.get("stage_memory_gb") or ()) or (a.get("worker_memory_gb") or _uniform_gb(plan),)


def _alt_key(a: dict, plan: dict) -> tuple:
    """What tells two rows of the alternatives table apart: strategy, schedule (and model
    chunks), D, stages, size, collective."""
    size = _alt_size(a, plan)
    stages = a.get("stages") or 1
    return (a.get("strategy"), a.get("pipeline_schedule") if stages > 1 else None,
            (a.get("chunks") or 1) if stages > 1 else 1, a.get("data_parallel"), stages,
            tuple(float(g) for g in size if g is not None), a.get("collective") or "store")


def alternatives(plan: dict) -> list[dict]:
    """The plan's alternatives, each distinct plan once (a later row of the same plan replaces
    an earlier one: its predictions are the later, fuller ones), exactly one `chosen`: the one
    that is the plan, added when the planner's list does not hold it."""
    rows: dict[tuple, dict] = {}
    for a in plan.get("alternatives") or ():
        key = _alt_key(a, plan)
        rows[key] = {**a, "chosen": bool(a.get("chosen")) or bool(rows.get(key, {}).get("chosen"))}
    if not plan:
        return []
    mine = _alt_key(plan, plan)
    if mine not in rows:
        if not rows:
            return []
        rows[mine] = {k: plan.get(k) for k in ("strategy", "data_parallel", "stages", "workers", "cuts",
                                               "microbatches", "pipeline_schedule", "chunks", "collective",
                                               "stage_memory_gb", "worker_memory_gb",
                                               "predicted_iteration_s", "predicted_epoch_s",
                                               "predicted_cost_per_epoch_usd", "predicted_run_s",
                                               "predicted_run_cost_usd")}
    return [{**a, "chosen": key == mine} for key, a in rows.items()]


def alternatives_table(plan: dict, markdown: bool) -> list[str]:
    """One row per alternative (`$ / epoch`: its workers'); where some plan pays the store, a
    `store $ / epoch` column with its store requests' dollars, which its `run $` includes; where
    the plans average over different collectives (`collective=auto`), a `collective` column."""
    rows, rows_in = [], alternatives(plan)
    store = any(a.get("predicted_store_usd_per_epoch") for a in rows_in)
    collectives = len({a.get("collective") or "store" for a in rows_in}) > 1
    for a in rows_in:
        stages = a.get("stages") or 1
        schedule = NONE if stages <= 1 else text(a.get("pipeline_schedule")) + (
            f" x{a['chunks']}" if (a.get("chunks") or 1) > 1 else "")
        if a.get("fits") is False:  # a schedule compared, or a candidate whose workers it would overfill
            schedule = "does not fit" if schedule == NONE else schedule + " (does not fit)"
        rows.append(["chosen" if a["chosen"] else "", strategy_name(a.get("strategy")), schedule,
                     *([text(a.get("collective") or "store")] if collectives else []),
                     text(a.get("data_parallel")), text(stages),
                     gigabytes([g for g in _alt_size(a, plan) if g is not None] or None),
                     duration(a.get("predicted_iteration_s")), duration(a.get("predicted_epoch_s")),
                     money(a.get("predicted_cost_per_epoch_usd")),
                     *([money(a.get("predicted_store_usd_per_epoch") or 0.0)] if store else []),
                     duration(a.get("predicted_run_s")), money(a.get("predicted_run_cost_usd"))])
    if not rows:
        return []
    return table_lines(["", "strategy", "schedule", *(["collective"] if collectives else []), "D", "stages", "size",
                        "iteration", "epoch", "$ / epoch", *(["store $ / epoch"] if store else []), "run", "run $"],
                       rows, markdown, keep=7 if collectives else 6)


# --- the co-optimiser ------------------------------------------------------------------------

def co_optimizer_comparison(co: dict, markdown: bool) -> list[str]:
    """What the co-optimiser compared, on one basis (the flow's prediction of the workers'
    compute per epoch, the numbers it decides by), and the verdict those numbers give."""
    if not co:
        return []
    if "sizes_gb" not in co:
        return [f"Co-optimiser not used: {text(co.get('reason'))}."]
    u, c = co.get("uniform"), co.get("co_optimised")
    rows, named = [], []
    for name, r in (("uniform (one size)", u), ("co-optimised", c)):
        if r and r.get("predicted_epoch_s") is not None:
            rows.append([name, strategy_name(r.get("strategy")), text(r.get("data_parallel")), text(r.get("stages")),
                         gigabytes(r.get("stage_memory_gb") or r.get("worker_memory_gb")),
                         duration(r.get("predicted_epoch_s")), money(r.get("predicted_cost_per_epoch_usd"))])
            named.append(r)
        else:
            rows.append([name, NONE, NONE, NONE, "does not fit", NONE, NONE])
    lines = [f"Co-optimiser ({text(co.get('solver'))}, worker sizes {gigabytes(co['sizes_gb'])}; "
             f"{text(co.get('assumption'))}; rule: {text(co.get('rule'))}).",
             "Both plans predicted the same way: the workers' compute per epoch.", ""]
    lines += table_lines(["plan", "strategy", "D", "stages", "sizes", "epoch", "$ / epoch"], rows, markdown)
    lines += ["", co_optimizer_verdict(co)]
    return lines


def co_optimizer_verdict(co: dict) -> str:
    """One sentence that follows from the comparison's numbers, and what the run used."""
    u, c = co.get("uniform"), co.get("co_optimised")
    used = "the co-optimised plan" if co.get("used") else "the uniform plan"
    if not (u and u.get("predicted_epoch_s")):
        return f"Verdict: the uniform plan does not fit; the run used {used}."
    if not (c and c.get("predicted_epoch_s")):
        return f"Verdict: no co-optimised plan fits; the run used {used}."
    tu, tc = u["predicted_epoch_s"], c["predicted_epoch_s"]
    cu, cc = u.get("predicted_cost_per_epoch_usd") or 0.0, c.get("predicted_cost_per_epoch_usd") or 0.0

    def rel(a: float, b: float, more: str, less: str, same: str) -> str:
        if b <= 0 or abs(a - b) / b < 0.005:
            return same
        return f"{sig(abs(a - b) / b * 100, 2)}% {more if a > b else less}"

    sentence = (f"the co-optimised plan is {rel(tc, tu, 'slower', 'faster', 'equally fast')} and "
                f"{rel(cc, cu, 'dearer', 'cheaper', 'equally cheap')} per epoch than the uniform one")
    default_rule = not co.get("rule") or str(co.get("rule")).startswith("the fastest, and within")
    if default_rule:
        faster = tc < tu
        within = max(tc, tu) <= min(tc, tu) * 1.05
        better = (cc < cu or (cc == cu and tc < tu)) if within else faster
        verdict = "co-optimised" if better else "uniform"
        agrees = (verdict == "co-optimised") == bool(co.get("used"))
        why = ("within 5% of each other's time, the cheaper wins" if within else "the faster wins")
        end = (f": {why}, so the run used {used}." if agrees else
               f": by the rule the {verdict} plan wins, yet the run used {used} ({text(co.get('reason'))}).")
        return "Verdict: " + sentence + end
    return f"Verdict: {sentence}; by its rule ({co.get('rule')}) the run used {used}."


def co_optimizer_lines(co: dict) -> list[str]:
    """What the co-optimiser compared (or why it was not needed), as markdown lines: the dry
    run's view, its own model's figures per size beside the flow's prediction of the plans."""
    if not co:
        return []
    if "sizes_gb" not in co:
        return [f"Co-optimiser not used: {text(co.get('reason'))}."]
    lines = [f"Co-optimiser ({text(co.get('solver'))}, worker sizes {gigabytes(co['sizes_gb'])}; "
             f"{text(co.get('assumption'))}): {'used' if co.get('used') else 'not used'}, {text(co.get('reason'))}.",
             "", "Its own model, per iteration and per epoch:", ""]
    rows = []
    for name, r in [("co-optimised", co.get("co_optimised"))] + [
            (f"best uniform at {u['memory_gb']:g} GB", u) for u in co.get("uniform_by_size", ())]:
        if not r or "t_iter_s" not in r:
            rows.append([name, NONE, NONE, NONE, "does not fit", NONE, NONE, NONE, NONE])
            continue
        rows.append([name, text(r["data_parallel"]), text(r["stages"]), text(r["cuts"]),
                     gigabytes(r["stage_memory_gb"]), duration(r["t_iter_s"]), money(r["c_iter_usd"]),
                     duration(r["epoch_s"]), money(r["cost_per_epoch_usd"])])
    lines += table_lines(["compared", "D", "stages", "cuts", "stage sizes", "iteration", "$ / iteration", "epoch",
                          "$ / epoch"], rows, markdown=True)
    u, c = co.get("uniform"), co.get("co_optimised")
    if u:
        lines += ["", f"The uniform plan it would otherwise run: {strategy_name(u['strategy'])} D={u['data_parallel']} "
                      f"M={u['stages']} at {gigabytes(u['worker_memory_gb'])}, {duration(u['predicted_epoch_s'])} and "
                      f"{money(u['predicted_cost_per_epoch_usd'])} per epoch (workers' compute)."]
    if c and "predicted_epoch_s" in c:
        sizes = gigabytes(c.get("stage_memory_gb") or [c["worker_memory_gb"]])
        lines += [f"The co-optimised plan as launched (stage sizes {sizes}): {duration(c['predicted_epoch_s'])} and "
                  f"{money(c['predicted_cost_per_epoch_usd'])} per epoch (workers' compute)."]
    if u and c and "predicted_epoch_s" in c:
        lines += ["", co_optimizer_verdict(co)]
    return lines


# --- the renderings ----------------------------------------------------------------------------

def headline(summary: RunSummary, ledger_rows: list[dict] | None) -> list[str]:
    """Status, final accuracy (perplexity, for token targets) or loss, wall time and bill, each
    beside its prediction; for token targets, the tokens trained, tokens per second and dollars
    per million tokens."""
    p = summary.plan
    if summary.final_perplexity is not None:
        result = (f"final perplexity {number(summary.final_perplexity, 4)} (loss {number(summary.final_loss, 4)}, "
                  f"token accuracy {percent(summary.final_token_accuracy)})")
    elif summary.final_accuracy is not None:
        result = f"final accuracy {percent(summary.final_accuracy)} (loss {number(summary.final_loss, 4)})"
    elif summary.final_loss is not None:
        result = f"final loss {number(summary.final_loss, 4)}"
    else:
        result = "no epoch completed"
    seconds, basis = run_seconds(summary, ledger_rows)
    epochs = len(summary.epochs)
    after = seconds_after_plan(p, ledger_rows)
    predicted = duration(p.get("predicted_run_s"))
    timing = (f"{basis} {duration(seconds)}, of which {duration(after)} after the plan (predicted {predicted})"
              if after is not None else f"{basis} {duration(seconds)} (predicted {predicted}"
              + (" from the plan on)" if p.get("predicted_run_s") else ")"))
    lines = [f"{summary.status}: {result}" + (f" after {epochs} epoch{'s' if epochs != 1 else ''}" if epochs else ""),
             f"{timing}; total cost {money(summary.total_cost_usd)} (predicted {money(p.get('predicted_run_cost_usd'))})"]
    if summary.tokens_trained:
        lines.append(f"{summary.tokens_trained:,} tokens trained at {number(summary.tokens_per_s)} tokens/s; "
                     f"{money(summary.usd_per_million_tokens)} per million tokens")
    return lines


def seconds_after_plan(plan: dict, ledger_rows: list[dict] | None) -> float | None:
    """From the plan to the run's end (the coordinator's stop): what the plan's run time
    predicts (the profile and everything before the plan are already behind it)."""
    stops = [r["stop"] for r in ledger_rows or () if r.get("kind") == "coordinator"]
    if not plan.get("planned_at") or not stops:
        return None
    return max(0.0, max(stops) - plan["planned_at"])


def trains_tokens(epochs: list[EpochSummary]) -> bool:
    """Whether a run's epochs trained on token targets (its figures are in tokens)."""
    return any(e.tokens or e.val_perplexity is not None for e in epochs)


def epoch_rows(summary: RunSummary) -> tuple[list[str], list[list[str]]]:
    """The epochs table: accuracy and samples per second; for token targets perplexity, token
    accuracy and tokens per second instead."""
    tokens = trains_tokens(summary.epochs)
    headers = (["epoch", "workers", "train loss", "val loss"]
               + (["perplexity", "token accuracy"] if tokens else ["accuracy"])
               + ["time (predicted)", "cost", "tokens/s" if tokens else "samples/s", "step (predicted)"])

    def beside(measured, predicted) -> str:
        return duration(measured) + (f" ({duration(predicted)})" if predicted is not None else "")

    rows = [[str(e.epoch), str(e.workers) + (f" ({e.stages} stages)" if e.stages > 1 else ""),
             number(e.train_loss, 4), number(e.val_loss, 4),
             *([number(e.val_perplexity, 4), percent(e.val_token_accuracy)] if tokens else [percent(e.val_accuracy)]),
             beside(e.seconds, e.predicted_epoch_s), money(e.cost_usd),
             number(e.tokens_per_s if tokens else e.samples_per_s),
             beside(e.measured_iteration_s, e.predicted_iteration_s)] for e in summary.epochs]
    return headers, rows


def bill_lines(summary: RunSummary, ledger_rows: list[dict] | None, markdown: bool) -> list[str]:
    groups = bill_by_kind(ledger_rows or [])
    if not groups:
        return []
    rows = [[name, duration(s) if name != "store" else "", money(usd)] for name, s, usd in groups]
    rows.append(["total", "", money(summary.total_cost_usd)])
    stores = store_lines(ledger_rows or [])
    return table_lines(["paid for", "seconds", "cost"], rows, markdown) + (
        ["", *(f"- {line}" if markdown else f"  {line}" for line in stores)] if stores else [])


def epoch_table(epochs: list[EpochSummary]) -> list[dict]:
    """Rows for the per-epoch table artifact (strings only, units in the values); for token
    targets perplexity, token accuracy and tokens per second beside them."""
    tokens = trains_tokens(epochs)
    return [{"epoch": e.epoch, "workers": e.workers, "stages": e.stages,
             "train loss": number(e.train_loss, 4), "val loss": number(e.val_loss, 4),
             "val accuracy": percent(e.val_accuracy), "time": duration(e.seconds),
             "predicted": duration(e.predicted_epoch_s), "samples/s": number(e.samples_per_s),
             **({"val perplexity": number(e.val_perplexity, 4), "token accuracy": percent(e.val_token_accuracy),
                 "tokens/s": number(e.tokens_per_s)} if tokens else {}),
             "iteration": duration(e.measured_iteration_s),
             "predicted iteration": duration(e.predicted_iteration_s),
             "cost": money(e.cost_usd)} for e in epochs]


def infrastructure_ids(rows: list[dict]) -> list[str]:
    """Each worker's infrastructure id (task, container group, pod or container) as the
    cloud-clock rows name it (`worker ... on <id>`), in the order they were billed."""
    return list(dict.fromkeys(r["resource"].rsplit(" on ", 1)[1] for r in rows
                              if r["kind"] in ("worker", "failed_attempt") and " on " in r["resource"]))


def text_report(summary: RunSummary, ledger: dict | None = None) -> str:
    """The report printed at the end of `make run` and `python -m flows.train`: no line wider
    than `MAX_WIDTH` characters."""
    p = summary.plan
    rows = ledger["rows"] if ledger else None
    lines = [f"Zooid run {summary.run_id}: {summary.status}", *headline(summary, rows)]
    if summary.error:
        lines.append(f"error: {summary.error}")
    lines += ["", "Plan: " + plan_in_words(p)]
    details = plan_details(summary)
    if details:
        w = max(len(k) for k, _ in details)
        lines += [f"  {k.ljust(w)}  {v}" for k, v in details]
    alt = alternatives_table(p, markdown=False)
    if alt:
        lines += ["", "Alternatives considered:", *alt]
    co = co_optimizer_comparison(p.get("co_optimizer") or {}, markdown=False)
    if co:
        lines += ["", *co]
    if summary.epochs:
        headers, erows = epoch_rows(summary)
        lines += ["", "Epochs:", *table_lines(headers, erows, markdown=False)]
        for e in summary.epochs:
            if e.replan is not None and e.replan.switched:
                lines.append(f"  re-planned after epoch {e.epoch}: {text(e.replan.reason)}")
    infra = infrastructure_ids(rows) if rows else []
    if infra:
        lines += ["", "workers ran on: " + ", ".join(infra)]
    ws = {k: v for k, v in summary.worker_seconds.items() if v}
    if ws:
        lines += ["", "worker time billed: " + ", ".join(f"{PAID_FOR.get(k, k)} {duration(v)}" for k, v in ws.items())]
    spot = spot_line(summary.spot)
    if spot:
        lines += ["", f"spot capacity: {spot}"]
    bill = bill_lines(summary, rows, markdown=False)
    if bill:
        lines += ["", "Bill:", *bill]
    lines += ["", f"total cost {money(summary.total_cost_usd)} (predicted {money(p.get('predicted_run_cost_usd'))})"
              + (f", {len(rows)} ledger rows" if rows else "")]
    return "\n".join(out for line in lines for out in _wrap(line))


def markdown_report(summary: RunSummary, ledger_rows: list[dict], png: bytes | None, *,
                    cost_plot: bool = True) -> str:
    """The markdown artifact: headline, plan, alternatives, co-optimiser, epochs, bill and the
    plots (`png`: the loss and accuracy curves; `cost_plot`: the cumulative bill over the
    ledger, drawn here)."""
    p = summary.plan
    head = headline(summary, ledger_rows)
    md = [f"# Zooid run `{summary.run_id}`: {summary.status}", "", f"**{head[0]}**  ",
          head[1] + ("." + "  " if head[2:] else "."), *(h + "." for h in head[2:])]
    if summary.error:
        md += ["", f"Error: {summary.error}"]
    md += ["", "## Plan", "", plan_in_words(p)]
    details = plan_details(summary)
    if details:
        md += ["", *(f"- **{k}**: {v}" for k, v in details)]
    alt = alternatives_table(p, markdown=True)
    if alt:
        md += ["", "### Alternatives considered", "", *alt]
    co = co_optimizer_comparison(p.get("co_optimizer") or {}, markdown=True)
    if co:
        md += ["", "### Co-optimiser", "", *co]
    if summary.epochs:
        headers, rows = epoch_rows(summary)
        md += ["", "## Epochs", "", *table_lines(headers, rows, markdown=True)]
        md += ["", *table_lines(
            ["epoch", "pre-started", "start-up hidden", "start-up exposed", "idle", "relaunched", "worker pids"],
            [[str(e.epoch), yes_no(e.prestarted), duration(e.startup.get("hidden_s", 0.0)),
              duration(e.startup.get("exposed_s", 0.0)), duration(e.startup.get("idle_s", 0.0)),
              str(len(e.relaunches)), " ".join(str(v) for _, v in sorted(e.worker_pids.items())) or NONE]
             for e in summary.epochs], markdown=True)]
    ws = {k: v for k, v in summary.worker_seconds.items() if v}
    if ws:
        md += ["", "Worker time billed: " + ", ".join(f"{PAID_FOR.get(k, k)} {duration(v)}" for k, v in ws.items()) + "."]
    spot = spot_line(summary.spot)
    if spot:
        md += ["", f"Spot capacity: {spot}."]
    md += ["", "## Bill", ""]
    bill = bill_lines(summary, ledger_rows, markdown=True)
    if bill:
        md += [*bill, ""]
    if ledger_rows:
        md += table_lines(["resource", "kind", "status", "epoch", "offer", "seconds", "per second", "cost"],
                          [[r["resource"], r["kind"], text(r.get("status")), text(r.get("epoch")), text(r["offer"]),
                            duration(r["seconds"]), money(r["unit_price_per_s"]), money(r["usd"])]
                           for r in ledger_rows], markdown=True)
    md += ["", f"**Total: {money(summary.total_cost_usd)}** (predicted before the first epoch: "
           f"{money(p.get('predicted_run_cost_usd'))})"]
    replans = [e for e in summary.epochs if e.replan]
    if replans:
        md += ["", "## Re-planning", ""]
        rows = []
        for e in replans:
            c = e.replan.calibration
            rows.append([str(e.epoch), number(c.get("step_scale")), number(c.get("layer_scale")),
                         number(c.get("sync_scale")), number(c.get("transfer_scale")),
                         yes_no(e.replan.switched), text(e.replan.reason)])
        md += table_lines(["after epoch", "step x", "layer x", "sync x", "transfer x", "switched", "why"], rows,
                          markdown=True)
    if png:
        md += ["", f"![loss and accuracy per epoch](data:image/png;base64,{base64.b64encode(png).decode()})"]
    if cost_plot and ledger_rows:
        md += ["", f"![cumulative bill](data:image/png;base64,{base64.b64encode(plot_cost(ledger_rows)).decode()})"]
    return "\n".join(md)
