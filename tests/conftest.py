"""Shared fixtures: a real redis-server, a real S3 API (moto in server mode), a real Azure Blob
API (Azurite), a directory store.

Servers bind to 127.0.0.1 on free ports, run in their own process group and are stopped
by pid, because several people run tests on the same machine at once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
"""Each test file's measured seconds (setup, call and teardown of its tests, summed), written
by `pytest --record-file-seconds` (a whole run) and read to order the files longest first."""
UNMEASURED_SLOW_S = 15.0
"""What a file not in FILE_SECONDS counts for each of its `slow` tests (others count 0)."""


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", action="store_true",
                     help=f"write each test file's seconds to {FILE_SECONDS.name} (the files' order)")


def pytest_collection_modifyitems(config, items):
    """Run the longest files first (so that, split over processes by file, no long file starts
    last while the other processes sit idle), and skip tests marked `gpu` when CUDA is not
    available."""
    recorded = json.loads(FILE_SECONDS.read_text())["files"] if FILE_SECONDS.exists() else {}
    weight: dict[str, float] = {}
    for item in items:
        path = _file_of(item.nodeid)
        if path in recorded:
            weight[path] = recorded[path]
        else:
            weight[path] = weight.get(path, 0.0) + UNMEASURED_SLOW_S * ("slow" in item.keywords)
    files = sorted(dict.fromkeys(_file_of(item.nodeid) for item in items), key=lambda f: -weight[f])
    from tests.docker_stack import uses_the_shared_stack  # it imports this module

    # the session's docker stack stops once its last user file is done: a file that uses it without
    # containers of its own goes among the container files, not last, where the stack idled meanwhile
    containers = {_file_of(item.nodeid) for item in items if "docker" in item.keywords or uses_the_shared_stack(item)}
    order = {f: i for i, f in enumerate(_spread(files, containers, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))))}
    items.sort(key=lambda item: order[_file_of(item.nodeid)])  # stable: a file's own order is kept
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only here: most runs never need it at collection time

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def _spread(files: list[str], heavy: set[str], processes: int) -> list[str]:
    """`files` (longest first) with the `heavy` ones at most one in each `processes` files, in
    their order: the processes take the first `processes` files at once and each the next as it
    finishes one, so the container tests (each several containers on the same cores and engine)
    do not all start together, as they did once the longest files were all theirs."""
    light = [f for f in files if f not in heavy]
    heavy_left = [f for f in files if f in heavy]
    spread = []
    while light or heavy_left:
        take_heavy = heavy_left and (not light or len(spread) % max(1, processes) == 0)
        spread.append(heavy_left.pop(0) if take_heavy else light.pop(0))
    return spread


def _file_of(nodeid: str) -> str:
    """The test file of a test id (`tests/test_x.py::test_y[a]` -> `tests/test_x.py`)."""
    return nodeid.split("::")[0]


_seconds_by_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = _file_of(report.nodeid)
    _seconds_by_file[path] = _seconds_by_file.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With --record-file-seconds, the main process (which sees every process's reports)
    writes FILE_SECONDS once the whole run passed."""
    config = session.config
    if not config.getoption("record_file_seconds") or hasattr(config, "workerinput") or exitstatus != 0:
        return
    code = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=FILE_SECONDS.parent,
                          capture_output=True, text=True).stdout.strip()
    files = {path: round(s, 1) for path, s in sorted(_seconds_by_file.items(), key=lambda kv: -kv[1])}
    FILE_SECONDS.write_text(json.dumps({"code": code, "files": files}, indent=1) + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    """Block until something accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


ORPHAN_GUARD = Path(__file__).resolve().parent.parent / "deployments" / "orphan_guard.py"


def guarded(command: list[str]) -> list[str]:
    """`command` under the project's orphan guard (`deployments.orphan_guard`, standard library
    only, so run by its path): stopped when this test process dies, even by SIGKILL."""
    return [sys.executable, str(ORPHAN_GUARD), str(os.getpid()), "--", *command]


def stop_process_group(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def serving(server):
    """Start `server`, yield it, stop it (a fixture's body)."""
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisServer:
    """A redis-server on 127.0.0.1 without persistence; `restart()` keeps the port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:<port>/0`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1",
             "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for_port(self.port)

    def stop(self) -> None:
        """Stop the server (its data is gone: no persistence)."""
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down `down_s` seconds, start again on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the whole session (skips only if it is not installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    yield from serving(RedisServer(tmp_path_factory.mktemp("redis")))


@dataclass
class S3Server:
    """moto's S3 API on 127.0.0.1; `create_bucket(name)` returns the bucket name."""

    endpoint: str

    def client(self):
        """A boto3 S3 client for this endpoint."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def create_bucket(self, name: str) -> str:
        """Create bucket `name` (idempotent) and return its name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server():
    """moto in server mode (a thread in this process) with dummy credentials in the env."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    wait_for_port(port)
    try:
        yield S3Server(endpoint=f"http://127.0.0.1:{port}")
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


AZURITE_BIN = Path(__file__).resolve().parent.parent / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


@dataclass
class AzuriteServer:
    """Azurite's Blob API on 127.0.0.1, data on disk in `workdir`; `restart()` keeps port and data.

    The account is Azurite's documented development account (`devstoreaccount1` and its
    published key), so a client with any other key is refused."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    account: str = "devstoreaccount1"
    account_key: str = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
                        "K1SZFPTOtr/KBHBeksoGMGw==")

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint, `http://127.0.0.1:<port>/devstoreaccount1`."""
        return f"http://127.0.0.1:{self.port}/{self.account}"

    def connection_string(self, key: str | None = None) -> str:
        """The account's connection string (with `key` instead of the account's, if given)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account};"
                f"AccountKey={key or self.account_key};BlobEndpoint={self.endpoint};")

    def create_container(self, name: str) -> str:
        """Create container `name` (idempotent) and return its name."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(self.connection_string()) as client:
            try:
                client.create_container(name)
            except ResourceExistsError:
                pass
        return name

    def start(self) -> None:
        """Start Azurite and wait until it accepts connections."""
        log = open(self.workdir / "azurite.log", "ab")
        self.proc = subprocess.Popen(guarded(
            [str(AZURITE_BIN), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--location", str(self.workdir / "data"), "--skipApiVersionCheck", "--disableTelemetry",
             "--silent"]), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for_port(self.port, timeout=30)

    def stop(self) -> None:
        """Stop Azurite (its data stays on disk): SIGTERM, on which it writes its database and
        closes; time for that even on a loaded machine (killed after 5 s, a container created
        just before was lost and the restart test read ContainerNotFound)."""
        if self.proc is not None:
            stop_process_group(self.proc, timeout=30.0)
            self.proc = None

    def restart(self) -> None:
        """Stop, then start again on the same port with the same data."""
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    """A real Azurite Blob API for the whole session (`make azurite` installs it)."""
    if not AZURITE_BIN.exists():
        pytest.skip(f"Azurite is not installed at {AZURITE_BIN} (make azurite)")
    yield from serving(AzuriteServer(tmp_path_factory.mktemp("azurite")))


@pytest.fixture
def dir_store(tmp_path):
    """A fresh directory store under the test's tmp_path."""
    from comm.store_dir import DirectoryStore

    store = DirectoryStore(tmp_path / "store")
    yield store
    store.close()
