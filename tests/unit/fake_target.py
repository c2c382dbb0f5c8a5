"""A target session for unit tests of the apply stage, paired with the in-memory store.

``FakeTarget`` plays ``apply.target.TargetSession`` (and ``FakePipeline`` its pipeline): it keeps
the statements it is sent, in order, tracks the transaction state (BEGIN, COMMIT, ROLLBACK,
PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED), tells the ``MemoryStore`` the same, and answers
each row statement with the number of rows ``rows(sql, values)`` says (one by default, so a test
makes a conflict by answering zero). It is a test double of PostgreSQL's answers, not of the
product: integration tests run every path against real servers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from applier.apply.fast.pipeline import PipelineError, RowCountMismatch
from applier.apply.mapping import RelationMapping, TargetColumn, TargetTable, map_relation
from applier.errors import Cause, TargetError
from applier.progress.memory import MemoryStore
from applier.protocol.lsn import LSN
from applier.protocol.messages import Relation, RelationColumn

_GID = re.compile(r"^(COMMIT|ROLLBACK) PREPARED '(.*)'$|^PREPARE TRANSACTION '(.*)'$")


@dataclass
class FakeResult:
    command_tuples: int | None = None
    values: list[tuple[bytes | None, ...]] = field(default_factory=list)

    @property
    def ntuples(self) -> int:
        return len(self.values)

    def get_value(self, row: int, column: int) -> bytes | None:
        return self.values[row][column]


class FakeTarget:
    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.statements: list[str] = []
        #: Every statement with the values it was sent with.
        self.calls: list[tuple[str, list[bytes | None]]] = []
        self.transactions: list[list[str]] = []  # statements of each committed transaction
        self._open: list[str] | None = None
        self.prepared: dict[str, list[str]] = {}
        self.pending: Callable[[], None] | None = None
        self.closed = False
        self.server_encoding = "UTF8"
        #: How many rows a row statement changes; a test sets it to make conflicts.
        self.rows: Callable[[str, Sequence[bytes | None]], int] = lambda sql, values: 1
        #: What a conflict's describing query returns: key, local row, remote row, origin, time.
        self.described: tuple[bytes | None, ...] = (b'{"id": 1}', b'{"id": 1, "v": "local"}',
                                                    b'{"id": 1, "v": "remote"}', None, None)
        #: Raise this at the next statement that matches (SQL text contains the key).
        self.fail_on: dict[str, TargetError] = {}
        self.wal = LSN(0x1000)
        self._begin_owed = False

    # -- what TargetSession offers ---------------------------------------------------------------
    @property
    def in_transaction(self) -> bool:
        return self._begin_owed or self._open is not None

    def begin(self) -> None:
        assert not self.in_transaction, "BEGIN inside a transaction"
        self._begin_owed = True

    def rollback(self) -> None:
        if self._begin_owed:
            self._begin_owed = False
        elif self._open is not None:
            self.sql("ROLLBACK")

    def send_owed_begin(self) -> None:
        """BEGIN goes with the first statement after ``begin``, as in TargetSession."""
        if self._begin_owed:
            self._begin_owed = False
            self._run("BEGIN", [])

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> FakeResult:
        if self.pending is not None:
            self.pending()
        self.send_owed_begin()
        return self._run(text, values or [])

    def execute(self, text: str, values: Sequence[bytes | None] = (),
                formats: Sequence[int] | None = None, binary_result: bool = False) -> FakeResult:
        return self.sql(text, values)

    def run(self, statement: Any, values: Sequence[bytes | None], formats: Sequence[int]) -> FakeResult:
        return self.sql(statement.sql, values)

    def flushed_wal_lsn(self) -> LSN:
        return self.wal

    def current_wal_insert_lsn(self) -> LSN:
        return self.wal

    def pipeline(self) -> FakePipeline:
        if self.pending is not None:
            self.pending()
        begin, self._begin_owed = self._begin_owed, False
        return FakePipeline(self, begin)

    def close(self) -> None:
        self.closed = True

    # -- the statements ------------------------------------------------------------------------------
    def _run(self, text: str, values: Sequence[bytes | None]) -> FakeResult:
        for key, error in list(self.fail_on.items()):
            if key in text:
                del self.fail_on[key]
                if self._open is not None:
                    self._open.append(f"FAILED {text}")
                raise error
        self.statements.append(text)
        self.calls.append((text, list(values)))
        word = text.split(None, 1)[0].upper()
        if text == "BEGIN":
            assert self._open is None, "BEGIN inside a transaction"
            self._open = []
            self.store.begin()
            return FakeResult()
        if text == "COMMIT":
            assert self._open is not None, "COMMIT outside a transaction"
            self.transactions.append(self._open)
            self._open = None
            self.store.commit()
            self.wal = LSN(self.wal + 0x100)
            return FakeResult()
        if text == "ROLLBACK":
            self._open = None
            self.store.rollback()
            return FakeResult()
        gid = _GID.match(text)
        if gid is not None:
            if gid.group(3) is not None:
                assert self._open is not None
                self.prepared[gid.group(3)] = self._open
                self._open = None
                self.store.prepare(gid.group(3))
            else:
                committed = self.prepared.pop(gid.group(2))
                if gid.group(1) == "COMMIT":
                    self.transactions.append(committed)
                self.store.finish_prepared(gid.group(2), gid.group(1) == "COMMIT")
            return FakeResult()
        if self._open is not None:
            self._open.append(text)
        if "pg_prepared_xacts" in text:
            gid_value = (values[0] or b"").decode()
            return FakeResult(values=[(b"1",)] if gid_value in self.prepared else [])
        if "jsonb_build_object" in text or "'{}'::pg_catalog.jsonb" in text:
            return FakeResult(command_tuples=1, values=[self.described])
        if word in ("INSERT", "UPDATE", "DELETE", "WITH") and "applier." not in text:
            return FakeResult(command_tuples=self.rows(text, values))
        if word == "SELECT" and "LIMIT 1" in text:  # a conflict's probe for the row
            return FakeResult(values=[(b"1",)] if self.rows(text, values) else [])
        return FakeResult(command_tuples=0)


class FakePipeline:
    """``apply.pipeline.Pipeline`` over a ``FakeTarget``: statements run at once, results and row
    count mismatches are reported at the next sync, as the real one does."""

    def __init__(self, target: FakeTarget, begin: bool = False) -> None:
        self.target = target
        self._begin = begin
        self._mismatch: str | None = None
        self._error: TargetError | None = None
        self.round_trips = 0

    def open(self) -> FakePipeline:
        if self._begin:
            self._begin = False
            self._send("BEGIN", [], None)
        return self

    def __enter__(self) -> FakePipeline:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        pass

    def _send(self, text: str, values: Sequence[bytes | None], expected_rows: int | None,
              on_value: Callable[[bytes | None], None] | None = None) -> None:
        if self._error is not None:
            return  # the server skips everything after an error until the sync
        try:
            result = self.target._run(text, values)
        except TargetError as exc:
            self._error = PipelineError(str(exc), cause=exc.cause, sqlstate=exc.sqlstate)
            return
        if on_value is not None and result.ntuples:
            on_value(result.get_value(0, 0))
        if expected_rows is not None and self._mismatch is None:
            affected = result.command_tuples or 0
            if affected != expected_rows:
                self._mismatch = f"{text[:40]}: {affected} rows affected, {expected_rows} expected"

    def prepare(self, name: bytes, sql: str) -> None:
        pass

    def send_prepared(self, name: bytes, sql: str, values: Sequence[bytes | None],
                      formats: Sequence[int], expected_rows: int | None = None) -> None:
        self._send(sql, values, expected_rows)

    def send(self, sql: str, values: Sequence[bytes | None] | None = None,
             expected_rows: int | None = None,
             on_value: Callable[[bytes | None], None] | None = None) -> None:
        self._send(sql, values or [], expected_rows, on_value)

    def run(self, statement: Any, values: Sequence[bytes | None], formats: Sequence[int] | None = None,
            *, expected_rows: int | None = None,
            on_value: Callable[[bytes | None], None] | None = None) -> None:
        self._send(statement.sql, values, expected_rows, on_value)

    def sql(self, text: str, values: Sequence[bytes | None] | None = None) -> None:
        self.send(text, values)

    def copy(self, sql: str, data: bytes | bytearray, expected_rows: int | None) -> None:
        self._send(sql, [bytes(data)], None)

    def sync(self) -> None:
        self.round_trips += 1
        error, mismatch = self._error, self._mismatch
        self._error = self._mismatch = None
        if error is not None:
            raise error
        if mismatch is not None:
            raise RowCountMismatch(mismatch)

    def send_sync(self) -> None:
        pass

    def finish(self) -> None:
        self.sync()

    def abandon(self) -> None:
        self._error = self._mismatch = None


def table(name: str = "t", *, independent: bool = True) -> TargetTable:
    """A target table (id integer key, v text) as reflection would describe it."""
    columns = {"id": TargetColumn("id", "integer", False, True, 23),
               "v": TargetColumn("v", "text", False, True, 25)}
    return TargetTable("public", name, columns, ("id",), False, independent)


def relation(relation_id: int = 1, name: str = "t", identity: str = "d") -> Relation:
    return Relation(None, relation_id, "public", name, identity,
                    (RelationColumn(1, "id", 23, -1), RelationColumn(0, "v", 25, -1)))


def mapping(relation_id: int = 1, name: str = "t") -> RelationMapping:
    return map_relation(relation(relation_id, name), table(name))


def lost_connection(what: str = "statement") -> TargetError:
    return TargetError(f"target: connection lost during {what}", cause=Cause.LOST_CONNECTION)


@dataclass
class Rig:
    """An ``Applier`` over a ``FakeTarget`` and a ``MemoryStore``, and the commits it reported."""

    store: MemoryStore
    target: FakeTarget
    applier: Any
    commits: list[LSN]


def rig(*, fast: bool = False, handlers: Callable[[Any], Any] | None = None,
        tables: dict[str, TargetTable] | None = None, careful_until: LSN = LSN(0),
        feeds: dict[tuple[str, str], Any] | None = None) -> Rig:
    """A fresh apply stage for slot "s". ``fast``: with the fast path (batches of 1,000 rows);
    ``handlers(tx)``: the handlers to use (default: ``default_handlers``); ``feeds``: the change
    tables of the tables the change feed records."""
    from applier.apply.dispatch import Applier
    from applier.apply.fast.path import BatchLimits
    from applier.apply.handlers import default_handlers
    from applier.apply.mapping import MissingTargetTable
    from applier.apply.relation_cache import RelationCache
    from applier.apply.transaction import TargetTransaction
    from applier.progress.records import AppliedPosition

    known = tables if tables is not None else {"t": table("t")}

    def reflect(schema: str, name: str) -> TargetTable:
        if name not in known:
            raise MissingTargetTable(f"target table {schema}.{name} does not exist")
        return known[name]

    store = MemoryStore("s")
    target = FakeTarget(store)
    commits: list[LSN] = []
    tx = TargetTransaction(target, store, AppliedPosition(LSN(0), LSN(0)),  # type: ignore[arg-type]
                           lambda end_lsn, target_lsn: commits.append(end_lsn))
    if feeds:
        from applier.apply.feed.writer import FeedWriter

        tx.feed = FeedWriter(tx, feeds, 3600.0, store.slot)
    applier = Applier(tx, RelationCache(reflect, feeds=feeds), (handlers or default_handlers)(tx),
                      limits=BatchLimits(1000, 1 << 20, 3600.0) if fast else None,
                      careful_until=careful_until)
    return Rig(store, target, applier, commits)
