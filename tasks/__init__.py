"""Thin Prefect tasks: each adapts one step between Prefect or cloud I/O and the planners or the engine."""
import os as _os

# Set before Prefect is imported anywhere: no telemetry from a training tool.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
_os.environ.setdefault("DO_NOT_TRACK", "1")
