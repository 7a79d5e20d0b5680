"""Re-record the engine answers that tests/test_cloud_docker.py replays:
`python tests/data/docker/record.py IMAGE` with DOCKER_HOST pointing at a Docker-API engine
(`python -m deployments.engine up`). IMAGE needs `sh`, `sleep` and `true` (any busybox image).
Writes one `inspect` answer per container state beside this file."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import docker

HERE = Path(__file__).resolve().parent
LABELS = {"zooid-run": "rec-run", "io.prefect.flow-run-id": ""}


def main(image: str) -> None:
    client = docker.from_env()
    made = {}

    def run(name, command, **kw):
        labels = {**LABELS, "io.prefect.flow-run-id": f"00000000-0000-0000-0000-00000000000{len(made)}"}
        c = client.containers.create(image, command, labels=labels, mem_limit="64m", memswap_limit="64m",
                                     nano_cpus=500_000_000, **kw)
        made[name] = c
        return c

    run("completed", ["sh", "-c", "sleep 0.3; exit 0"]).start()
    run("failed", ["sh", "-c", "exit 3"]).start()
    killed = run("killed", ["sleep", "30"])
    killed.start()
    running = run("running", ["sleep", "30"])
    running.start()
    run("created", ["true"])  # created, never started
    never = run("never_started", ["/no/such/binary"])
    try:
        never.start()
    except docker.errors.APIError:
        pass
    time.sleep(1.0)
    killed.kill()
    time.sleep(0.5)
    for name, c in made.items():
        c.reload()
        (HERE / f"{name}.json").write_text(json.dumps(c.attrs, indent=1, sort_keys=True))
    for c in made.values():
        c.remove(force=True)


if __name__ == "__main__":
    main(sys.argv[1])
