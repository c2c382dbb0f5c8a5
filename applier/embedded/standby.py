"""A primary and its physical standby on this machine, set up for a failover of logical slots.

Owns what the failover tests (and anyone trying failover slots by hand) need of a local pair:
making a cluster the physical standby of another the way slot synchronisation needs it (a
physical slot on the primary, ``pg_basebackup -R`` through it with a dbname in
primary_conninfo, the standby's ``wal_level = logical``, ``hot_standby_feedback`` and
``sync_replication_slots``), naming that slot in the primary's ``synchronized_standby_slots``
(or not), waiting until the standby holds a usable synchronised copy of a logical slot, and a
failover: the standby promoted, the old primary stopped ``-m immediate``.

Must never touch a cluster it was not given, and works on local clusters only (a container's
data directory is not on this machine).
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from .cluster import LocalCluster
from .server import ClusterError
from .settings import ServerSettings

__all__ = ["attach_standby", "fail_over", "new_standby", "protect", "standby_slot_name",
           "synced_copy", "wait_synced"]

_SYNCHRONIZED = "synchronized_standby_slots"


def standby_slot_name(standby: LocalCluster) -> str:
    """The physical slot on the primary that ``standby`` streams through."""
    return "standby_" + "".join(ch if ch.isalnum() else "_" for ch in standby.name.lower())


def new_standby(primary: LocalCluster, *, name: str, protected: bool = True) -> LocalCluster:
    """A new cluster running as the physical standby of ``primary`` (see ``attach_standby``)."""
    standby = LocalCluster(primary.bin_dir, primary.settings, name=name)
    try:
        attach_standby(primary, standby, protected=protected)
    except BaseException:
        standby.cleanup()
        raise
    return standby


def attach_standby(primary: LocalCluster, standby: LocalCluster, *, protected: bool = True) -> None:
    """Make ``standby`` (its data replaced) a running physical standby of ``primary``, through a
    physical slot on the primary; ``protected``: the primary's synchronized_standby_slots names
    that slot (failover slots then send nothing the standby has not received), else it is empty."""
    slot = standby_slot_name(standby)
    with psycopg.connect(primary.dsn(), autocommit=True) as conn:
        if not conn.execute("SELECT FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchall():
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
    wanted: dict[str, Any] = {"hot_standby_feedback": "on", "wal_level": "logical"}
    if primary.version >= 17:
        wanted["sync_replication_slots"] = "on"
    standby.settings = _without(primary.settings, _SYNCHRONIZED).merged(wanted)
    standby.init_from_backup(f"host=127.0.0.1 port={primary.port} user=postgres dbname=postgres",
                             slot=slot)
    standby.start()
    protect(primary, slot if protected else None)


def protect(primary: LocalCluster, slot: str | None) -> None:
    """Set the primary's synchronized_standby_slots to ``slot`` (None: empty), and reload."""
    if primary.version < 17:
        return
    settings = _without(primary.settings, _SYNCHRONIZED)
    primary.write_settings(settings.merged({_SYNCHRONIZED: slot}) if slot else settings)
    primary.reload()


def synced_copy(standby: LocalCluster, slot: str) -> dict[str, Any] | None:
    """The standby's synchronised copy of logical ``slot`` as pg_replication_slots shows it
    (failover, synced, temporary, invalidation_reason, confirmed_flush_lsn), None without one."""
    with psycopg.connect(standby.dsn(), autocommit=True) as conn:
        cursor = conn.execute(
            "SELECT failover, synced, temporary, invalidation_reason, confirmed_flush_lsn::text "
            "FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        row = cursor.fetchone()
        names = [column.name for column in cursor.description or ()]
    return None if row is None else dict(zip(names, row))


def wait_synced(primary: LocalCluster, standby: LocalCluster, slot: str, *,
                timeout: float = 120.0) -> None:
    """Wait until ``standby`` holds a persistent, valid synchronised copy of ``slot``.

    A copy stays temporary until the primary's slot has moved past what the standby can decode
    from: its catalog xmin moves when a consumer confirms past a running-transactions record,
    which the primary writes every 15 s when busy; writing one now (``pg_log_standby_snapshot``)
    saves most of that wait."""
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(primary.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_log_standby_snapshot()")
        copy = synced_copy(standby, slot)
        if copy and copy["synced"] and not copy["temporary"] and copy["invalidation_reason"] is None:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"{standby.name} holds no usable synchronised copy of slot {slot!r} "
                               f"after {timeout:.0f} s: {copy}")
        time.sleep(0.2)


def fail_over(primary: LocalCluster, standby: LocalCluster) -> None:
    """Promote ``standby``, then stop ``primary`` as a crash would (``-m immediate``)."""
    standby.promote()
    primary.stop("immediate")


def _without(settings: ServerSettings, name: str) -> ServerSettings:
    return ServerSettings({key: value for key, value in settings.values.items() if key != name})
