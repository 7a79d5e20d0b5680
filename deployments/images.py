"""Zooid's CPU worker image, built on this machine with no image registry: only Debian's and
Python's package registries.

    python -m deployments.images build   # base, wheelhouse, image: each skipped when current
    python -m deployments.images tag     # the image reference `build` makes (builds nothing)

1. The base: `mmdebstrap` makes a Debian bookworm root (python3, venv, CA certificates, useradd)
   that `podman import` turns into `localhost/zooid-base:bookworm-<hash of the recipe>`.
2. The wheelhouse: `pip download --only-binary=:all:` on the host (pip's own configuration), for
   CPython 3.11 on manylinux x86_64, of requirements.txt under requirements.lock and of uv (the
   image's installer: `INSTALLER`), into
   `worker_images/wheels/` (git-ignored, inside the build context; a stamp skips it while the
   requirements are unchanged), plus what the base's Python (3.11.2) needs beyond the host's:
   pip evaluates markers such as `python_full_version < "3.11.3"` for the host. torch comes from
   where pip finds it: here the CPU wheel in /opt/wheels; elsewhere set
   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or PyPI's CUDA torch comes in.
3. The image: `podman build` of worker_images/Dockerfile.cpu on that base, uv installing from the
   wheelhouse alone (`NO_INDEX=1`) with no network, tagged
   `localhost/zooid-worker:cpu-<12 hex of its inputs>` and `localhost/zooid-worker:cpu`. The
   inputs are the Dockerfile, the ignore file, every file its COPY lines take from the context
   (the requirements and the source; the wheelhouse stands for the requirements), the base and
   the build arguments: `build` is a no-op while an image with that tag exists.

Each build leaves the newest `KEEP_SUPERSEDED` earlier `cpu-<hash>` images (another checkout at
another commit may run one) and removes the older ones (`prune`: 1.8-2.1 GB each, one per change
to the source); an image a container still uses stays.

Sizes and times go to `$ZOOID_HOME/engine/image.json`. `worker_image()` is the reference other
code runs (building it when missing); `image_tag()` names it without building anything.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.errors import ZooidError
from deployments.engine import engine_dir, ensure_installed, podman, podman_env
from deployments.server import ROOT, file_lock

REPO = "localhost/zooid-worker"
FLAVOUR = "cpu"
ALIAS = f"{REPO}:{FLAVOUR}"
DOCKERFILE = Path("worker_images") / "Dockerfile.cpu"
IGNORE_FILE = Path(".dockerignore")
WHEELS = Path("worker_images") / "wheels"
REQUIREMENTS = (Path("requirements.txt"), Path("requirements.lock"))
INSTALLER = "uv"
"""What installs the requirements in the image (pinned in the lock): downloaded beside them, run
from the build's /tmp and not kept."""

BASE_REPO = "localhost/zooid-base"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
# what slim images leave out too: manuals, documentation (copyright notices kept), translations
BASE_DPKG_OPTIONS = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
                     "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
                     "path-exclude=/usr/share/locale/*")
BASE_CHANGES = ("ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV=LANG=C.UTF-8", 'CMD=["/bin/bash"]')

PYTHON_VERSION = "3.11"  # bookworm's python3
WHEEL_PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")  # glibc 2.36 and older
"""pip does not widen a given --platform to older manylinux tags: every one is named."""

KEEP_SUPERSEDED = 2
"""Earlier worker images a build keeps, the newest first (`prune`)."""

STAMP = ".stamp"
"""The wheelhouse's stamp: its key for the image's Python (`wheelhouse_key`), once complete."""
DOWNLOAD_STAMP = ".stamp-download"
"""The stamp of the requirements' download, which needs no base image (`fetch_requirements`)."""


class ImageBuildError(ZooidError, RuntimeError):
    """A step of the image build failed; the message names the step, its log and its output's tail."""


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


# ----------------------------------------------------------------------------- the base

def mmdebstrap_command(tar: str | Path) -> list[str]:
    return ["mmdebstrap", "--variant=apt", f"--include={','.join(BASE_PACKAGES)}",
            *(f"--dpkgopt={o}" for o in BASE_DPKG_OPTIONS), SUITE, str(tar)]


def base_ref() -> str:
    """The base image's reference: a hash of its recipe (command and import changes)."""
    recipe = json.dumps([mmdebstrap_command("BASE.tar"), list(BASE_CHANGES)])
    return f"{BASE_REPO}:{SUITE}-{_sha(recipe)[:12]}"


# ----------------------------------------------------------------------------- the wheelhouse

def wheelhouse_command(dest: str | Path, root: Path = ROOT) -> list[str]:
    """`pip download` of every requirement, and of the `INSTALLER`, as a wheel for the image's
    Python and platform."""
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
            "--dest", str(dest), "--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", "--abi", "cp" + PYTHON_VERSION.replace(".", ""), *platforms,
            "-r", str(root / REQUIREMENTS[0]), "-c", str(root / REQUIREMENTS[1]), INSTALLER]


def wheelhouse_key(python: str | None, root: Path = ROOT) -> str:
    """What the wheelhouse depends on: the command (less its paths), the image's Python version
    and the requirements; with `python` None, what the requirements' download alone depends on."""
    command = [a for a in wheelhouse_command("WHEELS", root)[1:] if not a.startswith(str(root))]
    return _sha(json.dumps(command), *([] if python is None else [python]),
                *((root / r).read_bytes() for r in REQUIREMENTS))


def wheel_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / WHEELS).glob("*.whl"))


def _wheel_requires(wheel: Path) -> tuple[str, list[str]]:
    """A wheel's project name and its Requires-Dist lines."""
    import zipfile
    from email.parser import HeaderParser

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(z.read(name).decode("utf-8", "replace"))
    return meta["Name"], meta.get_all("Requires-Dist") or []


def marker_environments(python: str) -> tuple[dict, dict]:
    """(the host's, the image's) environment-marker values: the image differs in its Python."""
    from packaging.markers import default_environment

    host = dict(default_environment())
    target = {**host, "python_full_version": python, "implementation_version": python,
              "python_version": ".".join(python.split(".")[:2])}
    return host, target


def marker_gaps(wheels: list[Path], requirements: list[str], host: dict, target: dict) -> list[str]:
    """Requirements the image's Python needs that no wheel in `wheels` provides and the host's
    Python did not ask for. `pip download --python-version` picks wheels for the target but
    evaluates environment markers (`async-timeout; python_full_version < "3.11.3"`) for the
    interpreter it runs on."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    requires = {}
    for wheel in wheels:
        name, lines = _wheel_requires(wheel)
        requires[canonicalize_name(name)] = [Requirement(line) for line in lines]
    extras: dict[str, set[str]] = {}
    for line in requirements:
        req = Requirement(line)
        extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)

    def wanted(req, owner: str, env: dict) -> bool:
        return req.marker is None or any(req.marker.evaluate({**env, "extra": e})
                                         for e in extras.get(owner, set()) | {""})

    changed = True
    while changed:  # the extras asked for anywhere (moto[server] -> its server dependencies)
        changed = False
        for owner, reqs in requires.items():
            for req in reqs:
                asked = extras.setdefault(canonicalize_name(req.name), set())
                if wanted(req, owner, target) and not req.extras <= asked:
                    asked.update(req.extras)
                    changed = True
    gaps: dict[str, list[str]] = {}
    for owner, reqs in requires.items():
        for req in reqs:
            name = canonicalize_name(req.name)
            if name not in requires and wanted(req, owner, target) and not wanted(req, owner, host):
                gaps.setdefault(name, []).append(str(req.specifier))
    return [name + ",".join(s for s in specs if s) for name, specs in sorted(gaps.items())]


def requirement_lines(root: Path = ROOT) -> list[str]:
    lines = [line.split("#")[0].strip() for line in (root / REQUIREMENTS[0]).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("-")]


# ----------------------------------------------------------------------------- the inputs

def _logical_lines(text: str) -> list[str]:
    """The Dockerfile's instructions: continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def copied_sources(dockerfile_text: str) -> list[str]:
    """The context paths the Dockerfile's COPY/ADD lines take (not those `--from` a stage)."""
    sources = []
    for line in _logical_lines(dockerfile_text):
        words = line.split()
        if words[0].upper() not in ("COPY", "ADD"):
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        if args and args[0].startswith("["):
            args = json.loads(" ".join(args))
        sources += [s.strip("/") or "." for s in args[:-1]]
    return list(dict.fromkeys(sources))


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regular expression over '/'-separated relative paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out, i = out + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignore_rules(text: str) -> list[tuple[re.Pattern, bool]]:
    """(pattern, is an exception `!...`) for each line of an ignore file, in order."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((_pattern(line), negate))
    return rules


def is_ignored(rel: str, rules: list[tuple[re.Pattern, bool]]) -> bool:
    """Whether the build context leaves `rel` out: the last rule matching it or a folder above
    it decides (Docker's reading of .dockerignore)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    ignored = False
    for pattern, negate in rules:
        if any(pattern.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def input_files(root: Path = ROOT, dockerfile: Path = DOCKERFILE) -> list[str]:
    """The context files the image is made of (relative, sorted); the wheelhouse excluded."""
    ignore = root / IGNORE_FILE
    rules = ignore_rules(ignore.read_text()) if ignore.exists() else []
    wheels = WHEELS.as_posix()
    found = set()
    for source in copied_sources((root / dockerfile).read_text()) + [r.as_posix() for r in REQUIREMENTS]:
        path = root / source
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in candidates:
            rel = file.relative_to(root).as_posix()
            if rel == wheels or rel.startswith(wheels + "/") or is_ignored(rel, rules):
                continue
            found.add(rel)
    return sorted(found)


def build_args(base: str | None = None) -> dict[str, str]:
    return {"BASE_IMAGE": base or base_ref(), "NO_INDEX": "1"}


def input_hash(root: Path = ROOT, dockerfile: Path = DOCKERFILE, base: str | None = None) -> str:
    """12 hex digits of everything the image is built from."""
    parts: list[bytes | str] = ["dockerfile", (root / dockerfile).read_bytes(),
                                "args", json.dumps(build_args(base), sort_keys=True)]
    ignore = root / IGNORE_FILE
    parts += ["ignore", ignore.read_bytes() if ignore.exists() else b""]
    for rel in input_files(root, dockerfile):
        parts += [rel, (root / rel).read_bytes()]
    return _sha(*parts)[:12]


def image_tag(root: Path = ROOT) -> str:
    """The reference `build` makes for the current inputs (nothing is built or asked)."""
    return f"{REPO}:{FLAVOUR}-{input_hash(root)}"


# ----------------------------------------------------------------------------- building

def image_exists(ref: str, home: Path | None = None) -> bool:
    return podman("image", "exists", ref, home=home, check=False).returncode == 0


def image_size(ref: str, home: Path | None = None) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", ref, home=home).stdout.strip())


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def _run_logged(args: list[str], log: Path, echo: bool, env: dict | None = None, cwd: Path = ROOT) -> None:
    """Run `args`, its output appended to `log` (and echoed); on failure, its tail in the error."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        tail: list[str] = []
        for line in proc.stdout:
            out.write(line)
            tail = (tail + [line])[-30:]
            if echo:
                print(line, end="", flush=True)
        if proc.wait() != 0:
            raise ImageBuildError(f"image: `{' '.join(args[:3])} ...` failed (exit {proc.returncode}; "
                              f"log {log}):\n{''.join(tail)}")


def _say(message: str, echo: bool) -> None:
    if echo:
        print(f"zooid: {message}", flush=True)


def ensure_base(home: Path | None = None, echo: bool = False) -> tuple[str, bool]:
    """The base image's reference, made (mmdebstrap, podman import) when missing; (ref, built)."""
    ref = base_ref()
    if image_exists(ref, home):
        return ref, False
    work = engine_dir(home)
    work.mkdir(parents=True, exist_ok=True)
    _say(f"making the base {ref} (mmdebstrap {SUITE})", echo)
    with tempfile.TemporaryDirectory(dir=work, prefix="base-") as tmp:
        tar = Path(tmp) / "base.tar"
        _run_logged(mmdebstrap_command(tar), work / "image-build.log", echo)
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        _run_logged(["podman", "import", "--quiet", *changes, str(tar), ref], work / "image-build.log",
                    False, podman_env(home))
    return ref, True


def target_python(base: str, home: Path | None = None) -> str:
    """The base image's Python version (x.y.z)."""
    return podman("run", "--rm", "--network=none", base, "python3", "-c",
                  "import platform; print(platform.python_version())", home=home).stdout.strip()


def _stamped(path: Path, key: str, root: Path) -> bool:
    return path.exists() and path.read_text().strip() == key and bool(wheel_files(root))


def fetch_requirements(root: Path = ROOT, home: Path | None = None, echo: bool = False) -> bool:
    """Download the requirements' wheels into worker_images/wheels/ (a no-op while the download's
    stamp matches them): what needs no base image, so `_build` runs it beside the base's
    mmdebstrap. Whether it downloaded."""
    folder = root / WHEELS
    key = wheelhouse_key(None, root)
    if _stamped(folder / DOWNLOAD_STAMP, key, root):
        return False
    _say(f"downloading the wheelhouse into {WHEELS}/ (pip download --only-binary=:all:)", echo)
    folder.mkdir(parents=True, exist_ok=True)
    for stamp in (STAMP, DOWNLOAD_STAMP):
        (folder / stamp).unlink(missing_ok=True)
    for old in wheel_files(root):
        old.unlink()
    _run_logged(wheelhouse_command(folder, root), engine_dir(home) / "wheelhouse.log", False)
    (folder / DOWNLOAD_STAMP).write_text(key + "\n")
    return True


def ensure_wheelhouse(python: str, root: Path = ROOT, home: Path | None = None, echo: bool = False) -> bool:
    """Fill worker_images/wheels/ for the current requirements (`fetch_requirements`) and the
    image's Python `python` (a no-op while its stamp matches); whether it downloaded."""
    folder = root / WHEELS
    stamp = folder / STAMP
    key = wheelhouse_key(python, root)
    if _stamped(stamp, key, root):
        return False
    downloaded = fetch_requirements(root, home, echo)
    stamp.unlink(missing_ok=True)
    log = engine_dir(home) / "wheelhouse.log"
    command = wheelhouse_command(folder, root)
    host, target = marker_environments(python)
    for _ in range(5):
        gaps = marker_gaps(wheel_files(root), requirement_lines(root), host, target)
        if not gaps:
            break
        _say(f"adding what Python {python} needs beyond the host's: {' '.join(gaps)}", echo)
        _run_logged(command[:command.index("-r")] + ["-c", str(root / REQUIREMENTS[1]), *gaps], log, False)
        downloaded = True
    else:
        raise ImageBuildError(f"image: the wheelhouse still lacks {gaps} for Python {python}")
    cuda = [w.name for w in wheel_files(root) if w.name.startswith("nvidia_")]
    if cuda:
        print(f"zooid: warning: the wheelhouse holds CUDA wheels ({', '.join(cuda[:3])}, ...): torch came "
              "from PyPI; for the CPU build set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu",
              file=sys.stderr)
    stamp.write_text(key + "\n")
    return downloaded


def build_command(tag: str, base: str) -> list[str]:
    args = [arg for k, v in build_args(base).items() for arg in ("--build-arg", f"{k}={v}")]
    return ["podman", "build", "--file", str(DOCKERFILE), *args, "--pull=never", "--network=none",
            "--layers", "--tag", tag, "--tag", ALIAS, "."]


def record_path(home: Path | None = None) -> Path:
    return engine_dir(home) / "image.json"


def ensure_image(root: Path = ROOT, home: Path | None = None, echo: bool = False) -> dict:
    """Build the worker image when no image carries its inputs' tag; the build's record
    (`image`, `alias`, `base`, `size_bytes`, `times_s`, ...) with `built` (false: no-op)."""
    start = time.monotonic()
    tag = image_tag(root)
    ensure_installed()
    record_file = record_path(home)
    if image_exists(tag, home):
        podman("tag", tag, ALIAS, home=home)
        record = json.loads(record_file.read_text()) if record_file.exists() else {}
        if record.get("image") != tag:
            record = {"image": tag, "alias": ALIAS, "size_bytes": image_size(tag, home)}
            record["size"] = human(record["size_bytes"])
        return {**record, "built": False, "check_s": round(time.monotonic() - start, 2)}
    with _build_lock(root):  # one build at a time per checkout: the wheelhouse is shared
        if image_exists(tag, home):  # another process built it while this one waited
            return ensure_image(root, home, echo)
        return _build(tag, start, root, home, echo)


@contextlib.contextmanager
def _build_lock(root: Path):
    """An exclusive lock per checkout, outside the build context (a file there would be an input)."""
    with file_lock(Path(tempfile.gettempdir()) / f"zooid-image-{_sha(str(root.resolve()))[:12]}.lock"):
        yield


def _build(tag: str, start: float, root: Path, home: Path | None, echo: bool) -> dict:
    record_file = record_path(home)
    times = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # the requirements' download needs no base: beside mmdebstrap
        fetched = pool.submit(fetch_requirements, root, home, echo) if not image_exists(base_ref(), home) else None
        base, base_built = ensure_base(home, echo)
        fetched = fetched.result() if fetched is not None else False
    times["base"] = round(time.monotonic() - t0, 1)  # and the download beside it, where both ran
    t0 = time.monotonic()
    python = target_python(base, home)
    downloaded = ensure_wheelhouse(python, root, home, echo) or fetched
    times["wheels"] = round(time.monotonic() - t0, 1)
    wheels = wheel_files(root)
    t0 = time.monotonic()
    _say(f"building {tag} from {DOCKERFILE} (no network, wheels only; log "
         f"{engine_dir(home) / 'image-build.log'})", echo)
    _run_logged(build_command(tag, base), engine_dir(home) / "image-build.log", echo, podman_env(home), root)
    times["build"] = round(time.monotonic() - t0, 1)
    times["total"] = round(time.monotonic() - start, 1)
    size = image_size(tag, home)
    record = {
        "image": tag, "alias": ALIAS, "base": base, "base_size_bytes": image_size(base, home),
        "size_bytes": size, "size": human(size), "times_s": times,
        "base_built": base_built, "python": python, "wheels_downloaded": downloaded, "wheels": len(wheels),
        "wheels_bytes": sum(w.stat().st_size for w in wheels),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record["pruned"] = prune(tag, home=home)
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "built": True}


def superseded(images: list[dict], current: str, keep: int = KEEP_SUPERSEDED) -> list[str]:
    """Of `images` (`{"tag", "id", "created"}`: tags of one repository, `created` sortable), the
    tags to remove: all but `current`, the `keep` newest other images and any tag of the same
    image as one of those."""
    kept_ids = {i["id"] for i in images if i["tag"] == current}
    others = sorted((i for i in images if i["id"] not in kept_ids), key=lambda i: i["created"], reverse=True)
    for image in others:
        if len(kept_ids) > keep:
            break
        kept_ids.add(image["id"])
    return sorted(i["tag"] for i in images if i["id"] not in kept_ids)


def repository_images(repo: str = REPO, flavour: str = FLAVOUR, home: Path | None = None) -> list[dict]:
    """The `<repo>:<flavour>-<hash>` images the engine holds: tag, image id and creation time."""
    out = podman("images", "--format", "json", "--filter", f"reference={repo}", home=home).stdout
    rows = []
    for image in json.loads(out or "[]"):
        for name in image.get("Names") or []:
            if name.startswith(f"{repo}:{flavour}-"):
                rows.append({"tag": name, "id": image["Id"], "created": image.get("Created", 0)})
    return rows


def prune(current: str, repo: str = REPO, keep: int = KEEP_SUPERSEDED, home: Path | None = None) -> list[str]:
    """Remove the images `superseded` leaves out (an untag where the image has other tags; an
    image a container uses stays: podman refuses it). Returns the tags removed."""
    removed = []
    for tag in superseded(repository_images(repo, home=home), current, keep):
        if podman("rmi", tag, home=home, check=False).returncode == 0:
            removed.append(tag)
    return removed


def worker_image(root: Path = ROOT, home: Path | None = None) -> str:
    """The worker image's reference, built first when missing."""
    return ensure_image(root, home)["image"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.images", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "tag"])
    args = parser.parse_args(argv)
    if args.command == "tag":
        print(image_tag())
        return 0
    record = ensure_image(echo=True)
    if not record["built"]:
        print(f"zooid: {record['image']} is up to date ({record['size']}; checked in {record['check_s']} s)")
        return 0
    t = record["times_s"]
    print(f"zooid: built {record['image']} (also {record['alias']})\n"
          f"  size   {record['size']} (base {human(record['base_size_bytes'])}; "
          f"{record['wheels']} wheels, {human(record['wheels_bytes'])})\n"
          f"  time   base {t['base']} s{'' if record['base_built'] else ' (cached)'}, "
          f"wheels {t['wheels']} s{'' if record['wheels_downloaded'] else ' (cached)'}, "
          f"build {t['build']} s, total {t['total']} s\n"
          f"  pruned {len(record['pruned'])} earlier image(s) (keeping the {KEEP_SUPERSEDED} newest)\n"
          f"  record {record_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
