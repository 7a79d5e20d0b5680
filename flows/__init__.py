"""The flows people run: `train` (the coordinator), `worker` (one worker's epoch), `plan` (dry run)."""
import os as _os

# Set before Prefect is imported anywhere: no telemetry from a training tool.
_os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
_os.environ.setdefault("DO_NOT_TRACK", "1")
# On a busy 2-core machine the temporary server can take longer than Prefect's default 20 s.
_os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
