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

Every conflict is counted per (table, type) and recorded through the bookkeeping store
(``applier.conflicts``) with the source LSN and xid, the key, the target row as it was and the
source row image, inside the target transaction that resolves it (so it is logged exactly once,
and only if that transaction commits). The values are turned into JSON by the target (one query
on the conflicting row, which also reads that row as it was), so they read as the target shows
them whatever format they arrived in. Under ``error`` the transaction is rolled back and the
record is written on its own just before the worker stops.

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

from psycopg import pq, sql

from ..errors import Cause
from ..progress.records import ConflictRecord
from ..protocol.messages import KIND_UNCHANGED, TupleData
from .mapping import RelationMapping
from .statements import NEW, OLD, Statement, named, row_filter, table
from .transaction import TargetTransaction

__all__ = ["ConflictHandler", "CONFLICT_TYPES"]

log = logging.getLogger(__name__)

CONFLICT_TYPES = ("insert_exists", "update_missing", "delete_missing", "update_origin_differs")
_RESOLUTION = {"apply": "applied", "keep-local": "kept-local", "error": "error"}
_JSONB_PAIRS = 50  # jsonb_build_object takes at most 100 arguments
_names = count(1)


class ConflictHandler:
    def __init__(self, tx: TargetTransaction, default_policy: str = "apply",
                 table_policies: dict[tuple[str, str], str] | None = None,
                 origin_id: int | None = None, copy_xids: Sequence[int] = ()) -> None:
        self.tx = tx
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

    def forget(self, relation_id: int) -> None:
        """A relation's description changed: its probes are built again on next use. (Guards
        are keyed by the statement they wrap, which is built again itself.)"""
        self._statements = {k: v for k, v in self._statements.items()
                            if k[0] == "guard" or k[1] != relation_id}

    # -- detection hooks called by the careful path -----------------------------------------------
    def guard(self, statement: Statement) -> Statement:
        """The UPDATE restricted to rows last written by this worker (or of unknown origin)."""
        key = ("guard", statement.name)
        guarded = self._statements.get(key)
        if guarded is None:
            assert " WHERE " in statement.sql and " RETURNING " not in statement.sql
            guarded = self._statements[key] = named(
                f"{statement.sql} AND {self.written_by_us('xmin')}", statement.params,
                prefix="applier_conflict")
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

    def insert_exists(self, mapping: RelationMapping, new: TupleData, key: tuple[int, ...]) -> bool:
        """An insert met an existing key; True when the caller should update that row."""
        policy = self.policy(mapping)
        self._report(mapping, "insert_exists", policy, new, None, NEW, key, True, local=True)
        return policy == "apply"

    def update_not_applied(self, mapping: RelationMapping, new: TupleData, old: TupleData | None,
                           key_source: int, key_positions: tuple[int, ...], by_key: bool,
                           unguarded: Statement, meta: Sequence[bytes | None] = ()) -> None:
        """An UPDATE changed no row: the row is missing, or (guarded) another origin wrote it.
        ``unguarded``: the update without the origin test (``meta``: its change feed values)."""
        policy = self.policy(mapping)
        if self.origin_id is not None and self._row_exists(mapping, new, old, key_source,
                                                           key_positions, by_key):
            self._report(mapping, "update_origin_differs", policy, new, old, key_source,
                         key_positions, by_key, local=True)
            if policy == "apply":
                self.tx.execute_row(unguarded, new, old, mapping, meta)
            return
        self._report(mapping, "update_missing", policy, new, old, key_source, key_positions,
                     by_key, local=False)

    def delete_missing(self, mapping: RelationMapping, old: TupleData, positions: tuple[int, ...],
                       by_key: bool) -> None:
        self._report(mapping, "delete_missing", self.policy(mapping), None, old, OLD, positions,
                     by_key, local=False)

    # -- internals ------------------------------------------------------------------------------
    def _row_exists(self, mapping: RelationMapping, new: TupleData, old: TupleData | None,
                    key_source: int, key_positions: tuple[int, ...], by_key: bool) -> bool:
        key = ("probe", mapping.relation.relation_id, key_source, key_positions, by_key)
        statement = self._statements.get(key)
        if statement is None:
            where, params = row_filter(mapping, key_source, key_positions, 1, by_key)
            statement = self._statements[key] = named(
                sql.SQL("SELECT 1 FROM {} WHERE {} LIMIT 1").format(
                    _from(mapping, by_key), where).as_string(), params, prefix="applier_conflict")
        return self.tx.execute_row(statement, new, old, mapping).ntuples > 0

    def _report(self, mapping: RelationMapping, kind: str, policy: str,
                new: TupleData | None, old: TupleData | None, key_source: int,
                key_positions: tuple[int, ...], by_key: bool, *, local: bool) -> None:
        table_name = mapping.table.sql_name
        self.counts[(mapping.table.display, kind)] += 1  # a metrics label: public.t, unquoted
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
        statement = self._describe_statement(mapping, key_source, key_positions, by_key,
                                             remote_source, remote_positions, local)
        described = self.tx.execute_row(statement, new, old, mapping)
        txn = self.tx.current
        record = ConflictRecord(kind, resolution, mapping.table.schema, mapping.table.name,
                                txn.xid if txn else None, txn.commit_lsn if txn else None,
                                *_texts(described))
        log.log(logging.WARNING if policy == "error" else logging.DEBUG,
                "conflict %s on %s, resolution %s", kind, table_name, resolution)
        if policy != "error":
            self.tx.store.record_conflict(record)
            return
        # Stop like PostgreSQL's subscriber: nothing of this transaction is applied; the
        # conflict is recorded on its own so the operator can see both rows.
        self.tx.rollback()
        self.tx.store.record_conflict(record)
        raise self.tx.error(f"conflict {kind} on table {table_name} (key {record.key}) and its "
                            "conflict policy is 'error'; the conflict is recorded in "
                            "applier.conflicts", cause=Cause.REFUSED_DATA)

    def _describe_statement(self, mapping: RelationMapping, key_source: int,
                            key_positions: tuple[int, ...], by_key: bool, remote_source: int,
                            remote_positions: tuple[int, ...], local: bool) -> Statement:
        """SELECT the key and the source row as JSON objects (values cast by the target types)
        and, for a conflict with a local row, that row as it is, its origin and commit time."""
        key = ("describe", mapping.relation.relation_id, key_source, key_positions, by_key,
               remote_source, remote_positions, local)
        statement = self._statements.get(key)
        if statement is not None:
            return statement
        number = 1
        key_pairs, remote_pairs = [], []
        params: list[tuple[int, int]] = []
        for position in key_positions:
            key_pairs.append(_pair(mapping, position, number))
            params.append((key_source, position))
            number += 1
        for position in remote_positions:
            remote_pairs.append(_pair(mapping, position, number))
            params.append((remote_source, position))
            number += 1
        key_json, remote_json = _jsonb(key_pairs), _jsonb(remote_pairs)
        if not local:
            query = sql.SQL("SELECT {}::text, NULL, {}::text, NULL, NULL").format(key_json, remote_json)
        else:
            where, _ = row_filter(mapping, key_source, key_positions, 1, by_key)
            if self.origin_id is not None:
                origin = sql.SQL(
                    "(SELECT CASE c.roident WHEN 0 THEN 'local' ELSE COALESCE("
                    "(SELECT r.roname FROM pg_catalog.pg_replication_origin r "
                    "WHERE r.roident = c.roident), c.roident::pg_catalog.text) END "
                    "FROM pg_catalog.pg_xact_commit_timestamp_origin(x.xmin) c)")
                stamp = sql.SQL("(pg_catalog.pg_xact_commit_timestamp_origin(x.xmin)).timestamp")
            else:
                origin, stamp = sql.SQL("NULL::pg_catalog.text"), sql.SQL("NULL::pg_catalog.timestamptz")
            query = sql.SQL(
                "SELECT {}::text, l.img::text, {}::text, l.origin, l.stamp::text FROM (SELECT) AS one "
                "LEFT JOIN LATERAL (SELECT pg_catalog.to_jsonb(x) AS img, {} AS origin, {} AS stamp "
                "FROM {} AS x WHERE {} LIMIT 1) AS l ON true").format(
                    key_json, remote_json, origin, stamp, _from(mapping, by_key), where)
        statement = self._statements[key] = named(query.as_string(), params,
                                                  prefix="applier_conflict")
        return statement


def _pair(mapping: RelationMapping, position: int, number: int) -> sql.Composable:
    column = mapping.target_columns[position]
    return sql.SQL("{}, ${}::{}").format(sql.Literal(column.name), sql.SQL(str(number)),
                                          sql.SQL(column.type_sql))


def _from(mapping: RelationMapping, by_key: bool) -> sql.Composable:
    # The same rows the UPDATE/DELETE statements address (statements.row_filter).
    if by_key or mapping.table.partitioned:
        return table(mapping)
    return sql.SQL("ONLY {}").format(table(mapping))


def _jsonb(pairs: list[sql.Composable]) -> sql.Composable:
    if not pairs:
        return sql.SQL("'{}'::pg_catalog.jsonb")
    chunks = [pairs[i:i + _JSONB_PAIRS] for i in range(0, len(pairs), _JSONB_PAIRS)]
    return sql.SQL(" OPERATOR(pg_catalog.||) ").join(
        sql.SQL("pg_catalog.jsonb_build_object({})").format(sql.SQL(", ").join(chunk))
        for chunk in chunks)


def _texts(result: pq.abc.PGresult) -> tuple[str, str | None, str, str | None, str | None]:
    """key, local row, remote row, local origin, local commit time, from the describing query."""
    values = [result.get_value(0, i) for i in range(5)]
    text = [None if v is None else v.decode() for v in values]
    return text[0] or "{}", text[1], text[2] or "{}", text[3], text[4]
