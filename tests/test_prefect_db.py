"""New Prefect homes start from the install's migrated database (`deployments.prefect_db`)."""
import sqlite3
from pathlib import Path

import pytest

from deployments import prefect_db
from deployments.prefect_db import DB, MEMO, seed_home, template_dir


@pytest.fixture
def template(tmp_path, monkeypatch):
    folder = tmp_path / "template"
    folder.mkdir()
    (folder / DB).write_bytes(b"migrated database")
    (folder / MEMO).write_text('block_auto_registration = "abc"\n')
    monkeypatch.setattr(prefect_db, "template_dir", lambda: folder)
    return folder


def test_a_fresh_home_gets_the_template_s_database_and_memo(template, tmp_path):
    home = tmp_path / "home" / "prefect"
    assert seed_home(home, env={})
    assert (home / DB).read_bytes() == b"migrated database"
    assert (home / MEMO).read_text() == 'block_auto_registration = "abc"\n'
    assert sorted(p.name for p in home.iterdir()) == [MEMO, DB]  # no partial copy left behind


def test_a_home_with_a_database_is_left_alone(template, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / DB).write_bytes(b"the user's runs")
    assert not seed_home(home, env={})
    assert (home / DB).read_bytes() == b"the user's runs"
    assert not (home / MEMO).exists()


@pytest.mark.parametrize("variable", prefect_db.DB_URL_VARIABLES)
def test_a_database_configured_elsewhere_is_not_seeded(template, tmp_path, variable):
    home = tmp_path / "home"
    assert not seed_home(home, env={variable: "postgresql+asyncpg://db/prefect"})
    assert not (home / DB).exists()


def test_without_a_template_the_server_migrates_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(prefect_db, "template_dir", lambda: tmp_path / "none")
    assert not seed_home(tmp_path / "home", env={})
    assert not (tmp_path / "home" / DB).exists()


def test_the_installed_template_is_a_migrated_database_with_its_blocks_registered():
    """`make install` built it: the schema at a migration head and Prefect's block types in it."""
    db = template_dir() / DB
    if not db.exists():
        pytest.skip(f"no template at {db} (`make install` builds it)")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (revision,) = conn.execute("select version_num from alembic_version").fetchone()
        block_types = {name for (name,) in conn.execute("select slug from block_type")}
    assert [revision] == sqlite_migration_heads()
    assert {"secret", "local-file-system"} <= block_types


def sqlite_migration_heads() -> list[str]:
    """The heads of the installed Prefect's own SQLite migrations (alembic's view of them)."""
    from alembic.script import ScriptDirectory
    from prefect.server import database

    migrations = Path(database.__file__).parent / "_migrations"
    scripts = ScriptDirectory(str(migrations), version_locations=[str(migrations / "versions" / "sqlite")])
    return scripts.get_heads()
