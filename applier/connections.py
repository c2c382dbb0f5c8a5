"""How applier connects to PostgreSQL: every connection notices a dead peer within about 30 s.

A network path that drops packets without a reset (a firewall, a failed router, a middlebox that
forgot the connection) leaves a TCP connection open and silent: a worker waiting for a result or
for the stream would wait forever. So every connection applier opens asks libpq for TCP
keepalives (a probe after 10 s of silence, every 5 s, given up after 3) and a TCP user timeout
(30 s for sent data to be acknowledged), unless the connection string already sets them. Owns
those defaults and the one ``connect``; must never change any other connection parameter.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["LIVENESS", "connect", "with_liveness"]

#: libpq parameters (and their values) that bound how long a dead peer goes unnoticed.
LIVENESS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
            "keepalives_count": "3", "tcp_user_timeout": "30000"}


def with_liveness(dsn: str) -> str:
    """``dsn`` (a URL or key=value string) with the liveness parameters it does not set itself."""
    params = conninfo_to_dict(dsn)
    missing = {key: value for key, value in LIVENESS.items() if key not in params}
    if not missing:
        return dsn
    return make_conninfo("", **{**params, **missing})


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect`` with the liveness parameters."""
    return psycopg.connect(with_liveness(dsn), **kwargs)
