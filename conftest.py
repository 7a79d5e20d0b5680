"""Root test configuration: an isolated Prefect home and Zooid home for the whole session."""
import os
import tempfile

_home = tempfile.mkdtemp(prefix="zooid-test-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_home, "prefect"))
os.environ.setdefault("ZOOID_HOME", os.path.join(_home, "zooid"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_api():
    """A real, temporary Prefect API server (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
