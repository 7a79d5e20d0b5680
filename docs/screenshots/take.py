"""Screenshots of the run report in the Prefect UI, taken with headless Chromium (Debian's
`chromium` package), for three runs on a local stack of their own:

- a Local-SGD run (digits_mlp, 2 workers, 3 epochs);
- a pipeline run (digits_cnn, 2 stages, 3 epochs);
- a run cancelled through the API, as the UI's Cancel button does, after its first epoch.

    python docs/screenshots/take.py [--out docs/screenshots] [--width 1000]

Each run gives `<name>-report.png` (the report artifact's page) and `<name>-run.png` (the flow
run's page: its log with the per-epoch lines). The stack lives in a temporary `ZOOID_HOME` and is
stopped (by pid) at the end, whatever happens. Needs `chromium` on the PATH
(`apt-get install chromium`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNS = {
    "local-sgd": {"model": "digits_mlp", "strategy": "local_sgd", "workers": 2, "epochs": 3, "batch_size": 32},
    "pipeline": {"model": "digits_cnn", "strategy": "pipeline", "stages": 2, "workers": 2, "epochs": 3,
                 "batch_size": 32},
    "cancelled": {"model": "digits_mlp", "strategy": "local_sgd", "workers": 2, "epochs": 200, "batch_size": 32},
}


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("error: chromium: not found; `apt-get install chromium` (Debian) installs it")


def shoot(browser: str, url: str, out: Path, width: int, height: int) -> None:
    """One full-page picture of `url` after its scripts have run (virtual time lets the UI's
    requests finish before the picture is taken)."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        "--virtual-time-budget=20000", f"--screenshot={out}", url],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180)
    from PIL import Image  # matplotlib's dependency: 64 colours keep text sharp at a third of the bytes

    Image.open(out).convert("RGB").quantize(64).save(out, optimize=True)
    print(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: {url}")


def first_epoch_done(store_root: Path, run_id: str, timeout_s: float = 600) -> None:
    """Block until the run's history holds an epoch (the cancel comes mid-run, after it)."""
    history = store_root / "runs" / run_id / "history.json"
    deadline = time.monotonic() + timeout_s
    while not history.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} finished no epoch in {timeout_s:.0f} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--width", type=int, default=1000, help="the pane's width in pixels")
    parser.add_argument("--height", type=int, default=2600)
    args = parser.parse_args(argv)
    browser = chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="zooid-shots-"))
    os.environ["ZOOID_HOME"] = str(home)
    from deployments.stack import down, up, wait_final

    state = up(home)
    try:
        os.environ.update(state["env"])
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from prefect.states import Cancelling

        from coordinator.run.context import run_id_for
        from core.keys import artifact_key

        ui = state["api_url"].removesuffix("/api")
        with temporary_settings(updates={PREFECT_API_URL: state["api_url"]}), get_client(sync_client=True) as client:
            for name, params in RUNS.items():
                flow_run = run_deployment("train/local", parameters=params, timeout=0)
                run_id = run_id_for(flow_run.id)
                if name == "cancelled":
                    first_epoch_done(home / "store", run_id)
                    client.set_flow_run_state(flow_run.id, Cancelling(message="cancelled for the screenshots"))
                fr = wait_final(client, flow_run.id, timeout_s=900)
                print(f"{name}: run {run_id} ended {fr.state.type.value}")
                report = client.read_artifacts(artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[artifact_key(run_id, "report")])))
                if report:
                    shoot(browser, f"{ui}/artifacts/artifact/{report[-1].id}", args.out / f"{name}-report.png",
                          args.width, args.height)
                shoot(browser, f"{ui}/runs/flow-run/{flow_run.id}", args.out / f"{name}-run.png", args.width,
                      args.height)
    finally:
        down(home)
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
