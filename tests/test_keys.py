"""One key layout: `core/keys.py` spells every store key, and the strings never drift.

Stored runs are read back and resumed by these exact strings, so each key function's output
is pinned here for a sample run. And by reading the project's source with `ast` (comments and
docstrings do not count), no module other than `core/keys.py` spells `runs/` in a string.
"""
from __future__ import annotations

import ast

import pytest

from core import keys
from tests.source_tree import sources

OWNER = "core/keys.py"
RUN = "abc123"


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string constants that are documentation: docstrings of the module, its
    classes and functions, and bare string statements (attribute docstrings)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.add(id(node.value))
    return out


def string_parts(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every string the code uses: constants and the literal parts of
    f-strings, documentation left out. An f-string's literal parts are joined with `{}` where
    a value goes, so `f"runs/{run}"` reads `runs/{}`."""
    docs = _docstrings(tree)
    found, in_fstrings = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.append((node.lineno, text))
            in_fstrings.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs and id(node) not in in_fstrings):
            found.append((node.lineno, node.value))
    return found


def spellings(needle: str) -> list[str]:
    """`path:line: text` of every string outside core/keys.py that contains `needle`."""
    return [f"{rel}:{line}: {text!r}" for rel, tree in sources().items() if rel != OWNER
            for line, text in string_parts(tree) if needle in text]


def test_the_scanner_reads_strings_and_f_strings_but_not_documentation():
    tree = ast.parse('"""runs/ in a module docstring"""\n'
                     'def f(r):\n'
                     '    """runs/ in a docstring."""\n'
                     '    # runs/ in a comment\n'
                     '    a = "runs/" + r\n'
                     '    b = f"runs/{r}/ckpt"\n'
                     '    c = "/".join(("runs", r))\n')
    assert sorted(string_parts(tree)) == [(5, "runs/"), (6, "runs/{}/ckpt"), (7, "/"), (7, "runs")]


def test_the_scanner_sees_the_project():
    assert OWNER in sources() and "tasks/teardown.py" in sources() and "engine/chaos.py" in sources()
    assert not any(rel.startswith(("tests/", "benchmarks/")) for rel in sources())


def test_no_module_but_core_keys_spells_the_runs_folder():
    bad = spellings("runs/")
    assert not bad, "build these keys with core.keys:\n" + "\n".join(bad)


def test_no_module_but_core_keys_joins_a_key_from_the_runs_folder_name():
    bad = [f"{rel}:{line}" for rel, tree in sources().items() if rel != OWNER
           for line, text in string_parts(tree) if text == keys.RUNS]
    assert not bad, "build these keys with core.keys:\n" + "\n".join(bad)


# --- the layout, pinned ---------------------------------------------------------------

PINNED = [
    (keys.run_prefix(RUN), "runs/abc123"),
    (keys.run_key(RUN), "runs/abc123"),
    (keys.run_key(RUN, "warm/r1-"), "runs/abc123/warm/r1-"),
    (keys.run_key(RUN, "a", "b"), "runs/abc123/a/b"),
    (keys.run_doc_key(RUN), "runs/abc123/run.json"),
    (keys.summary_key(RUN), "runs/abc123/summary.json"),
    (keys.ledger_key(RUN), "runs/abc123/cost.json"),
    (keys.history_key(RUN), "runs/abc123/history.json"),
    (keys.report_key(RUN, "curves.png"), "runs/abc123/report/curves.png"),
    (keys.checkpoint_prefix(RUN), "runs/abc123/ckpt"),
    (keys.init_checkpoint_key(RUN), "runs/abc123/ckpt/init.safetensors"),
    (keys.checkpoint_key(RUN, 3), "runs/abc123/ckpt/epoch-0003.safetensors"),
    (keys.checkpoint_key(RUN, 12345), "runs/abc123/ckpt/epoch-12345.safetensors"),
    (keys.sync_checkpoint_key(RUN, 3), "runs/abc123/ckpt/sync-e3.safetensors"),
    (keys.best_key(RUN), "runs/abc123/ckpt/best.json"),
    (keys.residual_prefix(RUN, 2, 1), "runs/abc123/ckpt/residual/e2/r1/"),
    (keys.residual_key(RUN, 2, 1, 7), "runs/abc123/ckpt/residual/e2/r1/round7.safetensors"),
    (keys.worker_history_prefix(RUN, 2), "runs/abc123/history/e2/"),
    (keys.worker_history_key(RUN, 2, 1, 0), "runs/abc123/history/e2/r1-a0.json"),
    (keys.faults_prefix(RUN), "runs/abc123/faults"),
    (keys.fault_marker_key(RUN, 1, 2, 3), "runs/abc123/faults/e1-r2-a3.json"),
    (keys.held_marker_key(RUN, 1, 2, 3), "runs/abc123/faults/held-e1-r2-a3.json"),
    (keys.preempted_marker_key(RUN, 1, 2, 3), "runs/abc123/faults/preempted-e1-r2-a3.json"),
    (keys.handover_prefix(RUN, 2), "runs/abc123/ckpt/handover/e2"),
    (keys.handover_key(RUN, 2, 1), "runs/abc123/ckpt/handover/e2/r1.safetensors"),
    (keys.sync_prefix(RUN, 4), "runs/abc123/sync/e4"),
    (keys.stage_sync_prefix(RUN, 4, 2), "runs/abc123/sync/e4/s2"),
    (keys.sync_call_prefix(keys.sync_prefix(RUN, 4), 7), "runs/abc123/sync/e4/r7"),
    (keys.sync_call_prefix(keys.stage_sync_prefix(RUN, 4, 2), 7, 3), "runs/abc123/sync/e4/s2/r7/b3"),
    (keys.activation_prefix(RUN, 4), "runs/abc123/act/e4"),
    (keys.activation_replica_prefix(RUN, 4, 1), "runs/abc123/act/e4/r1"),
    (keys.data_prefix(RUN), "runs/abc123/data"),
    (keys.data_split_prefix(RUN, "val"), "runs/abc123/data/val"),
    (keys.data_subset_key(RUN, "train", 5), "runs/abc123/data/train/5"),
    (keys.data_manifest_key(RUN), "runs/abc123/data/manifest.json"),
    (keys.shard_key("", "train", 5), "train/5"),
    (keys.shard_key("corpora/wiki", "val", 0), "corpora/wiki/val/0"),
    (keys.shard_manifest_key(""), "manifest.json"),
    (keys.array_split_prefix("", "train"), "train/"),
    (keys.array_split_prefix("corpora/img", "val"), "corpora/img/val/"),
    (keys.shard_manifest_key("corpora/wiki"), "corpora/wiki/manifest.json"),
    (keys.probe_prefix(RUN), "runs/abc123/probe"),
    (keys.warm_prefix(RUN), "runs/abc123/warm"),
    (keys.lease_key(RUN), "runs/abc123/warm/lease"),
    (keys.command_key(RUN, "r0-w1-c", 7), "runs/abc123/warm/r0-w1-c/cmd-00007.json"),
    (keys.reply_key(RUN, "r0-w1-c", 7), "runs/abc123/warm/r0-w1-c/reply-00007.json"),
    (keys.status_key(RUN, "r0-w1-c"), "runs/abc123/warm/r0-w1-c/status.json"),
    (keys.cache_prefix("targets"), "cache/targets/"),
    (keys.cache_key("models", "0f1e"), "cache/models/0f1e.json"),
    (keys.tokenizer_key("9a8b", "bpe512-bytelevel-v1"), "cache/tokenizers/9a8b-bpe512-bytelevel-v1.json"),
]


@pytest.mark.parametrize("got, want", PINNED, ids=[w for _, w in PINNED])
def test_each_key_is_pinned(got, want):
    assert got == want


def test_teardown_deletes_exactly_the_scratch_kinds():
    assert keys.SCRATCH == ("sync", "act", "data", "probe", "grad", "warm")
    assert keys.scratch_prefixes(RUN) == ("runs/abc123/sync/", "runs/abc123/act/", "runs/abc123/data/",
                                          "runs/abc123/probe/", "runs/abc123/grad/", "runs/abc123/warm/")
    durable = [keys.checkpoint_key(RUN, 0), keys.sync_checkpoint_key(RUN, 0), keys.best_key(RUN),
               keys.residual_key(RUN, 0, 0, 0), keys.worker_history_key(RUN, 0, 0, 0),
               keys.fault_marker_key(RUN, 0, 0, 0), keys.summary_key(RUN), keys.ledger_key(RUN),
               keys.history_key(RUN), keys.run_doc_key(RUN), keys.report_key(RUN, "curves.png")]
    assert not [k for k in durable if k.startswith(keys.scratch_prefixes(RUN))]
    # on a run's store that is not the durable one the workers' records go too
    assert keys.scratch_prefixes(RUN, "store") == keys.scratch_prefixes(RUN) + (
        "runs/abc123/history/", "runs/abc123/faults/")
    # on a durable store that is not the run's store, only the staged data is scratch
    assert keys.scratch_prefixes(RUN, "durable") == ("runs/abc123/data/",)
    records = [keys.worker_history_key(RUN, 0, 0, 0), keys.fault_marker_key(RUN, 0, 0, 0),
               keys.preempted_marker_key(RUN, 0, 0, 0), keys.held_marker_key(RUN, 0, 0, 0)]
    assert all(k.startswith(keys.scratch_prefixes(RUN, "store")) for k in records)
    assert not [k for k in durable if k not in records and k.startswith(keys.scratch_prefixes(RUN, "store"))]


def test_the_key_parsers_read_what_the_builders_write():
    assert int(keys.EPOCH_CHECKPOINT.search(keys.checkpoint_key(RUN, 12)).group(1)) == 12
    assert keys.SYNC_CHECKPOINT.search(keys.sync_checkpoint_key(RUN, 3)).group(1) == "3"
    assert keys.RESIDUAL.search(keys.residual_key(RUN, 5, 1, 2)).group(1) == "5"
    assert not keys.EPOCH_CHECKPOINT.search(keys.sync_checkpoint_key(RUN, 3))
    assert not keys.SYNC_CHECKPOINT.search(keys.checkpoint_key(RUN, 3))
    assert keys.attempt_of(keys.worker_history_key(RUN, 1, 0, 4), 1) == 4
    assert keys.attempt_of(keys.fault_marker_key(RUN, 1, 2, 3), 1) == 3
    assert keys.attempt_of(keys.held_marker_key(RUN, 1, 2, 5), 1) == 5
    assert keys.attempt_of(keys.preempted_marker_key(RUN, 1, 2, 6), 1) == 6
    assert not keys.EPOCH_CHECKPOINT.search(keys.handover_key(RUN, 3, 0))
    assert not keys.SYNC_CHECKPOINT.search(keys.handover_key(RUN, 3, 0))
    assert keys.attempt_of(keys.worker_history_key(RUN, 11, 0, 4), 1) is None
    assert keys.attempt_of(keys.fault_marker_key(RUN, 2, 0, 1), 1) is None
    assert keys.attempt_of(keys.summary_key(RUN), 1) is None


def test_the_old_homes_of_the_key_helpers_give_the_same_keys():
    """Names other modules and tests import from where they used to live."""

    from coordinator.bill.cost import ledger_key
    from engine.chaos import fault_marker_key
    from engine.residuals import residual_key
    from runtime.warm import command_key, reply_key, status_key

    assert fault_marker_key(RUN, 1, 2, 3) == keys.fault_marker_key(RUN, 1, 2, 3)
    assert residual_key(RUN, 2, 1, 7) == keys.residual_key(RUN, 2, 1, 7)
    assert command_key(RUN, "w", 1) == keys.command_key(RUN, "w", 1)
    assert reply_key(RUN, "w", 1) == keys.reply_key(RUN, "w", 1)
    assert status_key(RUN, "w") == keys.status_key(RUN, "w")
    assert ledger_key(RUN) == keys.ledger_key(RUN)

