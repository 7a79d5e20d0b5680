"""`python -m planners`: JSON in and out, exit 2 naming the field for every invalid input."""
from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import PlannerInputError
from planners.cli import run
from planners.hybrid import hybrid
from planners.partition import partition
from planners.worker_count import provision
from planners.sync_time import sync_time

ROOT = Path(__file__).resolve().parents[1]

LAYER = {"forward_s": 0.1, "backward_s": 0.2, "output_bytes": 1000, "param_bytes": 4000}
DOCS = {
    "partition": {"layers": [dict(LAYER) for _ in range(4)], "bandwidth_bytes_per_s": 1e6,
                  "microbatches": 4, "max_stages": 3},
    "hybrid": {"layers": [dict(LAYER) for _ in range(4)], "bandwidth_bytes_per_s": 1e6,
               "max_stages": 3, "cluster_size": 4, "global_batch": 16, "microbatch_size": 2,
               "allreduce": {"alpha_s_per_byte": 1e-9, "beta_s": 0.001}},
    "provision": {"mode": "BSP", "w_iter_flops": 1e10, "g_param_bytes": 1e6,
                  "c_prof_flops": 1e8, "b_prof_bytes_per_s": 1e6, "c_base_flops": 4e9,
                  "loss_model": {"beta0": 100.0, "beta1": 1.0}, "target_loss": 0.5,
                  "deadline_s": 1e4, "max_workers": 8,
                  "instance_types": [{"name": "m", "cpu_flops": 4e9,
                                      "bandwidth_bytes_per_s": 1e8, "price_per_hour": 0.4}]},
    "sync-time": {"algorithm": "scatter_reduce", "bytes": 1e6, "workers": 4,
                  "bandwidth_bytes_per_s": 1e6, "latency_s": 0.01},
}
FUNCTIONS = {"partition": partition, "hybrid": hybrid, "provision": provision,
             "sync-time": sync_time}


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planners", *args], input=stdin, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def in_process(command: str, doc) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run([command, "-"], stdin=io.StringIO(json.dumps(doc)), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


# --- through a real process ------------------------------------------------------------------

def test_file_in_json_out(tmp_path):
    path = tmp_path / "partition.json"
    path.write_text(json.dumps(DOCS["partition"]))
    done = cli("partition", str(path))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer == partition(DOCS["partition"])
    assert set(answer["by_stages"]) == {"1", "2", "3"}


def test_stdin_and_infeasible_answer_exit_zero():
    doc = dict(DOCS["hybrid"], global_batch=7)  # no A makes 7 / (A * 2) whole
    done = cli("hybrid", "-", stdin=json.dumps(doc))
    assert done.returncode == 0
    answer = json.loads(done.stdout)
    assert answer["feasible"] is False and answer["reason"]


@pytest.mark.parametrize("args, stdin, field", [
    (("partition", "-"), '{"layers": [', "input"),
    (("partition", "-"), "[1, 2]", "input"),
    (("plan-everything", "-"), "{}", "command"),
    (("partition", "/nonexistent/zooid.json"), "", "FILE"),
    (("provision", "-"), json.dumps(dict(DOCS["provision"], mode="SSP")), "mode"),
])
def test_invalid_input_exits_2_with_one_line_naming_the_field(args, stdin, field):
    done = cli(*args, stdin=stdin)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{field}:")


# --- in process: every invalid case of the contract ------------------------------------------

def mutate(doc: dict, path: str, value) -> dict:
    """A copy of doc with the field at `path` (dots and [i]) set to value, or removed when
    value is DELETE."""
    doc = copy.deepcopy(doc)
    keys = path.replace("[", ".").replace("]", "").split(".")
    target = doc
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = keys[-1]
    if value is DELETE:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return doc


DELETE = object()

INVALID = [
    # partition: missing field, wrong type, negative or zero size, empty layer list
    ("partition", "layers", DELETE, "layers"),
    ("partition", "layers", [], "layers"),
    ("partition", "layers", {"a": 1}, "layers"),
    ("partition", "layers[1]", 5, "layers[1]"),
    ("partition", "layers[0].forward_s", DELETE, "layers[0].forward_s"),
    ("partition", "layers[2].backward_s", -1.0, "layers[2].backward_s"),
    ("partition", "layers[3].output_bytes", "1kB", "layers[3].output_bytes"),
    ("partition", "bandwidth_bytes_per_s", 0, "bandwidth_bytes_per_s"),
    ("partition", "bandwidth_bytes_per_s", True, "bandwidth_bytes_per_s"),
    ("partition", "microbatches", 0, "microbatches"),
    ("partition", "microbatches", 2.5, "microbatches"),
    ("partition", "max_stages", DELETE, "max_stages"),
    ("partition", "transport", "carrier-pigeon", "transport"),
    ("partition", "latency_s", -0.1, "latency_s"),
    # hybrid: its own fields and the layers' param_bytes
    ("hybrid", "layers[0].param_bytes", DELETE, "layers[0].param_bytes"),
    ("hybrid", "layers[1].param_bytes", -5, "layers[1].param_bytes"),
    ("hybrid", "cluster_size", 0, "cluster_size"),
    ("hybrid", "global_batch", DELETE, "global_batch"),
    ("hybrid", "microbatch_size", -2, "microbatch_size"),
    ("hybrid", "allreduce", DELETE, "allreduce"),
    ("hybrid", "allreduce", 3, "allreduce"),
    ("hybrid", "allreduce.beta_s", -1, "allreduce.beta_s"),
    ("hybrid", "allreduce.alpha_s_per_byte", "x", "allreduce.alpha_s_per_byte"),
    ("hybrid", "sync", "tree", "sync"),
    ("hybrid", "layers", [], "layers"),
    # provision
    ("provision", "mode", DELETE, "mode"),
    ("provision", "w_iter_flops", 0, "w_iter_flops"),
    ("provision", "g_param_bytes", -1, "g_param_bytes"),
    ("provision", "c_prof_flops", DELETE, "c_prof_flops"),
    ("provision", "b_prof_bytes_per_s", "fast", "b_prof_bytes_per_s"),
    ("provision", "c_base_flops", 0, "c_base_flops"),
    ("provision", "loss_model", DELETE, "loss_model"),
    ("provision", "loss_model.beta0", 0, "loss_model.beta0"),
    ("provision", "loss_model.beta1", DELETE, "loss_model.beta1"),
    ("provision", "target_loss", -0.1, "target_loss"),
    ("provision", "deadline_s", 0, "deadline_s"),
    ("provision", "max_workers", 0, "max_workers"),
    ("provision", "instance_types", [], "instance_types"),
    ("provision", "instance_types[0].name", DELETE, "instance_types[0].name"),
    ("provision", "instance_types[0].cpu_flops", 0, "instance_types[0].cpu_flops"),
    ("provision", "instance_types[0].bandwidth_bytes_per_s", -1,
     "instance_types[0].bandwidth_bytes_per_s"),
    ("provision", "instance_types[0].price_per_hour", -1, "instance_types[0].price_per_hour"),
    # sync-time
    ("sync-time", "algorithm", "ring", "algorithm"),
    ("sync-time", "bytes", 0, "bytes"),
    ("sync-time", "workers", 0, "workers"),
    ("sync-time", "workers", 1.5, "workers"),
    ("sync-time", "bandwidth_bytes_per_s", -1, "bandwidth_bytes_per_s"),
    ("sync-time", "latency_s", DELETE, "latency_s"),
]


@pytest.mark.parametrize("command, path, value, field", INVALID)
def test_every_invalid_field_exits_2_naming_it(command, path, value, field):
    code, out, err = in_process(command, mutate(DOCS[command], path, value))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"{field}:"), err


@pytest.mark.parametrize("command, path", [
    ("partition", "layers[0].forward_s"), ("partition", "bandwidth_bytes_per_s"),
    ("hybrid", "allreduce.alpha_s_per_byte"), ("provision", "deadline_s"),
    ("provision", "loss_model.beta1"), ("sync-time", "bytes"),
])
def test_non_finite_numbers_are_refused(command, path):
    # JSON cannot carry them (the command refuses NaN and Infinity as invalid JSON), but
    # the library functions are called with Python values too
    for bad in (math.inf, math.nan):
        with pytest.raises(PlannerInputError) as err:
            FUNCTIONS[command](mutate(DOCS[command], path, bad))
        assert err.value.field == path
    code, _, err = in_process(command, DOCS[command])
    assert code == 0


def test_non_finite_json_literals_are_invalid_json():
    out, err = io.StringIO(), io.StringIO()
    text = json.dumps(DOCS["sync-time"]).replace("1000000.0", "Infinity", 1)
    assert run(["sync-time", "-"], stdin=io.StringIO(text), stdout=out, stderr=err) == 2
    assert err.getvalue().startswith("input:")


def test_unknown_fields_are_ignored_and_valid_documents_answer():
    for command, doc in DOCS.items():
        code, out, err = in_process(command, dict(doc, comment="from the profiler"))
        assert code == 0, err
        assert json.loads(out) == FUNCTIONS[command](doc)


def test_wrong_argument_count_names_the_command():
    out, err = io.StringIO(), io.StringIO()
    assert run(["partition"], stdin=io.StringIO(""), stdout=out, stderr=err) == 2
    assert err.getvalue().startswith("command:")


def test_co_optimize_is_dispatched():
    pytest.importorskip("planners.co_optimize")
    code, out, err = in_process("co-optimize", {"layers": []})
    assert code == 2 and out == "" and err.count("\n") == 1
