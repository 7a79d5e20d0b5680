"""`TrainJob` is made of sections (`coordinator.run.job.SECTIONS`), and nothing changed for
users: the form's and the command line's parameters keep their names, defaults and checks."""
from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from coordinator.run.job import SECTIONS, JobSection, TrainJob
from coordinator.run.job_fields import job_from_fields
from core.errors import ZooidValueError

# TrainJob's fields and defaults as they were when it was one flat model, in that model's order
BEFORE = {
    'model': 'digits_mlp', 'dataset': 'digits', 'loss': None, 'tokenizer': 'bytes', 'objective': 'causal',
    'seq_len': 128, 'epochs': 5, 'batch_size': 16, 'lr': 0.05, 'optimizer': 'momentum', 'strategy': 'auto',
    'workers': 4, 'stages': None, 'microbatches': None, 'pipeline_schedule': 'auto', 'sync_period': None,
    'collective': 'store', 'outer_optimizer': 'average', 'outer_lr': None, 'outer_momentum': None,
    'sync_dtype': 'float32', 'scaling': 'static', 'scale_every_epochs': 1, 'min_workers': 1, 'max_workers': 8,
    'seed': 0, 'store': '', 'durable_store': '', 'target': 'inline', 'worker_vcpu': None,
    'worker_memory_gb': None, 'offer': None, 'budget_usd': None, 'deadline_s': None, 'target_accuracy': None,
    'target_loss': None, 'prestart': True, 'resume': None, 'warm': True, 'worker_lease_s': 60.0,
    'keep_checkpoints': 3, 'worker_timeout_s': 900.0,
}


ADDED = {"data_cache_mb": None, "capacity": "on_demand", "spot_preemptions_before_on_demand": 2, "spot_spares": 0,
         "sync_checkpoint_s": None}
"""Fields added since, each after the field it follows in its section."""


def _order_now() -> list[str]:
    """BEFORE's order with the one move the sections made (`seed` joins the model and data), and
    the fields added since."""
    order = [n for n in BEFORE if n != "seed"]
    order.insert(order.index("seq_len") + 1, "seed")
    order.insert(order.index("seed") + 1, "data_cache_mb")
    order.insert(order.index("offer") + 1, "capacity")
    order.insert(order.index("capacity") + 1, "spot_preemptions_before_on_demand")
    order.insert(order.index("spot_preemptions_before_on_demand") + 1, "spot_spares")
    order.insert(order.index("outer_momentum") + 1, "sync_checkpoint_s")
    return order


def test_every_field_belongs_to_exactly_one_section_in_the_sections_order():
    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        assert issubclass(section, JobSection) and section.__doc__
        for name in section.model_fields:
            owners.setdefault(name, []).append(section.__name__)
    assert {n: len(o) for n, o in owners.items()} == {n: 1 for n in TrainJob.model_fields}
    assert list(TrainJob.model_fields) == [n for s in SECTIONS for n in s.model_fields] == _order_now()
    assert TrainJob.__bases__ == tuple(reversed(SECTIONS))
    assert [len(s.model_fields) for s in SECTIONS] == [8, 4, 5, 7, 4, 9, 4, 6]


def test_every_field_has_a_title_and_a_description_for_the_form():
    assert [n for n, f in TrainJob.model_fields.items() if not (f.title and f.description)] == []


def test_the_json_schema_has_the_same_properties_and_defaults():
    schema = TrainJob.model_json_schema()
    assert {n: p["default"] for n, p in schema["properties"].items()} == {**BEFORE, **ADDED}
    assert list(schema["properties"]) == _order_now()
    assert schema["title"] == "TrainJob" and schema["additionalProperties"] is False
    assert "required" not in schema


def test_the_flat_flow_takes_the_same_keyword_parameters():
    from prefect.utilities.callables import parameter_schema

    from flows.train import train_with_params

    params = inspect.signature(train_with_params.fn).parameters
    assert {n: p.default for n, p in params.items()} == {**BEFORE, **ADDED}
    assert list(params) == _order_now()
    assert {p.kind for p in params.values()} == {inspect.Parameter.KEYWORD_ONLY}
    form = parameter_schema(train_with_params.fn).model_dump()
    assert {n: p["default"] for n, p in form["properties"].items()} == {**BEFORE, **ADDED}
    assert [n for n, p in sorted(form["properties"].items(), key=lambda np: np[1]["position"])] == _order_now()


def test_a_job_stays_frozen_flat_and_closed():
    job = TrainJob(seed=3, lr=0.1, sync_period=2, max_workers=16, target="local", warm=False)
    assert (job.seed, job.lr, job.sync_period, job.max_workers, job.target, job.warm) == (3, 0.1, 2, 16, "local", False)
    assert job.model_dump() == {**BEFORE, **ADDED, "seed": 3, "lr": 0.1, "sync_period": 2, "max_workers": 16,
                                "target": "local", "warm": False}
    with pytest.raises(ValidationError):
        job.lr = 1.0
    with pytest.raises(ZooidValueError, match=r"^wrokers: unknown parameter; valid: model, dataset, loss, "):
        job_from_fields({"wrokers": 2})


@pytest.mark.parametrize("fields,line", [
    ({"model": "  "}, "model: must not be empty"),                       # ModelAndData's check
    ({"target": " "}, "target: must be one of "),                        # TargetAndStore's check
    ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"scaling": "deadline"}, "deadline_s: required by scaling=deadline"),  # TrainJob's checks across sections
    ({"sync_dtype": "int8", "optimizer": "adam"}, "sync_dtype: int8 rounds Adam's second moments"),
    ({"min_workers": 5, "max_workers": 4}, "min_workers: 5 must be <= max_workers (4)"),
    ({"workers": 9}, "workers: 9 must lie within min_workers..max_workers (1..8)"),
])
def test_each_section_keeps_its_checks(fields, line):
    with pytest.raises(ZooidValueError) as refused:
        job_from_fields(fields)
    assert str(refused.value).startswith(line)
