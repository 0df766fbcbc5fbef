"""A real PostgreSQL server for the tests: Debian's binaries, a fresh cluster in a temporary directory on a
free loopback port, stopped at the end. PostgreSQL refuses to run as root, so as root it runs as the
``postgres`` user (or ``nobody``) through ``runuser``."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.sockets import free_port

__all__ = ["PostgresServer", "pg_bin", "postgres_server"]

_databases = iter(range(1 << 30))


def pg_bin() -> Path | None:
    """The directory of ``initdb``/``pg_ctl`` (Debian keeps them under /usr/lib/postgresql/N/bin)."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(candidates[-1]).parent if candidates else None


@dataclass
class PostgresServer:
    """A running server: ``dsn`` reaches its ``riskserve`` database over loopback TCP."""

    data: Path
    port: int
    bin: Path
    user: str | None

    @property
    def dsn(self) -> str:
        return f"postgresql://riskserve@127.0.0.1:{self.port}/riskserve"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.data} -c fsync=on "
            "-c max_connections=200 -c shared_buffers=32MB"
        )
        self._run(
            "pg_ctl", "-D", str(self.data / "db"), "-o", options, "-l", str(self.data / "log"), "-w", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data / "db"), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def new_database(self, prefix: str = "t") -> str:
        """A fresh, empty database on this server; returns its DSN."""
        import psycopg

        name = f"{prefix}{os.getpid()}_{next(_databases)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn.rsplit("/", 1)[0] + f"/{name}"


def _runner_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no 'postgres' or 'nobody' user to run PostgreSQL as")


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a throwaway PostgreSQL cluster; yields it running, removes it after."""
    binaries = pg_bin()
    if binaries is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
    user = _runner_user()
    data = Path(tempfile.mkdtemp(prefix="riskserve-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    data.chmod(0o700)
    server = PostgresServer(data=data, port=free_port(), bin=binaries, user=user)
    server._run("initdb", "-D", str(data / "db"), "-U", "riskserve", "--auth=trust", "-E", "UTF8")
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            made = server._run("createdb", "-h", "127.0.0.1", "-p", str(server.port), "-U", "riskserve",
                               "riskserve", check=False)  # fmt: skip
            if made.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(data, ignore_errors=True)
