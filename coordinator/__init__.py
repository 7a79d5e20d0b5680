"""The coordinator's machinery below the Prefect tasks: the run's context and state, the job
schema and its validation, launchers and the warm pool, the ledger and the cloud bill, failures,
sweeps, pre-start, the co-planner's adapter, resume and the report. tasks/ wraps its steps."""
import os as _os

# Set before Prefect is imported anywhere: no telemetry from a training tool.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
_os.environ.setdefault("DO_NOT_TRACK", "1")
