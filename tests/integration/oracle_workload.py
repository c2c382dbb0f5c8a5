"""The oracle's workloads: transactions over an example's tables, as hypothesis draws them.

Inserts (a few rows or a series large enough to be streamed, duplicates in FULL tables, keys
taken again), updates (of values, of keys, leaving TOASTed values unchanged, of every row, to
what they were), deletes, truncates (RESTART IDENTITY, a single partition), columns added (on
the targets first, or on the source alone) and dropped (on the source), savepoints rolled back
or released, transactions committed, rolled back or prepared and later committed or rolled
back, bursts of small ones, and several of them open at once on separate sessions, their
statements interleaved.

Every choice of rows is made from what the tables hold when the statement runs (a hash of the
row's text, or its place in text order), and keys are made unique by construction: the base key
of a row is a number the workload gives out once, and a changed key is ``base + M * n`` for a
number ``n`` used once. So any part of a workload (which is what hypothesis' shrinking tries) is
a valid workload too, and runs without a unique violation or a lock wait (``oracle_execute``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from oracle_schema import Schema, Table
from oracle_values import TYPES, ident

__all__ = ["AddColumn", "BulkInsert", "Delete", "DropColumn", "Insert", "Op", "Savepoint",
           "Transaction", "Truncate", "Update", "Where", "Workload", "droppable", "features",
           "insert_columns", "tables_of", "workloads"]

#: A changed int key is base + M * n (bigint: M2): bases stay below M, each n is used once.
M, M2 = 1 << 17, 1 << 32


@dataclass(frozen=True)
class Where:
    """Rows whose text hashes to ``remainder`` modulo ``modulus`` (1: every row); or with
    ``nth`` set, the one row at that place in text order (one of identical rows, not all)."""

    modulus: int = 1
    remainder: int = 0
    nth: int | None = None


@dataclass(frozen=True)
class Insert:
    table: int
    #: Per row, a value for each column ``insert_columns`` names.
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class BulkInsert:
    """``count`` rows made on the server; ``again``: at most ``count`` rows that take base keys
    given out before and gone now (deleted, truncated or changed), where the workload numbers
    the keys."""

    table: int
    count: int
    again: bool = False


@dataclass(frozen=True)
class Update:
    table: int
    where: Where
    #: (column, SQL value or "DEFAULT"); a composite key's other columns may be among them.
    sets: tuple[tuple[str, str], ...]
    #: The base key changes too (to a new unique value, made when the statement runs).
    key_change: bool = False


@dataclass(frozen=True)
class Delete:
    table: int
    where: Where


@dataclass(frozen=True)
class Truncate:
    tables: tuple[int, ...]
    restart_identity: bool = False
    #: Truncate one leaf partition of the first table instead of the table.
    one_partition: bool = False


@dataclass(frozen=True)
class Savepoint:
    ops: tuple[Op, ...]
    rollback: bool


@dataclass(frozen=True)
class AddColumn:
    """A column added (``added <n>``, numbered as the workload runs), on every target first
    (as users migrate a replica) unless ``source_only``: applier then adds it itself, and
    PostgreSQL's subscriber stops at it (the source is then the oracle)."""

    table: int
    type: str
    #: SQL value of its DEFAULT (None: none; a column added on the source alone has none).
    default: str | None = None
    source_only: bool = False


@dataclass(frozen=True)
class DropColumn:
    """A column dropped on the source alone (the targets keep theirs); later statements leave
    it out. Only in a transaction of its own, which always commits."""

    table: int
    column: str


Op = Insert | BulkInsert | Update | Delete | Truncate | Savepoint | AddColumn | DropColumn


@dataclass(frozen=True)
class Transaction:
    ops: tuple[Op, ...]
    #: "single" (one statement, autocommit) | "commit" | "rollback" | "prepare, commit" |
    #: "prepare, rollback"
    end: str
    #: Interleaving: a step (each op, the end, a prepared one's finish) runs when its priority
    #: is the lowest of every open transaction's next step (missing ones are 0).
    priorities: tuple[int, ...] = ()
    #: A "single" one runs this many times, each its own transaction (a burst of small ones).
    repeat: int = 1

    def steps(self) -> int:
        if self.end == "single":
            return len(self.ops)
        return len(self.ops) + (2 if self.end.startswith("prepare") else 1)


@dataclass(frozen=True)
class Workload:
    transactions: tuple[Transaction, ...]


def insert_columns(table: Table) -> list[str]:
    """The columns an Insert gives values for: every writable one but the base key's."""
    base = table.base
    return [c.name for c in table.columns if c.writable and (base is None or c is not base)]


def tables_of(op: Op) -> set[int]:
    if isinstance(op, Savepoint):
        return set().union(*(tables_of(o) for o in op.ops)) if op.ops else set()
    if isinstance(op, Truncate):
        return set(op.tables)
    return {op.table}


# -- hypothesis ----------------------------------------------------------------------------------

_wheres = st.one_of(st.just(Where()),
                    st.integers(2, 7).flatmap(lambda m: st.integers(0, m - 1).map(
                        lambda r: Where(m, r))),
                    st.integers(0, 30).map(lambda n: Where(nth=n)))
_bulk_counts = st.one_of(st.integers(1, 30), st.integers(200, 400), st.integers(1200, 2500))
_added_types = ("int", "text", "jsonb", "enum", "numeric", "timestamptz", "large text")


def droppable(table: Table) -> list[str]:
    """Columns the source may drop: none of the key, the partition key, or a stored column's."""
    sources = {c.source for c in table.columns if c.generated == "stored"}
    return [c.name for c in table.columns if c.name not in table.key and c.name not in sources]


def _value(table: Table, name: str, schema: Schema) -> st.SearchStrategy[str]:
    column = table.column(name)
    if table.partitioning == "list" and name == table.key[1]:
        return st.integers(0, 3).map(lambda n: f"{n}::int")
    values = TYPES[column.type].values(schema.types)
    return values if not column.nullable else st.one_of(st.just("NULL"), values)


@st.composite
def _insert(draw: st.DrawFn, schema: Schema, index: int) -> Insert:
    table = schema.tables[index]
    columns = insert_columns(table)
    row = st.tuples(*(_value(table, c, schema) for c in columns))
    rows = draw(st.lists(row, min_size=1, max_size=6))
    if not table.key and draw(st.booleans()):
        rows.append(rows[0])  # identical rows: FULL identity must change only one of them
    return Insert(index, tuple(rows))


@st.composite
def _update(draw: st.DrawFn, schema: Schema, index: int) -> Update:
    table = schema.tables[index]
    base = table.base
    settable = [c for c in table.columns if c.generated != "stored" and c is not base]
    chosen = draw(st.lists(st.sampled_from(settable), max_size=3, unique_by=lambda c: c.name)
                  if settable else st.just([]))
    # A value, or the column itself (an update that changes nothing there).
    sets = tuple((c.name, "DEFAULT" if c.generated else draw(
        st.one_of(_value(table, c.name, schema), st.just(ident(c.name))))) for c in chosen)
    key_change = base is not None and draw(st.integers(0, 2)) == 0
    if not sets and not key_change:  # an update changes something
        if base is not None:
            key_change = True
        elif settable:
            sets = ((settable[0].name, draw(_value(table, settable[0].name, schema))),)
    return Update(index, draw(_wheres), sets, key_change)


@st.composite
def _truncate(draw: st.DrawFn, schema: Schema, index: int) -> Truncate:
    others = draw(st.lists(st.integers(0, len(schema.tables) - 1), max_size=2, unique=True))
    tables = (index,) + tuple(i for i in others if i != index)
    one = bool(schema.tables[index].partitioning) and len(tables) == 1 and draw(st.booleans())
    return Truncate(tables, restart_identity=draw(st.booleans()), one_partition=one)


@st.composite
def _add_column(draw: st.DrawFn, schema: Schema, index: int) -> AddColumn:
    kind = draw(st.sampled_from(_added_types))
    # Seldom: PostgreSQL's subscriber stops at it, and the source is the oracle from there on.
    if draw(st.integers(0, 3)) == 0:
        return AddColumn(index, kind, source_only=True)
    # A DEFAULT cannot hold a subquery (a large value's expression).
    default = None if TYPES[kind].toast else draw(st.none() | TYPES[kind].values(schema.types))
    return AddColumn(index, kind, default)


def _ops(schema: Schema, depth: int = 0) -> st.SearchStrategy[Op]:
    table = st.integers(0, len(schema.tables) - 1)
    simple = st.one_of(
        table.flatmap(lambda i: _insert(schema, i)),
        st.tuples(table, _bulk_counts, st.integers(0, 3).map(lambda n: n == 0))
        .map(lambda p: BulkInsert(*p)),
        table.flatmap(lambda i: _update(schema, i)),
        st.tuples(table, _wheres).map(lambda p: Delete(*p)),
    )
    truncate = table.flatmap(lambda i: _truncate(schema, i))
    rare = st.one_of(truncate, truncate, table.flatmap(lambda i: _add_column(schema, i)))
    if depth == 0:
        savepoint = st.tuples(st.lists(_ops(schema, 1), min_size=1, max_size=3),
                              st.booleans()).map(lambda p: Savepoint(tuple(p[0]), p[1]))
        return st.one_of(simple, simple, simple, rare, savepoint)
    return st.one_of(simple, rare)


@st.composite
def _transactions(draw: st.DrawFn, schema: Schema) -> Transaction:
    end = draw(st.sampled_from(["single", "commit", "commit", "rollback", "prepare, commit",
                                "prepare, rollback"]))
    ops = draw(st.lists(_ops(schema), min_size=1, max_size=1 if end == "single" else 5))
    repeat = 1
    if end == "single":
        if isinstance(ops[0], Savepoint):
            end = "commit"
        elif draw(st.integers(0, 4)) == 0:  # a column dropped, alone
            index = draw(st.integers(0, len(schema.tables) - 1))
            names = droppable(schema.tables[index])
            if names:
                ops = [DropColumn(index, draw(st.sampled_from(names)))]
        elif isinstance(ops[0], (Insert, BulkInsert, Update, Delete)) and draw(
                st.integers(0, 3)) == 0:  # a burst of small transactions
            repeat = draw(st.integers(2, 60))
    steps = Transaction(tuple(ops), end).steps()
    priorities = draw(st.lists(st.integers(0, 20), min_size=steps, max_size=steps))
    return Transaction(tuple(ops), end, tuple(sorted(priorities)), repeat)


def workloads(schema: Schema, max_transactions: int = 10) -> st.SearchStrategy[Workload]:
    return st.lists(_transactions(schema), min_size=1, max_size=max_transactions).map(
        lambda ts: Workload(tuple(ts)))


# -- what an example covers ----------------------------------------------------------------------

def _op_features(op: Op, schema: Schema) -> set[str]:
    if isinstance(op, Savepoint):
        found = {"savepoint rolled back" if op.rollback else "savepoint released"}
        return found.union(*(_op_features(o, schema) for o in op.ops))
    if isinstance(op, Truncate):
        return {"truncate"}
    if isinstance(op, AddColumn):
        return {"column added on the source alone" if op.source_only else "column added"}
    if isinstance(op, DropColumn):
        return {"column dropped"}
    table = schema.tables[op.table]
    if isinstance(op, Insert):
        return {"insert"}
    if isinstance(op, BulkInsert):
        if op.again and table.base is not None and table.base.writable:
            return {"insert", "key reused"}
        return {"insert", "large transaction"} if op.count >= 1200 else {"insert"}
    if isinstance(op, Delete):
        return {"delete"}
    found = {"update"}
    if op.key_change or set(table.key) & {name for name, _ in op.sets}:
        found.add("key change")
    toasted = {c.name for c in table.columns if TYPES[c.type].toast}
    if toasted and not toasted & {name for name, _ in op.sets}:
        found.add("unchanged TOAST")
    return found


def features(schema: Schema, workload: Workload) -> set[str]:
    """The shapes and workload kinds an example holds (the test checks that a run covers all)."""
    found: set[str] = set()
    for table in schema.tables:
        found.add(f"identity {table.identity}")
        found |= {f"{c.generated} column" for c in table.columns if c.generated}
        found |= {f"{c.type} column" for c in table.columns}
        if len(table.key) > 1:
            found.add("composite key")
        if table.partitioning:
            found.add(f"{table.partitioning} partitions via {'root' if table.via_root else 'leaves'}")
        if table.dropped_column:
            found.add("dropped column")
        if table.target_order:
            found.add("target column order")
        if any(not name.isidentifier() or name != name.lower()
               for name in [table.schema, table.name] + [c.name for c in table.columns]):
            found.add("hostile identifiers")
    for txn in workload.transactions:
        found.add(f"end {txn.end}")
        if txn.repeat > 1:
            found.add("burst of small transactions")
        for op in txn.ops:
            found |= _op_features(op, schema)
    return found
