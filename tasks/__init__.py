"""The train flow's steps as retried Prefect tasks, each a thin function over the coordinator."""
import os as _os

# Set before Prefect is imported anywhere: no telemetry from a training tool.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
_os.environ.setdefault("DO_NOT_TRACK", "1")
