"""Scratch PostgreSQL servers for tests, ``applier demo`` and benchmarks.

Owns: choosing a backend (plain binaries run locally, or Docker containers)
and handing out running servers with the standard source/target settings.
Submodules: :mod:`.binaries` (find/install server binaries), :mod:`.settings`
(the standard server settings), :mod:`.server` (the interface every backend
offers, database helpers), :mod:`.cluster` (local clusters), :mod:`.containers`
(Docker).

Must never: be imported by the applier's data path (protocol, assembler,
apply, progress), touch servers it did not start, or run a server as root.

Environment:
    APPLIER_TEST_BACKEND  ``auto`` (default: docker when an engine answers a
                          ping, else binaries) | ``binaries`` | ``docker``.
    See :mod:`.binaries` for APPLIER_PG15_BIN, APPLIER_PG18_BIN, APPLIER_CACHE_DIR.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from .binaries import (
    BinariesError,
    ServerUser,
    cache_dir,
    find_binaries,
    find_or_install_binaries,
    server_user,
)
from .cluster import LocalCluster
from .server import ClusterError, Database, PostgresServer, StopMode
from .settings import ServerSettings

__all__ = [
    "Backend",
    "BinariesError",
    "ClusterError",
    "Database",
    "LocalCluster",
    "PostgresServer",
    "ServerSettings",
    "ServerUser",
    "StopMode",
    "cache_dir",
    "find_binaries",
    "find_or_install_binaries",
    "selected_backend",
    "server_user",
    "start_server",
]

Backend = Literal["binaries", "docker"]


def selected_backend() -> Backend:
    """Resolve ``APPLIER_TEST_BACKEND`` (auto|binaries|docker) to a concrete backend."""
    choice = os.environ.get("APPLIER_TEST_BACKEND", "auto").strip().lower() or "auto"
    if choice in ("binaries", "docker"):
        return choice  # type: ignore[return-value]
    if choice != "auto":
        raise ValueError(f"APPLIER_TEST_BACKEND={choice!r}: expected auto, binaries or docker")
    from .containers import docker_available

    return "docker" if docker_available() else "binaries"


def start_server(
    major: int,
    settings: ServerSettings | Mapping[str, object] | None = None,
    *,
    name: str = "pg",
    backend: Backend | None = None,
    unix_socket: bool = False,
) -> PostgresServer:
    """A running server of ``major`` with ``settings`` (default: source settings). With
    ``unix_socket`` it also listens on a Unix-domain socket (``LocalCluster.socket_dsn``), which
    only the binaries backend can offer: a container's socket is not on this machine."""
    backend = backend or selected_backend()
    if backend == "docker":
        if unix_socket:
            raise ValueError("a Unix-domain socket needs the binaries backend "
                             "(APPLIER_TEST_BACKEND=binaries): a container's socket is not on this machine")
        from .containers import ContainerCluster

        return ContainerCluster.launch(major, settings, name=name)
    return LocalCluster.launch(major, settings, name=name, unix_socket=unix_socket)
