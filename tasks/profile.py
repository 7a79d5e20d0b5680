"""The `profile` step (`coordinator.plan.target_profile`): the model and the store, measured where
the workers run, and cached."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.plan.target_profile import measure_profile
from coordinator.run.context import RunContext
from coordinator.run.retry import task_options


def profile(ctx: RunContext) -> dict:
    """Profile the job's model and store on the target, shown as the run's `profile` task.
    Not a task itself: a worker it starts holds a paid-worker slot for its life, and a slot
    taken inside a task run is let go when the task ends."""
    prof = measure_profile(ctx)
    show_profile(prof)
    return prof


@task(name="profile", cache_policy=NO_CACHE, **task_options(retries=0, timeout_s=60))
def show_profile(prof: dict) -> dict:
    """Where the profile was taken and what it says (the UI's view of the profile step)."""
    keys = ("device", "device_name", "threads", "torch", "profile_sources", "profile_s", "step_s", "param_bytes",
            "peak_memory_bytes", "store_bandwidth_bytes_per_s", "store_latency_s", "checkpoint_s")
    return {k: prof.get(k) for k in keys}
