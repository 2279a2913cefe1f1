"""A real PostgreSQL server for the store's tests: one per test run, started by ``pg_server`` with initdb and
pg_ctl on a Unix socket in a temporary folder (as the ``postgres`` or ``nobody`` user when the tests run as root:
initdb refuses root), and a fresh database per test (``pg_url``). ``store_target`` parametrizes a test over both
backends: a SQLite file and a PostgreSQL database.

Without the server's binaries or psycopg the PostgreSQL cases skip, saying what is missing, except under
``TIERED_OPS_REQUIRE_PG=1`` (CI installs PostgreSQL and sets it), where they fail instead.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

REQUIRE = os.environ.get("TIERED_OPS_REQUIRE_PG", "") == "1"
ROLE = "tiered"


def binary(name: str) -> str | None:
    """``name`` on PATH, else in the newest /usr/lib/postgresql/<version>/bin (Debian's layout)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    return versions[-1] if versions else None


def missing() -> str | None:
    """What stops a PostgreSQL server for the tests here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        return f"psycopg is not installed (pip install -e '.[pg]'): {e}"
    for name in ("initdb", "pg_ctl"):
        if binary(name) is None:
            return f"no PostgreSQL server binaries here ({name} is neither on PATH nor in /usr/lib/postgresql/*/bin)"
    return None


class Server:
    """One PostgreSQL cluster in a temporary folder, reached through a Unix socket in that folder only."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tiered_ops_pg_"))
        self.dir.chmod(0o755)  # the server's user must reach its folders
        self.data, self.sock = self.dir / "data", self.dir / "sock"
        self.user = None
        if os.geteuid() == 0:
            self.user = next(u for u in ("postgres", "nobody") if _exists(u))
        for d in (self.data, self.sock):
            d.mkdir()
            if self.user:
                os.chown(d, pwd.getpwnam(self.user).pw_uid, -1)
        self.running = False

    def _run(self, *cmd: str) -> None:
        if self.user:
            cmd = (("runuser", "-u", self.user, "--", *cmd) if shutil.which("runuser")
                   else ("su", "-s", "/bin/sh", self.user, "-c", shlex.join(cmd)))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> None:
        self._run(binary("initdb"), "-D", str(self.data), "-A", "trust", "-U", ROLE, "-E", "UTF8", "--no-sync")
        opts = (f"-k {self.sock} -c listen_addresses='' -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=200")
        self._run(binary("pg_ctl"), "-D", str(self.data), "-l", str(self.sock / "server.log"), "-w", "-t", "60",
                  "-o", opts, "start")
        self.running = True
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.running:
            self.running = False
            try:
                self._run(binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql:///{db}?host={self.sock}&user={ROLE}"

    def sql(self, statement: str, db: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True) as conn:
            conn.execute(statement)

    def new_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE {name}")
        return name


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="session")
def pg_server():
    why = missing()
    if why:
        if REQUIRE:
            pytest.fail(f"TIERED_OPS_REQUIRE_PG=1 but {why}")
        pytest.skip(why)
    server = Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server):
    """The URL of a fresh, empty database of the run's server (dropped after the test)."""
    name = pg_server.new_database()
    yield pg_server.url(name)
    pg_server.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path):
    """Where a test's store lives, once per backend: a SQLite file path, or a PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite")
    return request.getfixturevalue("pg_url")
