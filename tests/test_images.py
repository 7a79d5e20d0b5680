"""The worker image built here (deployments.images): its tag follows its inputs and nothing else,
its Dockerfiles run as a non-root user, its build context holds no secret, its wheelhouse is
wheels only. The last test builds the image with podman (skipped without it)."""
from __future__ import annotations

import json
import re
import subprocess
import shutil
import zipfile
from pathlib import Path

import pytest

from deployments import images
from deployments.server import ROOT

DOCKERFILE = """\
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE} AS build
COPY requirements.txt requirements.lock ./
COPY worker_images/wheels /wheels
RUN pip install -r requirements.txt
FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
COPY --chown=root:root pkg ./pkg
COPY top.py \\
     ./
USER 10001:10001
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small project: a Dockerfile copying requirements, a package and a file."""
    (tmp_path / "worker_images" / "wheels").mkdir(parents=True)
    (tmp_path / "worker_images" / "Dockerfile.cpu").write_text(DOCKERFILE)
    (tmp_path / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    (tmp_path / "requirements.lock").write_text("torch==2.13.0\nnumpy==2.4.6\n")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (tmp_path / "top.py").write_text("print('top')\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test(): pass\n")
    return tmp_path


def test_the_copied_sources_are_read_from_the_dockerfile():
    assert images.copied_sources(DOCKERFILE) == ["requirements.txt", "requirements.lock", "worker_images/wheels",
                                                 "pkg", "top.py"]
    real = images.copied_sources((ROOT / images.DOCKERFILE).read_text())
    assert {"requirements.txt", "requirements.lock", "flows", "runtime", "deployments", "core"} <= set(real)


def test_the_input_hash_follows_the_inputs_and_nothing_else(tree: Path):
    first = images.input_hash(tree)
    assert re.fullmatch(r"[0-9a-f]{12}", first)
    assert images.input_hash(tree) == first

    def changes(path: str, text: str) -> bool:
        file = tree / path
        old = file.read_text() if file.exists() else None
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
        changed = images.input_hash(tree) != first
        file.unlink() if old is None else file.write_text(old)
        assert images.input_hash(tree) == first
        return changed

    # what the image is made of
    assert changes("worker_images/Dockerfile.cpu", DOCKERFILE + "ENV A=1\n")
    assert changes("requirements.txt", "torch==2.14.1\n")
    assert changes("requirements.lock", "torch==2.13.0\nnumpy==2.4.7\n")
    assert changes("pkg/sub/mod.py", "X = 2\n")
    assert changes("pkg/sub/new.py", "Y = 1\n")
    assert changes("top.py", "print('changed')\n")
    assert changes(".dockerignore", "tests\n")
    # what it is not
    assert not changes("tests/test_x.py", "def test(): assert True\n")
    assert not changes("pkg/sub/__pycache__/mod.cpython-311.pyc", "bytes")
    assert not changes("pkg/secrets.env", "TOKEN=1\n")
    assert not changes("worker_images/wheels/torch-2.13.0-cp311-none-any.whl", "wheel")
    assert not changes("worker_images/Dockerfile.cuda", "FROM x\n")
    assert not changes("README.md", "# readme\n")
    # the base is an input too
    assert images.input_hash(tree, base="localhost/zooid-base:other") != first


def test_the_tag_names_the_inputs(capsys):
    tag = images.image_tag()
    assert re.fullmatch(r"localhost/zooid-worker:cpu-[0-9a-f]{12}", tag)
    assert images.main(["tag"]) == 0
    assert capsys.readouterr().out.strip() == images.image_tag()
    assert images.ALIAS == "localhost/zooid-worker:cpu"
    files = images.input_files()
    assert {"flows/worker.py", "runtime/worker_main.py", "requirements.txt", "requirements.lock"} <= set(files)
    assert not [f for f in files if f.startswith(("tests/", ".venv/", ".zooid/", "worker_images/"))
                or "__pycache__" in f]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_dockerfiles_run_as_a_user_who_is_not_root(name: str):
    text = (ROOT / "worker_images" / name).read_text()
    lines = images._logical_lines(text)
    final_stage = lines[max(i for i, line in enumerate(lines) if line.upper().startswith("FROM ")):]
    users = [line.split()[1] for line in final_stage if line.upper().startswith("USER ")]
    assert users, f"{name}: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user == "10001"
    assert "useradd --uid 10001" in text and "--create-home" in text  # a home for ~/.prefect
    assert "PREFECT_HOME=/tmp/prefect" in text and "WORKDIR /opt/zooid" in text
    assert "build-essential" not in text  # every requirement ships a wheel
    assert "--only-binary=:all:" in text
    # the wheelhouse reaches the install step alone (the CPU image: bind-mounted, never a layer)
    assert "ARG BASE_IMAGE=python:3.11" in text and ("COPY worker_images/wheels /wheels" in text or
                                                      "--mount=type=bind,source=worker_images/wheels" in text)
    # Debian's python3 package has no `python`
    assert not re.search(r"(RUN|&&)\s+python\s", text) and '"python"' not in text


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_dockerfiles_leave_out_the_suites_tools_and_torchs_test_programs(name: str):
    """Both recipes install requirements.txt less moto and pytest*, and drop torch/test and torch/bin
    but its shm manager (the CPU image is held to it built: test_the_image_runs_as_10001_and_imports_the_worker;
    the CUDA one is not built by the suite)."""
    lines = images._logical_lines((ROOT / "worker_images" / name).read_text())
    install = next(line for line in lines if "requirements.lock" in line and " install " in line)
    assert "grep -v -E '^(moto|pytest)[^a-z]'" in install
    assert "-r /tmp/image-requirements.txt" in install or "-r image-requirements.txt" in install
    assert "-r requirements.txt" not in install and "/requirements.txt -c" not in install
    assert 'rm -rf' in install and '/torch/test"' in install
    assert '"$SITE/torch/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +' in install


def test_the_build_context_holds_no_secret():
    rules = images.ignore_rules((ROOT / images.IGNORE_FILE).read_text())
    for path in (".venv/bin/python", ".zooid/env", ".zooid/engine/image.json", ".git/config", ".env",
                 "deployments/prod.env", "clouds/.env.local", "blocks/.aws/credentials", "key.pem",
                 "tests/test_images.py", "flows/__pycache__/worker.cpython-311.pyc", ".pytest_cache/v/x",
                 "zooid.egg-info/PKG-INFO"):
        assert images.is_ignored(path, rules), path
    for path in ("worker_images/wheels/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "worker_images/wheels/.gitkeep", "flows/worker.py", "requirements.lock", "prefect.yaml"):
        assert not images.is_ignored(path, rules), path


def test_the_wheelhouse_is_wheels_only_for_the_images_python():
    command = images.wheelhouse_command("/tmp/wheels")
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.11"
    assert command[command.index("--abi") + 1] == "cp311"
    platforms = {command[i + 1] for i, a in enumerate(command) if a == "--platform"}
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= platforms
    assert command[command.index("-r") + 1].endswith("requirements.txt")
    assert command[command.index("-c") + 1].endswith("requirements.lock")
    assert images.wheelhouse_key("3.11.2") != images.wheelhouse_key("3.11.7")
    # the installer comes beside the requirements, pinned by the lock, and the image does not keep it
    assert command[-1] == images.INSTALLER
    pins = (ROOT / "requirements.lock").read_text().splitlines()
    assert any(line.startswith(f"{images.INSTALLER}==") for line in pins)
    dockerfile = (ROOT / images.DOCKERFILE).read_text()
    assert f"--target /tmp/{images.INSTALLER}" in dockerfile and f"rm -rf /tmp/{images.INSTALLER}" in dockerfile
    assert (ROOT / images.WHEELS / ".gitkeep").exists()


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)
    return path


def test_the_wheelhouse_adds_what_the_images_python_needs_beyond_the_hosts(tmp_path: Path):
    """pip download evaluates markers for the host's Python (3.11.7), the image runs Debian's 3.11.2."""
    wheels = [
        _wheel(tmp_path, "redis", ['async-timeout>=4.0.3; python_full_version < "3.11.3"']),
        _wheel(tmp_path, "moto", ['flask; extra == "server"', 'werkzeug; extra == "server"',
                                  'oldlib<2; python_full_version < "3.11.3" and extra == "server"',
                                  'docslib; python_full_version < "3.11.3" and extra == "docs"']),
        _wheel(tmp_path, "flask", []), _wheel(tmp_path, "werkzeug", []),
    ]
    host, target = images.marker_environments("3.11.2")
    host = {**host, "python_full_version": "3.11.7", "implementation_version": "3.11.7"}
    gaps = images.marker_gaps(wheels, ["redis==8.1.0", "moto[server]==5.2.5"], host, target)
    assert gaps == ["async-timeout>=4.0.3", "oldlib<2"]
    assert images.marker_gaps(wheels, ["redis==8.1.0", "moto[server]==5.2.5"], host, host) == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("podman") is None, reason="needs podman")
def test_the_image_runs_as_10001_and_imports_the_worker():
    """Builds the image when missing (minutes the first time; seconds after a source change)."""
    from deployments.engine import podman

    ref = images.ensure_image()["image"]
    assert images.image_exists(ref)

    def run(*args: str) -> str:
        return podman("run", "--rm", "--network=none", ref, *args, timeout=300).stdout.strip()

    assert run("id", "-u") == "10001"
    assert run("python3", "-c", "import torch, flows.worker, runtime.worker_main; print(torch.__version__)") \
        .startswith("2.")
    assert "Version:" in run("prefect", "version")
    assert run("sh", "-c", "cd / && python3 -c 'import flows.worker' && echo $HOME && pwd") == "/home/zooid\n/"
    # the requirements but the suite's own tools (moto, pytest), and torch but its C++ test programs
    wanted = [line.split("==")[0].split("[")[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    found = json.loads(run("python3", "-c", "import importlib.metadata as m, json, sys; print(json.dumps("
                           "{n: any(True for _ in m.distributions(name=n)) for n in sys.argv[1:]}))", *wanted))
    assert {n for n, there in found.items() if not there} == {"moto", "pytest", "pytest-timeout"}, found
    site = run("python3", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    assert run("ls", f"{site}/torch/bin") == "torch_shm_manager"
    assert run("sh", "-c", f"test -e {site}/torch/test || echo gone") == "gone"


def _fake_pip(root: Path, calls: list):
    """`_run_logged` standing in for pip: a `pip download` writes one wheel per requirement it names."""
    def run(args, log, echo, env=None, cwd=None):
        calls.append(args)
        dest = Path(args[args.index("--dest") + 1])
        names = ["torch", "redis"] if "-r" in args else [a.split(">")[0] for a in args[args.index("-c") + 2:]]
        for name in names:
            _wheel(dest, name, ['async-timeout>=4.0.3; python_full_version < "3.11.3"'] if name == "redis" else [])
    return run


def test_the_wheelhouse_downloads_the_requirements_once_then_what_each_python_adds(tmp_path, monkeypatch):
    (tmp_path / "worker_images" / "wheels").mkdir(parents=True)
    for name, text in (("requirements.txt", "redis==8.1.0\n"), ("requirements.lock", "redis==8.1.0\n")):
        (tmp_path / name).write_text(text)
    calls = []
    monkeypatch.setattr(images, "_run_logged", _fake_pip(tmp_path, calls))
    assert images.fetch_requirements(tmp_path, tmp_path) is True
    assert images.fetch_requirements(tmp_path, tmp_path) is False and len(calls) == 1  # stamped
    assert images.ensure_wheelhouse("3.11.7", tmp_path, tmp_path) is False  # the host's Python: nothing to add
    assert images.ensure_wheelhouse("3.11.2", tmp_path, tmp_path) is True  # the image's: its marker gap
    assert len(calls) == 2 and "async-timeout>=4.0.3" in calls[1] and "-r" not in calls[1]
    assert images.ensure_wheelhouse("3.11.2", tmp_path, tmp_path) is False and len(calls) == 2
    (tmp_path / "requirements.txt").write_text("redis==8.1.0\ntorch==2.13.0\n")  # a new requirement: all again
    assert images.ensure_wheelhouse("3.11.2", tmp_path, tmp_path) is True and "-r" in calls[2]


def test_a_cold_build_downloads_the_wheelhouse_while_the_base_is_made(tmp_path, monkeypatch):
    """Ordered by events: the base's mmdebstrap waits for the download to begin, which only a
    download running beside it can do (one after the other, the wait times out)."""
    import threading

    began, order = threading.Event(), []

    def fetch(root, home, echo):
        began.set()
        order.append("download")
        return True

    def base(home, echo):
        order.append(("base waited", began.wait(timeout=60)))
        return "localhost/zooid-base:x", True

    monkeypatch.setattr(images, "fetch_requirements", fetch)
    monkeypatch.setattr(images, "ensure_base", base)
    monkeypatch.setattr(images, "image_exists", lambda ref, home=None: False)
    monkeypatch.setattr(images, "target_python", lambda base, home=None: "3.11.2")
    monkeypatch.setattr(images, "ensure_wheelhouse", lambda *a, **k: False)
    monkeypatch.setattr(images, "_run_logged", lambda *a, **k: None)
    monkeypatch.setattr(images, "image_size", lambda ref, home=None: 0)
    record = images._build("localhost/zooid-worker:cpu-x", 0.0, tmp_path, tmp_path, False)
    assert ("base waited", True) in order and record["wheels_downloaded"] is True


def test_superseded_images_keep_the_current_and_the_newest_others():
    rows = [{"tag": "r:cpu-a", "id": "1", "created": 10}, {"tag": "r:cpu-b", "id": "2", "created": 30},
            {"tag": "r:cpu-c", "id": "3", "created": 20}, {"tag": "r:cpu-d", "id": "4", "created": 40},
            {"tag": "r:cpu-e", "id": "1", "created": 10},  # another tag of the current image
            {"tag": "r:cpu-f", "id": "5", "created": 5}]
    assert images.superseded(rows, "r:cpu-a", keep=2) == ["r:cpu-c", "r:cpu-f"]
    assert images.superseded(rows, "r:cpu-a", keep=0) == ["r:cpu-b", "r:cpu-c", "r:cpu-d", "r:cpu-f"]
    assert images.superseded(rows, "r:cpu-f", keep=9) == []


def test_prune_removes_superseded_images_but_not_one_a_container_uses(tmp_path: Path):
    """Three one-file images on the engine (`podman import`), under a repository of this test's own."""
    from deployments.engine import ensure_installed, podman

    ensure_installed()
    repo = f"localhost/zooid-prune-test-{tmp_path.name.lower().replace('_', '-')}"
    tags = [f"{repo}:cpu-{name}" for name in ("current", "used", "old")]
    container = None
    try:
        for tag in tags:
            root = tmp_path / tag.rsplit("-", 1)[1]
            root.mkdir()
            (root / "marker").write_text(tag)
            tar = tmp_path / f"{root.name}.tar"
            subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "marker"], check=True)
            podman("import", str(tar), tag)
        container = podman("create", tags[1], "/marker").stdout.strip()
        assert images.prune(tags[0], repo=repo, keep=0) == [tags[2]]
        assert [images.image_exists(tag) for tag in tags] == [True, True, False]
    finally:
        if container:
            podman("rm", "--force", container, check=False)
        for tag in tags:
            podman("rmi", "--force", tag, check=False)
