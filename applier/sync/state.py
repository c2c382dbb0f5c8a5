"""Per-table sync state on the target (``applier.table_sync``) and the apply-side filter it feeds.

Owns reading and writing the state rows of one slot, and ``SyncFilter``: the rule that a change to
a table in a source transaction committed before that table's sync LSN is already in the copy and
must be skipped. Must never copy data, touch the source, or decide which tables to copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psycopg
from sqlalchemy import Engine, text

from ..protocol.lsn import LSN

__all__ = ["SyncIncomplete", "TableState", "SyncFilter", "read_states", "table_sync_lsns",
           "start_copies", "mark_done", "record_copy_transaction"]

TableName = tuple[str, str]  # (schema, table)


class SyncIncomplete(RuntimeError):
    """The initial copy of some published tables has not finished; streaming must not start."""


@dataclass(frozen=True)
class TableState:
    state: str            # 'copying' | 'done'
    sync_lsn: LSN | None  # set once done


def read_states(engine: Engine, slot: str) -> dict[TableName, TableState]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT schema_name, table_name, state, sync_lsn::text "
                                 "FROM applier.table_sync WHERE slot_name = :slot"), {"slot": slot})
        return {(r[0], r[1]): TableState(r[2], LSN.parse(r[3]) if r[3] else None) for r in rows}


def table_sync_lsns(engine: Engine, slot: str) -> dict[TableName, LSN]:
    """The sync LSN of every table ``applier sync`` copied for this slot.

    Raises ``SyncIncomplete`` when a copy is unfinished: the target table may hold a partial copy,
    and changes applied on top of it would leave the replica wrong for good.
    """
    states = read_states(engine, slot)
    unfinished = sorted(name for name, state in states.items() if state.state != "done")
    if unfinished:
        listed = ", ".join(f"{s}.{t}" for s, t in unfinished[:10])
        raise SyncIncomplete(f"the initial copy for slot {slot!r} is unfinished ({len(unfinished)} "
                             f"table(s): {listed}); run applier sync to finish it before "
                             "applier run")
    return {name: state.sync_lsn for name, state in states.items() if state.sync_lsn is not None}


def start_copies(conn: psycopg.Connection, slot: str, tables: Iterable[TableName],
                 forget_position: bool) -> None:
    """Mark ``tables`` as copying (in the caller's transaction, together with their truncation).

    ``forget_position``: the slot is about to be created afresh, so the position recorded for an
    older slot of that name means nothing any more.
    """
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO applier.table_sync (slot_name, schema_name, table_name, state) "
            "VALUES (%s, %s, %s, 'copying') ON CONFLICT (slot_name, schema_name, table_name) DO "
            "UPDATE SET state = 'copying', sync_lsn = NULL, rows_copied = NULL, "
            "bytes_copied = NULL, started_at = now(), finished_at = NULL",
            [(slot, schema, name) for schema, name in tables])
        if forget_position:
            cur.execute("DELETE FROM applier.progress WHERE slot_name = %s", (slot,))
            cur.execute("DELETE FROM applier.table_sync WHERE slot_name = %s AND state = 'done'",
                        (slot,))


def mark_done(conn: psycopg.Connection, slot: str, table: TableName, sync_lsn: LSN, rows: int,
              nbytes: int) -> None:
    conn.execute("UPDATE applier.table_sync SET state = 'done', sync_lsn = %s::pg_lsn, "
                 "rows_copied = %s, bytes_copied = %s, finished_at = now() "
                 "WHERE slot_name = %s AND schema_name = %s AND table_name = %s",
                 (str(sync_lsn), rows, nbytes, slot, table[0], table[1]))


def record_copy_transaction(conn: psycopg.Connection, slot: str) -> None:
    """In a copy's target transaction: note its xid, so that the worker knows the rows it wrote
    (which carry no replication origin) as its own, not as local writes of another origin."""
    conn.execute("INSERT INTO applier.copy_transactions (slot_name, xid) "
                 "VALUES (%s, pg_catalog.txid_current() %% 4294967296) ON CONFLICT DO NOTHING",
                 (slot,))


class SyncFilter:
    """Which tables' changes the current source transaction must not apply.

    A table copied from a snapshot whose consistent point is L holds every transaction whose
    commit record starts before L, and none from L on (a slot decodes exactly the transactions
    committing at or after its consistent point). So a change to that table is skipped when the
    transaction's commit LSN is < L and applied when it is >= L: PostgreSQL's tablesync rule
    (should_apply_changes_for_rel). Once the stream is past every L the filter switches off.
    """

    def __init__(self, sync_lsns: Mapping[TableName, LSN]) -> None:
        self._lsns = dict(sync_lsns)
        self.skipped: frozenset[TableName] = frozenset()

    def begin(self, commit_lsn: LSN) -> None:
        if not self._lsns:
            return
        self.skipped = frozenset(t for t, lsn in self._lsns.items() if commit_lsn < lsn)
        if not self.skipped:
            # Commit LSNs only grow: no later transaction can fall below any sync LSN either.
            self._lsns.clear()

    @property
    def active(self) -> bool:
        """Some table's copy may still hold transactions to come."""
        return bool(self._lsns)

    def skips(self, schema: str, table: str) -> bool:
        return (schema, table) in self.skipped
