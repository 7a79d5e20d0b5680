"""A migrated Prefect database that new Prefect homes start from.

A Prefect server on a fresh home migrates an empty SQLite database and registers its block
types before it answers: 6.3 s to healthy on this 2-core machine, against 3.1 s on a home
that already has them. `make install` does that work once (`deployments.server.build_db_template`),
into a template kept in the virtualenv beside the Prefect release it belongs to; `seed_home`
copies the template into a Prefect home that has no database yet. The command line's
temporary server, the local stack and the test suite's servers start from it.

What the template holds: `prefect.db` (a server's database after its first start: the schema
at the release's head, the block types and schemas registered, nothing else) and
`memo_store.toml` (the server's note that those blocks are registered, so it skips
registering them again). Left alone: a home that has a database, a server whose database is
configured elsewhere (`PREFECT_SERVER_DATABASE_CONNECTION_URL` or
`PREFECT_API_DATABASE_CONNECTION_URL`), and every home when there is no template for the
installed release: the server then migrates as it always did.
"""
from __future__ import annotations

import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

DB, MEMO = "prefect.db", "memo_store.toml"
DB_URL_VARIABLES = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def template_dir() -> Path:
    """Where the template for the installed Prefect release lives (in this interpreter's
    environment, so a reinstall of Prefect never meets a template of another release)."""
    return Path(sys.prefix) / "share" / "zooid" / f"prefect-db-{version('prefect')}"


def seed_home(prefect_home: Path, env: dict[str, str] | None = None) -> bool:
    """Copy the template into `prefect_home` when it has no database and the server started
    with `env` (default: this process's environment) keeps its database there; whether it did."""
    env = os.environ if env is None else env
    template, target = template_dir(), Path(prefect_home) / DB
    if any(env.get(name) for name in DB_URL_VARIABLES) or target.exists() or not (template / DB).exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    for name in (DB, MEMO):
        source, dest = template / name, target.parent / name
        if source.exists() and not dest.exists():
            partial = dest.with_name(f".{name}.{os.getpid()}.partial")
            shutil.copyfile(source, partial)
            os.replace(partial, dest)  # a server never opens half a database
    return True
