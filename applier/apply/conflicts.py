"""Apply conflicts: detection, counting, the per-table policy, and the conflict log table.

A conflict is a source change that does not fit the target row it meets:

=======================  ===========================================================================
``insert_exists``        an insert whose unique key already exists on the target
``update_missing``       an update whose row is not on the target
``delete_missing``       a delete whose row is not on the target
``update_origin_differs`` an update of a row last written by someone other than this worker (a
                         local write or another replication); needs ``track_commit_timestamp`` and
                         PostgreSQL 16+ on the target (``pg_xact_commit_timestamp_origin``) and the
                         worker's session tagged with its replication origin. On PostgreSQL 15
                         the origin of a row version is not queryable, so it is not detected.
=======================  ===========================================================================

Policies, per table or as the default (``--conflict-policy``):

* ``apply`` (default, idempotent): the source wins where it can. insert_exists updates the
  existing row with the source row (upsert); update_origin_differs applies the update; a missing
  row's update or delete is skipped.
* ``keep-local``: the target row wins: insert_exists and update_origin_differs leave it as it is;
  missing rows are skipped.
* ``error``: the worker stops, like PostgreSQL's subscriber, naming the conflict, the source
  transaction's LSN and the command that skips it; nothing of that transaction is applied.

Every conflict is counted per (table, type) and written to ``applier.conflicts`` with the source
LSN and xid, the key, the target row as it was and the source row image, inside the target
transaction that resolves it (so it is logged exactly once, and only if that transaction
commits). Under ``error`` the transaction is rolled back and the record is written on its own
just before the worker stops.

Must never decide transaction boundaries; the apply stage calls it only when a statement
affected no row, so the common path costs nothing (detecting update_origin_differs adds one
condition to every UPDATE, which then affects no row exactly when the row is missing or the
origin differs, and a probe tells which).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from itertools import count
from typing import TYPE_CHECKING

from ..protocol.messages import KIND_BINARY, KIND_UNCHANGED, TupleData
from .relations import RelationMapping, qualified_name
from .session import TargetError, TargetSession
from .statements import NEW, OLD, Statement, _row_filter

if TYPE_CHECKING:
    from .sink import TargetApplier

__all__ = ["ConflictHandler", "CONFLICT_TYPES", "read_copy_xids"]

log = logging.getLogger(__name__)

CONFLICT_TYPES = ("insert_exists", "update_missing", "delete_missing", "update_origin_differs")
_RESOLUTION = {"apply": "applied", "keep-local": "kept-local", "error": "error"}
_FIXED = 7  # $1..$7 of the log statement: slot, type, resolution, schema, table, xid, LSN
_JSONB_PAIRS = 50  # jsonb_build_object takes at most 100 arguments
_names = count(1)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def read_copy_xids(session: TargetSession, slot: str) -> tuple[int, ...]:
    """The target xids of the slot's initial-copy transactions (``applier.copy_transactions``)."""
    result = session.sql("SELECT xid FROM applier.copy_transactions WHERE slot_name = $1",
                         [slot.encode()])
    return tuple(int(result.get_value(row, 0)) for row in range(result.ntuples))


class ConflictHandler:
    def __init__(self, session: TargetSession, slot: str, default_policy: str = "apply",
                 table_policies: dict[tuple[str, str], str] | None = None,
                 origin_id: int | None = None, copy_xids: Sequence[int] = ()) -> None:
        self.session = session
        self.slot = slot
        self.default_policy = default_policy
        self.table_policies = dict(table_policies or {})
        #: The worker's own replication origin id on the target when update_origin_differs is
        #: detected (PostgreSQL 16+, track_commit_timestamp, tagged session), else None.
        self.origin_id = origin_id
        #: Target xids of applier sync's copy transactions: their rows have no origin but are ours.
        self.copy_xids = tuple(copy_xids)
        self.counts: Counter[tuple[str, str]] = Counter()
        self._statements: dict[tuple[object, ...], Statement] = {}

    def policy(self, mapping: RelationMapping) -> str:
        return self.table_policies.get((mapping.table.schema, mapping.table.name), self.default_policy)

    # -- detection hooks called by the apply stage ----------------------------------------------
    def guard(self, statement: Statement) -> Statement:
        """The UPDATE restricted to rows last written by this worker (or of unknown origin)."""
        key = ("guard", statement.name)
        guarded = self._statements.get(key)
        if guarded is None:
            assert " WHERE " in statement.sql and " RETURNING " not in statement.sql
            guarded = self._statements[key] = Statement(
                f"applier_conflict_{next(_names)}".encode(),
                f"{statement.sql} AND {self.written_by_us('xmin')}", statement.params)
        return guarded

    def written_by_us(self, xmin: str) -> str:
        """SQL: the row version whose ``xmin`` this is was written by this worker (its origin, a
        copy of applier sync, or an origin no longer known, as after freezing)."""
        ours = f"{int(self.origin_id or 0)}::pg_catalog.oid"
        test = f"COALESCE((pg_catalog.pg_xact_commit_timestamp_origin({xmin})).roident, {ours}) = {ours}"
        if self.copy_xids:
            listed = ",".join(str(int(x)) for x in self.copy_xids)
            test = f"({test} OR {xmin}::text::bigint = ANY ('{{{listed}}}'::bigint[]))"
        return test

    def insert_exists(self, applier: TargetApplier, mapping: RelationMapping, new: TupleData,
                      key: tuple[int, ...]) -> bool:
        """An insert met an existing key; True when the caller should update that row."""
        policy = self.policy(mapping)
        self._report(applier, mapping, "insert_exists", policy, new, None, NEW, key, True, local=True)
        return policy == "apply"

    def update_not_applied(self, applier: TargetApplier, mapping: RelationMapping, new: TupleData,
                           old: TupleData | None, key_source: int, key_positions: tuple[int, ...],
                           by_key: bool, unguarded: Statement) -> None:
        """An UPDATE changed no row: the row is missing, or (guarded) another origin wrote it."""
        policy = self.policy(mapping)
        if self.origin_id is not None and self._row_exists(applier, mapping, new, old, key_source,
                                                           key_positions, by_key):
            self._report(applier, mapping, "update_origin_differs", policy, new, old, key_source,
                         key_positions, by_key, local=True)
            if policy == "apply":
                applier._execute(unguarded, new, old, mapping)
            return
        self._report(applier, mapping, "update_missing", policy, new, old, key_source,
                     key_positions, by_key, local=False)

    def delete_missing(self, applier: TargetApplier, mapping: RelationMapping, old: TupleData,
                       positions: tuple[int, ...], by_key: bool) -> None:
        self._report(applier, mapping, "delete_missing", self.policy(mapping), None, old, OLD,
                     positions, by_key, local=False)

    # -- internals ------------------------------------------------------------------------------
    def _row_exists(self, applier: TargetApplier, mapping: RelationMapping, new: TupleData,
                    old: TupleData | None, key_source: int, key_positions: tuple[int, ...],
                    by_key: bool) -> bool:
        key = ("probe", mapping.relation.relation_id, key_source, key_positions, by_key)
        statement = self._statements.get(key)
        if statement is None:
            where, params = _row_filter(mapping, key_source, key_positions, 1, by_key)
            statement = self._statements[key] = Statement(
                f"applier_conflict_{next(_names)}".encode(),
                f"SELECT 1 FROM {_from(mapping, by_key)} WHERE {where} LIMIT 1", tuple(params))
        result = applier._execute(statement, new, old, mapping)
        return result.ntuples > 0

    def _report(self, applier: TargetApplier, mapping: RelationMapping, kind: str, policy: str,
                new: TupleData | None, old: TupleData | None, key_source: int,
                key_positions: tuple[int, ...], by_key: bool, *, local: bool) -> None:
        table = qualified_name(mapping.table.schema, mapping.table.name)
        self.counts[(table, kind)] += 1
        if kind in ("update_missing", "delete_missing"):
            resolution = "error" if policy == "error" else "skipped"
        else:
            resolution = _RESOLUTION[policy]
        remote = new if new is not None else old
        assert remote is not None
        remote_source = NEW if new is not None else OLD
        if new is None and by_key:  # a delete by key: the other columns are sent as NULLs
            remote_positions = key_positions
        else:
            remote_positions = tuple(i for i, k in enumerate(remote.kinds) if k != KIND_UNCHANGED)
        statement = self._log_statement(mapping, key_source, key_positions, by_key, remote_source,
                                        remote_positions, local)
        txn = applier._current
        fixed = [self.slot.encode(), kind.encode(), resolution.encode(),
                 mapping.table.schema.encode(), mapping.table.name.encode(),
                 str(txn.xid).encode() if txn else None,
                 str(txn.commit_lsn).encode() if txn else None]
        values: list[bytes | None] = list(fixed)
        formats = [0] * _FIXED
        for source, position in statement.params:
            row = new if source == NEW else old
            assert row is not None
            values.append(row.values[position])  # type: ignore[arg-type]
            formats.append(1 if row.kinds[position] == KIND_BINARY else 0)
        log.log(logging.WARNING if policy == "error" else logging.DEBUG,
                "conflict %s on %s, resolution %s", kind, table, resolution)
        if policy != "error":
            try:
                self.session.run(statement, values, formats)
            except TargetError as exc:
                raise applier._error(f"{exc} (logging a {kind} conflict on {table})",
                                     transient=exc.transient) from exc
            return
        # Stop like PostgreSQL's subscriber: nothing of this transaction is applied; the
        # conflict is recorded on its own so the operator can see both rows.
        key_text = _describe_key(mapping, new if key_source == NEW else old, key_positions)
        try:
            self.session.sql("ROLLBACK")
            self.session.run(statement, values, formats)
        except TargetError as exc:
            log.warning("could not record the %s conflict on %s: %s", kind, table, exc)
        raise applier._error(f"conflict {kind} on table {table} ({key_text}) and its conflict "
                             "policy is 'error'; the conflict is recorded in applier.conflicts")

    def _log_statement(self, mapping: RelationMapping, key_source: int,
                       key_positions: tuple[int, ...], by_key: bool, remote_source: int,
                       remote_positions: tuple[int, ...], local: bool) -> Statement:
        key = ("log", mapping.relation.relation_id, key_source, key_positions, by_key,
               remote_source, remote_positions, local)
        statement = self._statements.get(key)
        if statement is not None:
            return statement
        number = _FIXED + 1
        key_pairs = []
        params: list[tuple[int, int]] = []
        for position in key_positions:
            key_pairs.append(self._pair(mapping, position, number))
            params.append((key_source, position))
            number += 1
        remote_pairs = []
        for position in remote_positions:
            remote_pairs.append(self._pair(mapping, position, number))
            params.append((remote_source, position))
            number += 1
        head = ("INSERT INTO applier.conflicts (slot_name, conflict_type, resolution, table_schema, "
                "table_name, source_xid, source_lsn, key, local_row, remote_row, local_origin, "
                "local_commit_time) SELECT $1, $2, $3, $4, $5, $6::pg_catalog.int8, "
                f"$7::pg_catalog.pg_lsn, {_jsonb(key_pairs)}, ")
        if not local:
            sql = head + f"NULL, {_jsonb(remote_pairs)}, NULL, NULL"
        else:
            where, _ = _row_filter(mapping, key_source, key_positions, _FIXED + 1, by_key)
            if self.origin_id is not None:
                origin = ("(SELECT CASE c.roident WHEN 0 THEN 'local' ELSE COALESCE("
                          "(SELECT r.roname FROM pg_catalog.pg_replication_origin r "
                          "WHERE r.roident = c.roident), c.roident::pg_catalog.text) END "
                          "FROM pg_catalog.pg_xact_commit_timestamp_origin(x.xmin) c)")
                stamp = "(pg_catalog.pg_xact_commit_timestamp_origin(x.xmin)).timestamp"
            else:
                origin, stamp = "NULL::pg_catalog.text", "NULL::pg_catalog.timestamptz"
            sql = (head + f"l.img, {_jsonb(remote_pairs)}, l.origin, l.stamp FROM (SELECT) AS one "
                   f"LEFT JOIN LATERAL (SELECT pg_catalog.to_jsonb(x) AS img, {origin} AS origin, "
                   f"{stamp} AS stamp FROM {_from(mapping, by_key)} AS x WHERE {where} LIMIT 1) "
                   "AS l ON true")
        statement = self._statements[key] = Statement(
            f"applier_conflict_{next(_names)}".encode(), sql, tuple(params))
        return statement

    @staticmethod
    def _pair(mapping: RelationMapping, position: int, number: int) -> str:
        column = mapping.target_columns[position]
        return f"{_literal(column.name)}, ${number}::{column.type_sql}"


def _from(mapping: RelationMapping, by_key: bool) -> str:
    # The same rows the UPDATE/DELETE statements address (statements._row_filter).
    if by_key or mapping.table.partitioned:
        return mapping.table.sql_name
    return f"ONLY {mapping.table.sql_name}"


def _jsonb(pairs: list[str]) -> str:
    if not pairs:
        return "'{}'::pg_catalog.jsonb"
    chunks = [pairs[i:i + _JSONB_PAIRS] for i in range(0, len(pairs), _JSONB_PAIRS)]
    return " OPERATOR(pg_catalog.||) ".join(
        f"pg_catalog.jsonb_build_object({', '.join(chunk)})" for chunk in chunks)


def _describe_key(mapping: RelationMapping, row: TupleData | None, positions: tuple[int, ...]) -> str:
    if row is None:
        return "no key"
    parts = []
    for position in positions[:8]:
        value = row.values[position]
        if value is None:
            shown = "NULL"
        elif isinstance(value, bytes) and row.kinds[position] != KIND_BINARY:
            shown = value[:60].decode("utf-8", errors="replace")
        elif isinstance(value, bytes):
            shown = "\\x" + value[:30].hex()
        else:
            shown = "(unchanged)"
        parts.append(f"{mapping.target_columns[position].name}={shown}")
    return ", ".join(parts) or "no key"
