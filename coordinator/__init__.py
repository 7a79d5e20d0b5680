"""The coordinator's machinery below the Prefect tasks, in five rooms whose imports run one way
(lowest first): `run` (job, validation, context, resume), `bill` (ledger, cloud bill),
`workers` (launchers, warm pool, epoch run, failures, cleanup), `plan` (profile on the target,
planning, scaling policy) and `report`. tasks/ wraps their steps."""
import os as _os

# Set before Prefect is imported anywhere: no telemetry from a training tool.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
_os.environ.setdefault("DO_NOT_TRACK", "1")
