"""Hand-made oracle examples: one that holds every shape and workload kind the issue lists (so
that ``./dev test`` covers them all whatever the seed draws), and two that show the rig telling
what it must tell: a replica that differs from the source where the stream says so, and an
example PostgreSQL's subscriber refuses, where the source is the oracle.
"""

from __future__ import annotations

from oracle_schema import Column, Schema, Table
from oracle_values import UserTypes, literal
from oracle_workload import (
    AddColumn,
    BulkInsert,
    Delete,
    DropColumn,
    Insert,
    Savepoint,
    Transaction,
    Truncate,
    Update,
    Where,
    Workload,
)

__all__ = ["COLUMN_ADDED_ON_THE_SOURCE", "EVERY_SHAPE", "FULL_WITHOUT_EQUALITY",
           "ONE_PARTITION_TRUNCATED", "REQUIRED"]

_TYPES = UserTypes("sp ace", "it's", "Ω", 'we"ird')
_ENUM = '"sp ace"."it\'s"'
_INT_DOMAIN = '"sp ace"."Ω"'
_TEXT_DOMAIN = '"sp ace"."we""ird"'


def _big(seed: int, count: int) -> str:
    return (f"(SELECT string_agg(md5(({seed})::text || '.' || i), '') "
            f"FROM generate_series(1, {count}) i)")


_VALUES = Table(
    "sp ace", "Order",
    (Column("id", "bigint", nullable=False, generated="identity always"),
     Column("big", "large text"), Column("doc", "jsonb"), Column("amount", "numeric"),
     Column("at", "timestamptz"), Column("raw", "bytea"), Column("ints", "int[]"),
     Column("texts", "text[]"), Column("mood", "enum"), Column("moods", "enum[]"),
     Column("positive", "int domain"), Column("label", "text domain"),
     Column("twice", "bigint", generated="stored", source="id"),
     Column("n", "int", nullable=False, generated="serial")),
    ("id",), "primary key", dropped_column=True,
    target_order=(13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0))
_COMPOSITE = Table(
    "public", 'a"b',
    (Column("k", "text", nullable=False), Column("day", "date", nullable=False),
     Column("v", "int", generated="identity by default"), Column("w", "text")),
    ("k", "day"), "primary key, full")
_FULL = Table("public", "x.y", (Column("a", "int"), Column("b", "text"), Column("c", "uuid")),
              (), "full")
_INDEX = Table("public", "UPPER", (Column("u", "uuid", nullable=False),
                                   Column("f", "float8", nullable=False), Column("v", "bool")),
               ("u", "f"), "using index")
_RANGE = Table("sp ace", "r", (Column("id", "int", nullable=False), Column("v", "text"),
                               Column("g", "int", generated="stored", source="id")),
               ("id",), "primary key", partitioning="range", nested=True, via_root=True)
_LIST = Table("public", "l", (Column("id", "bigint", nullable=False),
                              Column("p", "int", nullable=False), Column("v", "large text")),
              ("id", "p"), "primary key", partitioning="list")
_HASH = Table("public", "h", (Column("id", "text", nullable=False), Column("v", "int")),
              ("id",), "primary key, full", partitioning="hash", via_root=True)

_SCHEMA = Schema(_TYPES, (_VALUES, _COMPOSITE, _FULL, _INDEX, _RANGE, _LIST, _HASH))


def _row(values: dict[str, str], table: Table) -> tuple[str, ...]:
    from oracle_workload import insert_columns

    return tuple(values.get(name, "NULL") for name in insert_columns(table))


_VALUE_ROW = _row({"big": _big(1, 400), "doc": literal('{"a": [1, null, "x"]}') + "::jsonb",
                   "amount": "'NaN'::numeric", "at": "'2024-02-29 12:34:56.789+05:30'::timestamptz",
                   "raw": "'\\x00ff'::bytea", "ints": "'{1,NULL,3}'::int[]",
                   "texts": literal('{"a,b",NULL,"\\"q\\"","NULL"}') + "::text[]",
                   "mood": literal("with,comma") + f"::{_ENUM}",
                   "moods": literal('{NULL,"NULL","{brace}"}') + f"::{_ENUM}[]",
                   "positive": f"7::{_INT_DOMAIN}", "label": f"'x'::{_TEXT_DOMAIN}"},
                  _VALUES)

_WORKLOAD = Workload((
    Transaction((Insert(0, (_VALUE_ROW, _VALUE_ROW)), BulkInsert(1, 5), BulkInsert(2, 3),
                 Insert(2, (("1", "'dup'", "NULL"), ("1", "'dup'", "NULL"))),
                 BulkInsert(3, 5), BulkInsert(4, 600), BulkInsert(5, 10), BulkInsert(6, 10)),
                "commit"),
    # Large enough to be streamed, a subtransaction rolled back inside it, open while the next
    # four transactions run and commit or prepare.
    Transaction((BulkInsert(0, 1500),
                 Savepoint((BulkInsert(5, 300), Delete(1, Where())), rollback=True),
                 Update(0, Where(3, 1), (("doc", "NULL"),))), "commit", (1, 6, 12, 13)),
    Transaction((Update(4, Where(2, 0), (), key_change=True),  # rows move between partitions
                 Update(5, Where(), (("p", "2"),))), "commit", (2, 3, 4)),
    # Prepared, committed after the streamed transaction commits.
    Transaction((Update(2, Where(nth=0), (("b", "'one of two'"),)),  # one of two identical rows
                 Delete(3, Where(2, 1)), Update(3, Where(), (), key_change=True)),
                "prepare, commit", (3, 3, 3, 5, 15)),
    Transaction((Delete(6, Where(3, 0)), Insert(6, (("5",),))), "rollback", (5, 5, 6)),
    Transaction((Update(0, Where(nth=0), (("amount", "1.5"),)),), "single", (14,)),  # unchanged TOAST
    Transaction((Update(1, Where(), (("v", "DEFAULT"), ("day", "'2001-01-01'::date")),
                        key_change=True),), "prepare, rollback", (14, 15, 16)),
    Transaction((Savepoint((Insert(2, (("2", "'b'", "NULL"),)),), rollback=False),
                 Truncate((1, 2), restart_identity=True)), "commit", (17, 17, 17)),
    Transaction((Update(0, Where(), (("n", "DEFAULT"),), key_change=True),), "single", (18,)),
    # Columns added (on the targets first) in a transaction that goes on writing, and dropped
    # on the source alone; keys deleted and taken again; bursts of small transactions.
    Transaction((AddColumn(2, "text", "'default'"), Insert(2, (("3", "'c'", "NULL"),)),
                 AddColumn(4, "enum")), "commit", (19, 19, 19, 19)),
    Transaction((DropColumn(0, "raw"),), "single", (20,)),
    Transaction((Delete(1, Where(2, 0)), BulkInsert(1, 5, again=True)), "commit", (21, 21, 21)),
    Transaction((Update(3, Where(), (("v", "NOT v"),)),), "single", (22,), repeat=20),
    Transaction((BulkInsert(6, 1),), "single", (22,), repeat=30),
))

#: Every shape and workload kind of the issue, in one example.
EVERY_SHAPE = (_SCHEMA, _WORKLOAD)

#: What ./dev test must cover (oracle_workload.features, plus what the run itself tells).
REQUIRED = frozenset({
    "identity always column", "identity by default column", "serial column", "stored column",
    "int domain column", "text domain column", "enum column", "enum[] column", "int[] column",
    "text[] column", "jsonb column", "numeric column", "timestamptz column", "bytea column",
    "large text column", "composite key", "identity full", "identity using index",
    "identity primary key", "identity primary key, full",
    "range partitions via root", "list partitions via leaves", "hash partitions via root",
    "hostile identifiers", "dropped column", "target column order",
    "insert", "update", "key change", "unchanged TOAST", "delete", "truncate",
    "savepoint rolled back", "savepoint released", "large transaction", "end single",
    "end commit", "end rollback", "end prepare, commit", "end prepare, rollback",
    "interleaved transactions", "prepared across commits", "column added", "column dropped",
    "key reused", "burst of small transactions",
})

# A partition truncated on its own is not published when its table is published through its
# root: every consumer keeps its rows, which the source no longer has.
_ROOTED = Table("public", "rooted", (Column("id", "int", nullable=False), Column("v", "text")),
                ("id",), "primary key", partitioning="range", via_root=True)
ONE_PARTITION_TRUNCATED = (
    Schema(_TYPES, (_ROOTED,)),
    Workload((Transaction((BulkInsert(0, 700),), "single"),
              Transaction((Truncate((0,), one_partition=True),), "single"),
              Transaction((Update(0, Where(), (("v", "'after'"),)),), "single"))))

# The same truncate, then a column added on the source alone, which PostgreSQL's subscriber
# stops at: the source is the oracle, except for that partition (the soak's seed 5064).
A_PARTITION_TRUNCATED_THEN_REFUSED = (
    Schema(_TYPES, (_ROOTED,)),
    Workload((Transaction((BulkInsert(0, 700),), "single"),
              Transaction((Truncate((0,), one_partition=True),), "single"),
              Transaction((AddColumn(0, "jsonb", source_only=True), BulkInsert(0, 5)), "commit"))))

# A column added on the source alone: applier adds it to the target, PostgreSQL's subscriber
# stops at the first row that has it.
_PLAIN = Table("public", "p", (Column("id", "int", nullable=False), Column("v", "text")),
               ("id",), "primary key")
COLUMN_ADDED_ON_THE_SOURCE = (
    Schema(_TYPES, (_PLAIN,)),
    Workload((Transaction((BulkInsert(0, 5),), "single"),
              Transaction((AddColumn(0, "jsonb", source_only=True), BulkInsert(0, 5),
                           Update(0, Where(2, 1), (("v", "'changed'"),))), "commit"))))

# json has no equality operator: PostgreSQL's subscriber cannot find a row of a FULL identity
# table without a key by it, and stops.
_JSON = Table("public", "j", (Column("a", "int"), Column("doc", "json")), (), "full")
FULL_WITHOUT_EQUALITY = (
    Schema(_TYPES, (_JSON,)),
    Workload((Transaction((Insert(0, (("1", literal('{"a": 1}') + "::json"),
                                      ("2", literal('{"b": 2}') + "::json"))),), "single"),
              Transaction((Update(0, Where(nth=0), (("a", "10"),)),), "single"),
              Transaction((Delete(0, Where(nth=0)),), "single"))))

# A column added with a default to a FULL identity table, on the targets first, in the
# transaction that updated its rows just before: PostgreSQL's subscriber (15 and 18) finds none
# of those rows to update and goes on; the source is the oracle (the soak's seed 5035).
_FULL = Table("public", "fa", (Column("a", "int"), Column("v", "text")), (), "full")
A_COLUMN_ADDED_TO_A_FULL_TABLE = (
    Schema(_TYPES, (_FULL,)),
    Workload((Transaction((BulkInsert(0, 5),), "single"),
              Transaction((Update(0, Where(), (("v", "'changed'"),)),
                           AddColumn(0, "text", "'default'")), "commit"))))
