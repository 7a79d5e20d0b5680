"""The `nesterov` outer step's settings for a job's epochs (`core.outer_defaults`: the user's
`outer_lr` / `outer_momentum`, or what the sync period bears where they are null), and the one
line of the run's log that says what they are, or warns that explicit ones exceed the bound."""
from __future__ import annotations

import logging

from coordinator.run.job import TrainJob
from core.outer_defaults import OuterSettings, outer_settings, round_steps


def job_outer_settings(job: TrainJob, steps_per_epoch: int) -> OuterSettings:
    """The outer lr and momentum of an epoch of `steps_per_epoch` steps per replica (a round is
    the sync period, or the epoch when the job syncs once an epoch)."""
    return outer_settings(round_steps(job.sync_period, steps_per_epoch), job.outer_lr, job.outer_momentum)


def log_outer_settings(job: TrainJob, steps_per_epoch: int) -> str | None:
    """Say once, through the flow's logger, what the outer step will use: info, or a warning
    when explicit settings exceed what the period bears; None (and nothing logged) for K-AVG."""
    if job.outer_optimizer != "nesterov":
        return None
    settings = job_outer_settings(job, steps_per_epoch)
    try:
        from prefect.logging import get_run_logger

        logger = get_run_logger()
    except Exception:  # no flow run (a test, the dry run's caller): the module's logger
        logger = logging.getLogger(__name__)
    line = settings.line()
    logger.log(logging.WARNING if settings.unstable else logging.INFO, line)
    return line
