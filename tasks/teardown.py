"""The `teardown` step: stop every worker of the run and remove its scratch keys.

Runs in the flow's `finally` and in its failure, crash and cancellation hooks, so it is
idempotent. Workers are found three ways: the launchers still held, the processes tagged
with the run id (`/proc` sweep, which also finds workers whose coordinator died), and, for
pool targets, the worker flow runs tagged `zooid-run:<run_id>`. Checkpoints, the summary
and the ledger are kept; data subsets, sync slices and probes are deleted.
"""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from coordinator.run.context import RunContext
from coordinator.workers.cleanup import teardown_run


@task(name="teardown", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=300)
def teardown(ctx: RunContext) -> dict:
    """Prefect task around `teardown_run`."""
    return teardown_run(ctx)
