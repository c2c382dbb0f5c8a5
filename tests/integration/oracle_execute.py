"""Running an oracle workload on the source: the statements it makes, on several sessions.

A transaction's steps (its statements, its end, a prepared one's finish) run in the order of
their priorities, several transactions open at once on separate sessions. A step that would touch
a table another open (or prepared) transaction holds first ends that one (its remaining
statements are dropped): so no statement ever waits for a lock, and the order stays decided by
the workload alone. Everything that ran is kept as a script (``Script``) that psql can replay,
session by session.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from oracle_schema import Schema, Table
from oracle_values import TYPES, ident, literal, qualified
from oracle_workload import (
    M2,
    AddColumn,
    BulkInsert,
    Delete,
    DropColumn,
    Insert,
    M,
    Op,
    Savepoint,
    Transaction,
    Truncate,
    Update,
    Where,
    Workload,
    insert_columns,
    tables_of,
)

__all__ = ["Script", "run_workload"]

_SESSION_SETUP = "SET lock_timeout = '30s'"


@dataclass
class Script:
    """What ran, in order: (session, statement); session 0 finishes prepared transactions."""

    statements: list[tuple[int, str]] = field(default_factory=list)
    #: The most transactions open at once, and prepared transactions that stayed pending while
    #: another transaction committed.
    most_open: int = 0
    prepared_across_commits: bool = False

    def text(self) -> str:
        return "\n".join(f"/* session {session} */ {statement};"
                         for session, statement in self.statements)


def key_value(table: Table, number: int) -> str:
    """The base key of the ``number``-th row (text and uuid keys are made of it too)."""
    base = table.base
    assert base is not None
    if base.type == "text":
        return literal(f"k{number}")
    if base.type == "uuid":
        return literal(str(uuid.UUID(hashlib.md5(f"k{number}".encode()).hexdigest()))) + "::uuid"
    return str(number)


def _bulk_key(table: Table, start: int) -> str:
    base = table.base
    assert base is not None
    number = f"({start} + g)"
    if base.type == "text":
        return f"('k' || {number})"
    if base.type == "uuid":
        return f"md5('k' || {number})::uuid"
    return number


def _changed_key(table: Table, generation: int) -> str:
    """A new base key for every row an update changes: unique against every key given out."""
    base = table.base
    assert base is not None
    column = ident(base.name)
    if base.generated:
        return "DEFAULT"
    if base.type == "text":
        return f"{column} || {literal(f'#{generation}')}"
    if base.type == "uuid":
        return f"md5({column}::text || {literal(f'#{generation}')})::uuid"
    modulus = M2 if base.type == "bigint" else M
    return f"{column} % {modulus} + {modulus * generation}"


def _where(table: Table, where: Where) -> str:
    if where.nth is not None:
        return (f" WHERE (x.tableoid, x.ctid) = (SELECT y.tableoid, y.ctid FROM {table.qualified} "
                f"AS y ORDER BY y::text LIMIT 1 OFFSET {where.nth})")
    if where.modulus == 1:
        return ""
    return f" WHERE (hashtext(x::text) & 2147483647) % {where.modulus} = {where.remainder}"


class _Statements:
    """SQL of each op; numbers keys and added columns as it goes, and leaves the columns the
    source dropped out of later statements."""

    def __init__(self, schema: Schema, on_targets: Callable[[str, bool], None]) -> None:
        self.schema = schema
        self.on_targets = on_targets
        #: Tables the open transaction wrote before the op at hand (its streamed part may hold
        #: them on a target).
        self.written: set[int] = set()
        self.next_key = [1] * len(schema.tables)
        self.generation = 0
        self.added = 0
        self.dropped: set[tuple[int, str]] = set()

    def of(self, op: Op) -> list[str]:
        if isinstance(op, Savepoint):
            inner = [statement for o in op.ops for statement in self.of(o)]
            return (["SAVEPOINT sp"] + inner
                    + ["ROLLBACK TO SAVEPOINT sp" if op.rollback else "RELEASE SAVEPOINT sp"])
        if isinstance(op, Truncate):
            return [self._truncate(op)]
        table = self.schema.tables[op.table]
        if isinstance(op, AddColumn):
            return [self._add(table, op)]
        if isinstance(op, DropColumn):
            if (op.table, op.column) in self.dropped:
                return []
            self.dropped.add((op.table, op.column))  # its transaction always commits
            return [f"ALTER TABLE {table.qualified} DROP COLUMN {ident(op.column)}"]
        if isinstance(op, Insert):
            return [self._insert(table, op)]
        if isinstance(op, BulkInsert):
            return [self._bulk(table, op)]
        if isinstance(op, Update):
            return self._update(table, op)
        assert isinstance(op, Delete)
        return [f"DELETE FROM {table.qualified} AS x{_where(table, op.where)}"]

    def _keys(self, index: int, count: int) -> int:
        """The first of ``count`` new base keys of table ``index``."""
        first = self.next_key[index]
        self.next_key[index] += count
        return first

    def _add(self, table: Table, op: AddColumn) -> str:
        """``ALTER TABLE ... ADD COLUMN`` for the source, run on every target first (unless
        the source alone gets it)."""
        self.added += 1
        statement = (f"ALTER TABLE {table.qualified} ADD COLUMN {ident(f'added {self.added}')} "
                     f"{TYPES[op.type].ddl(self.schema.types)}")
        if op.default is not None:
            statement += f" DEFAULT {op.default}"
        if not op.source_only:
            self.on_targets(statement, op.table in self.written)
        return statement

    def _kept(self, index: int, names: list[str]) -> list[bool]:
        return [(index, name) not in self.dropped for name in names]

    def _insert(self, table: Table, op: Insert) -> str:
        kept = self._kept(op.table, insert_columns(table))
        names = [n for n, k in zip(insert_columns(table), kept) if k]
        rows = [[v for v, k in zip(row, kept) if k] for row in op.rows]
        base = table.base
        if base is not None and base.writable:
            first = self._keys(op.table, len(rows))
            names = [base.name] + names
            rows = [[key_value(table, first + i)] + row for i, row in enumerate(rows)]
        if not names:
            return f"INSERT INTO {table.qualified} SELECT FROM generate_series(1, {len(rows)})"
        values = ", ".join("(" + ", ".join(row) + ")" for row in rows)
        return f"INSERT INTO {table.qualified} ({', '.join(map(ident, names))}) VALUES {values}"

    def _bulk(self, table: Table, op: BulkInsert) -> str:
        names, expressions = [], []
        base = table.base
        # Keys an identity or serial gives are not taken again: after TRUNCATE ... RESTART
        # IDENTITY the sequence would give them once more.
        again = op.again and base is not None and base.writable
        first = self._keys(op.table, 0 if again else op.count)
        if base is not None and base.writable:
            names.append(base.name)
            expressions.append(_bulk_key(table, 0 if again else first - 1))
        for name in insert_columns(table):
            if (op.table, name) in self.dropped:
                continue
            column = table.column(name)
            if table.partitioning == "list" and name == table.key[1]:
                expression = "(g % 4)"
            else:
                expression = TYPES[column.type].bulk("g", self.schema.types)
            if column.nullable:
                expression = f"CASE WHEN g % 7 = 3 THEN NULL ELSE {expression} END"
            names.append(name)
            expressions.append(expression)
        if not names:
            return f"INSERT INTO {table.qualified} SELECT FROM generate_series(1, {op.count}) g"
        into = f"INSERT INTO {table.qualified} ({', '.join(map(ident, names))})"
        if not again:
            return f"{into} SELECT {', '.join(expressions)} FROM generate_series(1, {op.count}) g"
        assert base is not None
        return (f"{into} SELECT {', '.join(expressions)} "
                f"FROM generate_series(1, {first - 1}) g WHERE NOT EXISTS (SELECT FROM "
                f"{table.qualified} AS y WHERE y.{ident(base.name)} = {expressions[0]}) "
                f"LIMIT {op.count}")

    def _update(self, table: Table, op: Update) -> list[str]:
        sets = [f"{ident(name)} = {value}" for name, value in op.sets
                if (op.table, name) not in self.dropped]
        if op.key_change and table.base is not None:
            self.generation += 1
            sets.append(f"{ident(table.base.name)} = {_changed_key(table, self.generation)}")
        if not sets:
            return []
        return [f"UPDATE {table.qualified} AS x SET {', '.join(sets)}{_where(table, op.where)}"]

    def _truncate(self, op: Truncate) -> str:
        if op.one_partition:
            table = self.schema.tables[op.tables[0]]
            names = [qualified(table.schema, table.leaves()[0])]
        else:
            names = [self.schema.tables[i].qualified for i in op.tables]
        return f"TRUNCATE {', '.join(names)}" + (" RESTART IDENTITY" if op.restart_identity else "")


class _Runner:
    def __init__(self, dsn: str, schema: Schema, on_targets: Callable[[str, bool], None]) -> None:
        self.dsn = dsn
        self.statements = _Statements(schema, on_targets)
        self.script = Script()
        self.sessions: list[psycopg.Connection] = []
        self.free: list[int] = []
        self.open: dict[int, int] = {}          # transaction -> session
        self.holds: dict[int, set[int]] = {}    # transaction (open or prepared) -> tables
        self.prepared: set[int] = set()

    def session(self) -> int:
        if self.free:
            return self.free.pop(0)
        conn = psycopg.connect(self.dsn, autocommit=True)
        conn.execute(_SESSION_SETUP)
        self.sessions.append(conn)
        return len(self.sessions)

    def run(self, session: int, statement: str) -> None:
        self.script.statements.append((session, statement))
        conn = self.control if session == 0 else self.sessions[session - 1]
        try:
            conn.execute(statement)
        except psycopg.Error as exc:
            raise AssertionError(f"the oracle's workload failed on the source (a bug in the "
                                 f"test): {exc}\n{self.script.text()}") from exc

    def execute(self, workload: Workload) -> Script:
        with psycopg.connect(self.dsn, autocommit=True) as control:
            self.control = control
            try:
                self._execute(workload.transactions)
            finally:
                for conn in self.sessions:
                    conn.close()
        return self.script

    def _execute(self, transactions: tuple[Transaction, ...]) -> None:
        done = [0] * len(transactions)
        while True:
            ready = [(self._priority(t, done[i]), i) for i, t in enumerate(transactions)
                     if done[i] < t.steps()]
            if not ready:
                return
            _, i = min(ready)
            self._step(transactions, done, i)

    @staticmethod
    def _priority(txn: Transaction, step: int) -> int:
        return txn.priorities[step] if step < len(txn.priorities) else 0

    def _step(self, transactions: tuple[Transaction, ...], done: list[int], i: int) -> None:
        txn, step = transactions[i], done[i]
        done[i] += 1
        if step < len(txn.ops):
            op = txn.ops[step]
            tables = tables_of(op)
            for j in [j for j, held in self.holds.items() if j != i and held & tables]:
                self._end_now(transactions, done, j)
            if txn.end == "single":
                self.statements.written = set()
                session = self.session()
                for _ in range(txn.repeat):
                    for statement in self.statements.of(op):
                        self.run(session, statement)
                    self._committed()
                self.free.append(session)
                return
            if i not in self.open:
                self.open[i] = self.session()
                self.run(self.open[i], "BEGIN")
                self.script.most_open = max(self.script.most_open, len(self.open))
            self.statements.written = set(self.holds.get(i, ()))
            self.holds.setdefault(i, set()).update(tables)
            for statement in self.statements.of(op):
                self.run(self.open[i], statement)
        elif step == len(txn.ops):
            self._end(i, txn)
        else:
            self._finish(i, txn)

    def _end(self, i: int, txn: Transaction) -> None:
        session = self.open.pop(i)
        if txn.end.startswith("prepare"):
            self.run(session, f"PREPARE TRANSACTION {literal(_gid(i))}")
            self.prepared.add(i)
        else:
            self.run(session, "COMMIT" if txn.end == "commit" else "ROLLBACK")
            self.holds.pop(i, None)
            if txn.end == "commit":
                self._committed()
        self.free.append(session)

    def _finish(self, i: int, txn: Transaction) -> None:
        verb = "COMMIT" if txn.end == "prepare, commit" else "ROLLBACK"
        self.run(0, f"{verb} PREPARED {literal(_gid(i))}")
        self.prepared.discard(i)
        self.holds.pop(i, None)

    def _committed(self) -> None:
        if self.prepared:
            self.script.prepared_across_commits = True

    def _end_now(self, transactions: tuple[Transaction, ...], done: list[int], j: int) -> None:
        txn = transactions[j]
        if j in self.open:
            self._end(j, txn)
        if j in self.prepared:
            self._finish(j, txn)
        done[j] = txn.steps()


def _gid(transaction: int) -> str:
    return f"oracle {transaction} it's"


def run_workload(dsn: str, schema: Schema, workload: Workload,
                 on_targets: Callable[[str, bool], None]) -> Script:
    """Run ``workload`` on the source database ``dsn``; the script of what ran. ``on_targets``
    runs a statement on every target (a column added there before the source adds it); its
    second argument says whether the source transaction at hand already wrote that table."""
    return _Runner(dsn, schema, on_targets).execute(workload)
