"""The container engine that runs the `docker` target's workers: podman's Docker Engine API on a
Unix socket the project owns (Docker itself, or any engine already at `DOCKER_HOST`, works too).

    python -m deployments.engine up      # install podman if missing, serve its API; prints DOCKER_HOST
    python -m deployments.engine down    # stop the API service this checkout started (by pid)
    python -m deployments.engine status

Podman is configured by a containers.conf under `$ZOOID_HOME/engine/` (never the
system-wide one): runc as the runtime and cgroupfs as the cgroup manager (crun refuses
hybrid cgroup hierarchies), and ulimits the container may keep without raising RLIMIT_NPROC.
The service runs in a session of its own and is stopped by pid.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from clouds.docker import docker_client
from core.errors import ZooidValueError
from deployments.server import alive, spawn, stop_groups, zooid_home

CONTAINERS_CONF = """\
# Written by deployments.engine: podman's configuration for Zooid's containers.
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
DEBIAN_PACKAGES = ("podman", "runc", "mmdebstrap")


class EngineError(ZooidValueError):
    """The container engine is missing or does not answer (one line, naming `target`)."""


def engine_dir(home: Path | None = None) -> Path:
    return (home or zooid_home()) / "engine"


def socket_path(home: Path | None = None) -> Path:
    """The API socket: under /tmp when `$ZOOID_HOME` is too deep for a Unix socket path."""
    path = engine_dir(home) / "podman.sock"
    if len(str(path)) > 100:
        import hashlib

        path = Path("/tmp") / f"zooid-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}.sock"
    return path


def containers_conf(home: Path | None = None) -> Path:
    """Write (if changed) and return the project's containers.conf."""
    conf = engine_dir(home) / "containers.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return conf


def podman_env(home: Path | None = None) -> dict[str, str]:
    """Variables a `podman` command of this project runs with."""
    return {"CONTAINERS_CONF": str(containers_conf(home))}


def ensure_installed() -> None:
    """Install podman, runc and mmdebstrap from Debian's packages when podman is missing."""
    if shutil.which("podman") and shutil.which("mmdebstrap"):
        return
    if not shutil.which("apt-get"):
        raise EngineError("target", "the docker target needs a container engine; install podman "
                          "(or Docker and set DOCKER_HOST)")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    print(f"zooid: installing {' '.join(DEBIAN_PACKAGES)} (Debian packages)", flush=True)
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True, stdin=subprocess.DEVNULL)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", *DEBIAN_PACKAGES], check=True,
                   stdin=subprocess.DEVNULL, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def podman(*args: str, home: Path | None = None, check: bool = True, capture: bool = True,
           **kwargs) -> subprocess.CompletedProcess:
    """Run `podman args...` with the project's configuration."""
    return subprocess.run(["podman", *args], env={**os.environ, **podman_env(home)}, check=check,
                          stdin=subprocess.DEVNULL, capture_output=capture, text=True, **kwargs)


def _state_file(home: Path | None) -> Path:
    return engine_dir(home) / "service.json"


def docker_host(home: Path | None = None) -> str:
    return f"unix://{socket_path(home)}"


def ping(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a Docker Engine API answers at `url`."""
    try:
        client = docker_client(url, timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def up(home: Path | None = None, timeout_s: float = 60.0) -> dict:
    """Serve podman's Docker API on the project's socket (no-op when it already answers);
    return {"docker_host", "pid", "started"}."""
    url = docker_host(home)
    state_file = _state_file(home)
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    if state and alive(state["pid"]) and ping(url):
        return {**state, "started": False}
    ensure_installed()
    sock = socket_path(home)
    sock.unlink(missing_ok=True)
    pid = spawn(["podman", "system", "service", "--time=0", url], podman_env(home),
                engine_dir(home) / "service.log")
    deadline = time.monotonic() + timeout_s
    while not ping(url):
        if not alive(pid) or time.monotonic() > deadline:
            stop_groups([pid])
            raise EngineError("target", f"podman's API did not start on {url} "
                              f"(see {engine_dir(home) / 'service.log'})")
        time.sleep(0.2)
    state = {"docker_host": url, "pid": pid}
    state_file.write_text(json.dumps(state))
    return {**state, "started": True}


def down(home: Path | None = None) -> list[int]:
    """Stop the API service `up` started, by pid."""
    state_file = _state_file(home)
    if not state_file.exists():
        return []
    pid = json.loads(state_file.read_text())["pid"]
    stop_groups([pid])
    state_file.unlink(missing_ok=True)
    socket_path(home).unlink(missing_ok=True)
    return [pid]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.engine", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    if args.command == "up":
        state = up()
        print(f"DOCKER_HOST={state['docker_host']}")
    elif args.command == "down":
        print(f"stopped pids {down()}")
    else:
        url = docker_host()
        print(json.dumps({"docker_host": url, "answers": ping(url)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
