"""A Docker Engine API on 127.0.0.1 that answers from recorded `inspect` documents
(tests/data/docker/, recorded from podman by record.py there): list by label, inspect, stop
(the container exits 143 at the fake's stop clock) and delete. docker-py talks to it over real
HTTP, so `clouds.docker` runs all of its own code against it."""
from __future__ import annotations

import copy
import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from clouds.docker import API_VERSION

DATA = Path(__file__).resolve().parent / "data" / "docker"


def recorded(name: str) -> dict:
    """One recorded `inspect` answer (completed, failed, killed, running, created, never_started)."""
    return json.loads((DATA / f"{name}.json").read_text())


def stamp(seconds: float) -> str:
    """An engine timestamp (RFC 3339, nanoseconds, Z) for epoch seconds."""
    dt = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}123Z"


def container(name: str, cid: str, labels: dict, **state) -> dict:
    """A recorded answer re-labelled as container `cid`, its State fields replaced by `state`."""
    doc = copy.deepcopy(recorded(name))
    doc["Id"] = cid
    doc["Config"]["Labels"] = dict(labels)
    doc["State"].update(state)
    return doc


class FakeEngine:
    """Serve `containers` (id -> inspect document) until `close()`; `calls` records what was asked."""

    def __init__(self, containers: dict[str, dict], stop_at: float):
        self.containers, self.stop_at = containers, stop_at
        self.calls: list[tuple[str, str]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body=None):
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _path(self):
                url = urlsplit(self.path)
                parts = [p for p in url.path.split("/") if p]
                if parts and parts[0].startswith("v1."):
                    parts = parts[1:]
                return parts, parse_qs(url.query)

            def _find(self, cid: str):
                return next((c for k, c in engine.containers.items() if k.startswith(cid)), None)

            def do_GET(self):
                parts, query = self._path()
                if parts == ["_ping"]:
                    return self._send(200, "OK")
                if parts == ["containers", "json"]:
                    wanted = json.loads(query.get("filters", ["{}"])[0]).get("label", [])
                    found = [c for c in engine.containers.values()
                             if all(c["Config"]["Labels"].get(k) == v for k, _, v in (w.partition("=") for w in wanted))]
                    return self._send(200, [{"Id": c["Id"], "Labels": c["Config"]["Labels"],
                                             "State": c["State"]["Status"]} for c in found])
                if len(parts) == 3 and parts[0] == "containers" and parts[2] == "json":
                    doc = self._find(parts[1])
                    return self._send(200, doc) if doc else self._send(404, {"message": "no such container"})
                return self._send(404, {"message": f"not faked: {self.path}"})

            def do_POST(self):
                parts, _ = self._path()
                if len(parts) == 3 and parts[0] == "containers" and parts[2] == "stop":
                    doc = self._find(parts[1])
                    if doc is None:
                        return self._send(404, {"message": "no such container"})
                    engine.calls.append(("stop", doc["Id"][:12]))
                    if doc["State"]["Status"] == "running":
                        doc["State"].update(Status="exited", Running=False, ExitCode=143,
                                            FinishedAt=stamp(engine.stop_at))
                    return self._send(204)
                return self._send(404, {"message": f"not faked: {self.path}"})

            def do_DELETE(self):
                parts, _ = self._path()
                doc = self._find(parts[1]) if len(parts) == 2 and parts[0] == "containers" else None
                if doc is None:
                    return self._send(404, {"message": "no such container"})
                engine.calls.append(("remove", doc["Id"][:12]))
                del engine.containers[doc["Id"]]
                return self._send(204)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"tcp://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.url, version=API_VERSION, timeout=10)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
