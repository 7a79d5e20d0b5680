"""Stores that keep their own request logs, for checking Zooid's counts (`Store.ops`) against
them: moto's S3 server with its recorder on (every request, one JSON line each), and Azurite
with its access log on (one line per request). Each reads its log back as `StoreOps`, by the
same request kinds Zooid counts (`core.store_ops`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from core.store_ops import StoreOps
from tests.conftest import (AZURITE_BIN, S3_ENV, AzuriteServer, free_port, guarded, stop_process_group,
                            wait_for_port)


def _tally(kinds: list[str]) -> StoreOps:
    return StoreOps(**{k: kinds.count(k) for k in set(kinds)})


_LOCKED_RECORDER = """
import sys, threading
from moto.moto_api import recorder
from moto.server import main
lock, record = threading.Lock(), recorder._record_request
def locked(*args, **kwargs):
    with lock:  # the server's threads would interleave their lines in the recording
        return record(*args, **kwargs)
recorder._record_request = locked
main(sys.argv[1:])
"""
"""moto's server (`moto.server.main`) with its recorder's writes one at a time."""


@dataclass
class RecordingS3:
    """moto's S3 API in its own process with the recorder on (`MOTO_ENABLE_RECORDING`)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def recording(self) -> Path:
        return self.workdir / "moto_recording.jsonl"

    def start(self) -> None:
        """Start the server; this process's clients get its dummy credentials until `stop`."""
        self.saved = {k: os.environ.get(k) for k in S3_ENV}
        os.environ.update(S3_ENV)
        env = dict(os.environ, MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=str(self.recording))
        self.proc = subprocess.Popen(guarded([sys.executable, "-c", _LOCKED_RECORDER, "-H", "127.0.0.1",
                                              "-p", str(self.port)]),
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_for_port(self.port, timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None
        for k, v in getattr(self, "saved", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def create_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def reset(self) -> None:
        """Forget the requests so far."""
        self.recording.write_text("")

    def ops(self, bucket: str) -> StoreOps:
        """The recorded requests on `bucket` by kind."""
        kinds = []
        for line in self.recording.read_text().splitlines():
            entry = json.loads(line)
            url = urlsplit(entry["url"])
            if url.path.strip("/").split("/")[0] != bucket:
                continue
            kinds.append(s3_kind(entry["method"], url.path, parse_qs(url.query, keep_blank_values=True)))
        return _tally(kinds)


def s3_kind(method: str, path: str, query: dict) -> str:
    """The kind of one S3 request (`core.store_ops.REQUEST_KINDS`)."""
    if method == "POST" and "delete" in query:
        return "delete"  # DeleteObjects
    if method in ("PUT", "POST"):
        return "put"  # PutObject, UploadPart, Create/CompleteMultipartUpload
    if method == "GET" and "list-type" in query:
        return "list"
    return {"GET": "get", "HEAD": "head", "DELETE": "delete"}[method]


_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[\d.]+" (?P<status>\d+)')


@dataclass
class LoggingAzurite(AzuriteServer):
    """Azurite with its access log on (not `--silent`): one line per request."""

    def start(self) -> None:
        if not AZURITE_BIN.exists():
            raise FileNotFoundError(AZURITE_BIN)
        self.log_path = self.workdir / "access.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(guarded(
            [str(AZURITE_BIN), "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--location", str(self.workdir / "data"), "--skipApiVersionCheck", "--disableTelemetry"]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_for_port(self.port, timeout=30)

    def _settled(self) -> str:
        """The whole log, every request answered so far included. Azurite writes a request's
        line once its response has gone out, so a client may be past it before it is written:
        a marker request sent afterwards is logged after every earlier one; we read up to it."""
        import urllib.request

        mark = f"/{self.account}/zooid-log-mark-{time.monotonic_ns()}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}{mark}", timeout=5)
        except OSError:
            pass  # refused (no credentials): logged all the same
        deadline = time.monotonic() + 10
        while True:
            text = self.log_path.read_text()
            if mark in text or time.monotonic() > deadline:
                return text
            time.sleep(0.01)  # polling for the marker's line, not ordering events by time

    def reset(self) -> None:
        """Forget the requests so far."""
        self.offset = len(self._settled())

    def ops(self, container: str) -> StoreOps:
        """The logged requests on `container` by kind, since `reset`."""
        text = self._settled()[getattr(self, "offset", 0):]
        kinds = []
        for m in _ACCESS.finditer(text):
            url = urlsplit(m["target"])
            parts = url.path.strip("/").split("/")
            if len(parts) < 2 or parts[1] != container:
                continue
            kinds.append(azure_kind(m["method"], parse_qs(url.query)))
        return _tally(kinds)


def azure_kind(method: str, query: dict) -> str:
    """The kind of one Blob service request (`core.store_ops.REQUEST_KINDS`)."""
    comp = query.get("comp", [""])[0]
    if method == "POST" and comp == "batch":
        return "delete"  # a Blob Batch of deletes
    if method == "GET" and comp == "list":
        return "list"
    return {"PUT": "put", "GET": "get", "HEAD": "head", "DELETE": "delete"}[method]
