"""Root test configuration: an isolated Prefect home and Zooid home for the whole session; the
main process stops the services the session's test processes shared (`tests.shared_services`)."""
import os
import tempfile
from pathlib import Path

_home = tempfile.mkdtemp(prefix="zooid-test-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_home, "prefect"))
os.environ.setdefault("ZOOID_HOME", os.path.join(_home, "zooid"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402

from tests.shared_services import stop_shared_services  # noqa: E402


def pytest_sessionfinish(session):
    """The main process stops every shared service once all test processes are done."""
    if not hasattr(session.config, "workerinput"):
        stop_shared_services(session.config)


@pytest.fixture(scope="session")
def prefect_api():
    """A real, temporary Prefect API server (SQLite) for the whole session (of each test
    process), its database copied from the install's migrated template
    (`deployments.prefect_db`): Prefect's harness keeps its database as `prefect-test.db` in
    a folder it makes with `mkdtemp`, which is given that folder already seeded."""
    import prefect.testing.utilities as harness

    from deployments.prefect_db import DB, seed_home

    def seeded_mkdtemp() -> str:
        folder = tempfile.mkdtemp(prefix="prefect-api-")
        if seed_home(Path(folder)):
            os.replace(os.path.join(folder, DB), os.path.join(folder, "prefect-test.db"))
        return folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "mkdtemp", seeded_mkdtemp)
        with harness.prefect_test_harness(server_startup_timeout=180):
            yield
