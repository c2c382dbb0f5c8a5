"""PostgreSQL servers in Docker containers (testcontainers), same interface as LocalCluster.

Owns: starting ``postgres:<major>`` images with the standard settings passed
as ``-c name=value`` arguments, mapping their port to the host, stop/start of
the container, and detecting whether a Docker engine is reachable.

Must never: be required on machines without Docker (``testcontainers`` and
``docker`` are imported lazily), pull images other than the official
``postgres:<major>``, or leave containers running after :meth:`cleanup`.
Client programs (psql, pgbench) are taken from local binaries of the same
major version, which :func:`find_or_install_binaries` provides.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from .binaries import find_or_install_binaries
from .server import Database, StopMode, create_database, drop_database
from .settings import ServerSettings

__all__ = ["ContainerCluster", "docker_available"]


def docker_available(timeout: float = 3.0) -> bool:
    """True when a Docker engine answers a ping."""
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=int(max(1, timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


class ContainerCluster:
    """A ``postgres:<major>`` container behaving like :class:`LocalCluster`."""

    def __init__(
        self,
        major: int,
        settings: ServerSettings | Mapping[str, object] | None = None,
        *,
        name: str = "pg",
        image: str | None = None,
    ) -> None:
        self.name = name
        self.settings: ServerSettings = ServerSettings.of(settings)
        self.image = image or f"postgres:{major}"
        self._major = major
        self._password = secrets.token_hex(12)
        self._container: Any = None
        self._port = 0
        self._host = "127.0.0.1"

    @classmethod
    def launch(cls, major: int, settings: ServerSettings | Mapping[str, object] | None = None,
               *, name: str = "pg") -> ContainerCluster:
        cluster = cls(major, settings, name=name)
        try:
            cluster.start()
        except BaseException:
            cluster.cleanup()
            raise
        return cluster

    def __enter__(self) -> ContainerCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    @property
    def version(self) -> int:
        return self._major

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def pgbench_path(self) -> Path:
        return find_or_install_binaries(self._major) / "pgbench"

    @property
    def psql_path(self) -> Path:
        return find_or_install_binaries(self._major) / "psql"

    @property
    def log_path(self) -> Path | None:
        return None  # use container logs: self._container.get_logs()

    def dsn(self, dbname: str = "postgres") -> str:
        return (f"postgresql://postgres:{quote(self._password)}@{self._host}:"
                f"{self._port}/{quote(dbname, safe='')}")

    def start(self) -> None:
        if self._container is None:
            try:
                from testcontainers.community.postgres import PostgresContainer
            except ImportError:  # older testcontainers layout
                from testcontainers.postgres import PostgresContainer

            args = " ".join(f"-c {n}={v}" for n, v in self.settings.values.items())
            container = PostgresContainer(self.image, username="postgres",
                                          password=self._password, dbname="postgres")
            container.with_command(f"postgres {args}")
            container.start()
            self._container = container
        else:
            self._container.get_wrapped_container().start()
        self._refresh_address()
        self._wait_ready()

    def _refresh_address(self) -> None:
        self._container.get_wrapped_container().reload()
        self._host = self._container.get_container_host_ip()
        if self._host == "localhost":
            self._host = "127.0.0.1"
        self._port = int(self._container.get_exposed_port(5432))

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, mode: StopMode = "fast") -> None:
        """fast/smart: ``docker stop`` (the image's SIGINT = fast); immediate: ``docker kill``."""
        if self._container is None:
            return
        wrapped = self._container.get_wrapped_container()
        if mode == "immediate":
            wrapped.kill(signal="SIGQUIT")
            wrapped.wait(timeout=60)
        else:
            wrapped.stop(timeout=120)

    def restart(self, mode: StopMode = "fast") -> None:
        self.stop(mode)
        self.start()

    def cleanup(self) -> None:
        if self._container is not None:
            try:
                self._container.stop()
            finally:
                self._container = None

    def create_database(self, name: str) -> Database:
        create_database(self.dsn(), name)
        return self.database(name)

    def database(self, name: str) -> Database:
        return Database(name=name, dsn=self.dsn(name), cluster=self, version=self._major)

    def drop_database(self, name: str) -> None:
        drop_database(self.dsn(), self.dsn, name)
