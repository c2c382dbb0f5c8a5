"""How applier connects to PostgreSQL: every connection notices a dead peer within about 30 s,
and a connection string naming several hosts reaches the one that takes writes.

A network path that drops packets without a reset (a firewall, a failed router, a middlebox that
forgot the connection) leaves a TCP connection open and silent: a worker waiting for a result or
for the stream would wait forever. So every connection applier opens asks libpq for TCP
keepalives (a probe after 10 s of silence, every 5 s, given up after 3), a TCP user timeout
(30 s for sent data to be acknowledged) and a 10 s limit per host on connecting (a dead first
host of several must not hold up the others), unless the connection string already sets them.

A source (or target) with a standby names both servers (``host=a,b``, or a URL with several
hosts): libpq (psycopg, for each host in turn) then takes the first that answers, which may be
the standby. Unless the string says otherwise, such a connection asks for
``target_session_attrs=read-write``, so every connection of every command, the replication
connection included (libpq checks it there too), goes to the primary, and after a failover to
the new one. Owns those defaults, the one ``connect``, and naming the one host a connection
reached (``reached``); must never change any other connection parameter, nor drop a host.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["LIVENESS", "connect", "host_count", "reached", "with_liveness"]

#: libpq parameters (and their values) that bound how long a dead peer goes unnoticed.
LIVENESS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
            "keepalives_count": "3", "tcp_user_timeout": "30000", "connect_timeout": "10"}
#: What a connection string naming several hosts asks of the one it takes, unless it says.
SEVERAL_HOSTS = {"target_session_attrs": "read-write"}


def host_count(params: dict[str, Any]) -> int:
    """How many servers connection parameters name (``host`` or ``hostaddr`` lists)."""
    return max(len(str(params.get(key) or "").split(",")) for key in ("host", "hostaddr"))


def with_liveness(dsn: str) -> str:
    """``dsn`` (a URL or key=value string) with the liveness parameters it does not set itself,
    and, when it names several hosts, ``target_session_attrs=read-write`` unless it sets one."""
    params = conninfo_to_dict(dsn)
    wanted = {**LIVENESS, **(SEVERAL_HOSTS if host_count(params) > 1 else {})}
    missing = {key: value for key, value in wanted.items() if key not in params}
    if not missing:
        return dsn
    return make_conninfo("", **{**params, **missing})


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect`` with the liveness parameters."""
    return psycopg.connect(with_liveness(dsn), **kwargs)


def reached(dsn: str, conn: psycopg.Connection[Any]) -> str:
    """``dsn`` naming only the server ``conn`` reached through it: for connections that must
    meet on that one server (sessions importing a snapshot it exported)."""
    params = conninfo_to_dict(dsn)
    if host_count(params) <= 1:
        return dsn
    params.pop("hostaddr", None)
    params.pop("target_session_attrs", None)
    params.update(host=conn.info.host, port=str(conn.info.port))
    return make_conninfo("", **params)
