"""A seeded chaos schedule of spot preemptions on the docker target: the provider taking a
container back is `podman stop -t GRACE` (SIGTERM, then SIGKILL after the grace).

The gaps between preemptions are drawn from an exponential law (a Poisson process, as
interruptions of independent capacity are) with `mean_s`, from `random.Random(seed)`; at
each draw one of the run's running spot containers (label `zooid.capacity=spot`) is chosen by
the same generator, sorted by name so the choice depends on the seed and the set, not on the
engine's listing order; a container already stopped (working through its notice) is not drawn
again. A draw that finds no running spot container waits for one; a listing
the engine fails is tried again at the next poll (its error kept in `errors`). The stop
(`clouds.docker.preempt`) runs in its own thread (it blocks for up to the grace), so the
schedule goes on; each event records whether the container left within the grace or was killed.
"""
from __future__ import annotations

import random
import threading
import time



class Preemptor(threading.Thread):
    """Stops one of run `run_id`'s spot containers about every `mean_s` seconds, with `grace_s`
    between SIGTERM and SIGKILL, until `stop()`. `events`: one dict per preemption (`at`,
    `container`, `name`, `grace_s`, `stopped_s`: how long the engine's stop took, `exit_code`,
    `killed`: it outlived the grace, `gone`: it had ended meanwhile)."""

    def __init__(self, run_id: str, *, mean_s: float = 20.0, grace_s: int = 10, seed: int = 0,
                 poll_s: float = 0.2, capacity: str = "spot"):
        super().__init__(daemon=True, name=f"preemptor-{run_id}")
        self.run_id, self.mean_s, self.grace_s, self.poll_s, self.capacity = run_id, mean_s, grace_s, poll_s, capacity
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.errors: list[str] = []
        """The engine's errors while listing the run's containers (each listing is tried again)."""
        self._done = threading.Event()
        self._stops: list[threading.Thread] = []

    def stop(self) -> None:
        """End the schedule and wait for the stops under way."""
        self._done.set()
        self.join(60)
        for t in self._stops:
            t.join(self.grace_s + 30)

    def run(self) -> None:
        from clouds.docker import CAPACITY_LABEL, docker_client, run_containers

        engine = docker_client()
        try:
            due = time.time() + self.rng.expovariate(1.0 / self.mean_s)
            while not self._done.wait(self.poll_s):
                if time.time() < due:
                    continue
                try:
                    listed = run_containers(engine, self.run_id)
                except Exception as exc:  # the engine blinked (a timeout under load): look again
                    self.errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    continue
                running = sorted((c for c in listed if c.status == "running"
                                  and (c.labels or {}).get(CAPACITY_LABEL) == self.capacity
                                  and c.id[:12] not in self._stopped()),
                                 key=lambda c: c.name)
                if not running:
                    continue
                victim = self.rng.choice(running)
                event = {"at": time.time(), "container": victim.id[:12], "name": victim.name,
                         "grace_s": self.grace_s}
                self.events.append(event)
                stopper = threading.Thread(target=self._preempt, args=(engine, victim, event), daemon=True)
                stopper.start()
                self._stops.append(stopper)
                due = time.time() + self.rng.expovariate(1.0 / self.mean_s)
        finally:
            engine.close()

    def _stopped(self) -> set[str]:
        """The containers this schedule already stopped: one the provider is taking back (it
        may work through its notice for a while) is not taken back again."""
        return {e["container"] for e in self.events}

    def _preempt(self, engine, container, event: dict) -> None:
        from clouds.docker import preempt

        began = time.time()
        try:
            event.update({k: v for k, v in preempt(engine, container.id, self.grace_s).items()
                          if k in ("exit_code", "killed", "gone")})
        except Exception as exc:  # an engine error: recorded, the schedule goes on
            event["error"] = str(exc).splitlines()[0][:200]
        event["stopped_s"] = time.time() - began
