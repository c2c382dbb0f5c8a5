"""The oracle's column types: for each, its SQL type, hypothesis values as SQL expressions, and a
bulk expression of a series index ``g`` (for large transactions made on the server).

Values are SQL text (a literal with its cast, or an expression), never parameters: a failing
example then prints as a script that psql replays as it is. The example's own types (an enum and
two domains with checks, in a schema with a hostile name) are named through ``UserTypes``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import strategies as st
from psycopg import sql

__all__ = ["BASE_KEY_TYPES", "ENUM_LABELS", "HOSTILE_NAMES", "TYPES", "SqlType", "UserTypes", "ident",
           "literal", "qualified"]

#: Identifiers users have: reserved words, quotes, dots, commas, spaces, tabs, non-ASCII,
#: placeholders, the longest name PostgreSQL keeps (63 bytes), digits first.
HOSTILE_NAMES = (
    "Order", "select", "user", 'we"ird', "sp ace", "ünï cödé", "x.y", "it's", "a,b", "(p)",
    "$1", "%s", "Ω", "UPPER", "tab\tname", "n" * 63, "日本語テーブル", "-", "1abc", "null",
    "back\\slash", "{}", "end", "t",
)
#: Enum labels whose text forms need quoting in arrays and literals ("NULL" in an array is not NULL).
ENUM_LABELS = ("a", "it's", "with,comma", "{brace}", '"quoted"', "NULL", " sp ", "ü", "back\\slash",
               "z")


def ident(name: str) -> str:
    return sql.Identifier(name).as_string(None)


def qualified(schema: str, name: str) -> str:
    return sql.Identifier(schema, name).as_string(None)


def literal(text: str) -> str:
    return sql.Literal(text).as_string(None)


@dataclass(frozen=True)
class UserTypes:
    """The example's own types, in schema ``schema``."""

    schema: str
    enum: str
    int_domain: str
    text_domain: str

    def ddl(self) -> list[str]:
        labels = ", ".join(literal(label) for label in ENUM_LABELS)
        return [f"CREATE TYPE {qualified(self.schema, self.enum)} AS ENUM ({labels})",
                f"CREATE DOMAIN {qualified(self.schema, self.int_domain)} AS int "
                "CHECK (VALUE > 0)",
                f"CREATE DOMAIN {qualified(self.schema, self.text_domain)} AS text "
                "CHECK (VALUE <> '' AND length(VALUE) < 100)"]


@dataclass(frozen=True)
class SqlType:
    """A column type: ``ddl(types)`` its SQL name; ``values(types)`` a strategy of SQL expressions
    (no NULL: nullability is the column's); ``bulk(g, types)`` an expression of the int ``g``."""

    tag: str
    ddl: Callable[[UserTypes], str]
    values: Callable[[UserTypes], st.SearchStrategy[str]]
    bulk: Callable[[str, UserTypes], str]
    #: Usable beside the base column in a composite key (btree equality, no huge values).
    key: bool = True
    #: Holds values large enough to be stored out of line (TOAST).
    toast: bool = False
    #: Has an equality operator (REPLICA IDENTITY FULL can find a row by it).
    equality: bool = True


def _cast(type_sql: str) -> Callable[[str], str]:
    return lambda text: f"{literal(text)}::{type_sql}"


def _fixed(type_sql: str, strategy: st.SearchStrategy[str]) -> Callable[[UserTypes], st.SearchStrategy[str]]:
    return lambda types: strategy.map(_cast(type_sql))


_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)
_zones = st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)),
                          timezone(timedelta(hours=-8)), timezone(timedelta(minutes=-30))])


def _float_text(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


def _array(items: list[str | None]) -> str:
    """A PostgreSQL array literal of quoted elements (None: NULL)."""
    def element(item: str | None) -> str:
        if item is None:
            return "NULL"
        return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "{" + ",".join(element(item) for item in items) + "}"


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**15, 10**15)
    | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6)

_timestamps = st.one_of(
    st.sampled_from(["infinity", "-infinity"]),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=_zones)
    .map(lambda d: d.isoformat()))
_numerics = st.one_of(
    st.sampled_from(["NaN", "0", "-0", "0.000001", "123456789012345678901234567890.123456789"]),
    st.decimals(allow_nan=False, allow_infinity=False, min_value=-10**20, max_value=10**20)
    .map(str))


def _enum(types: UserTypes) -> str:
    return qualified(types.schema, types.enum)


def _big(expression: str, count: str) -> str:
    """A text of ``count`` md5 digests of ``expression`` and their index: about 32 bytes each,
    hardly compressible (the columns are STORAGE EXTERNAL besides), so stored out of line."""
    return (f"(SELECT string_agg(md5(({expression})::text || '.' || i), '') "
            f"FROM generate_series(1, {count}) i)")


def _toast_values(types: UserTypes) -> st.SearchStrategy[str]:
    small = _text.map(_cast("text"))
    large = st.tuples(st.integers(0, 10**6), st.integers(70, 3000)).map(
        lambda pair: _big(str(pair[0]), str(pair[1])))
    return st.one_of(small, large)


TYPES: dict[str, SqlType] = {t.tag: t for t in (
    SqlType("int", lambda u: "int", _fixed("int", st.integers(-2**31, 2**31 - 1).map(str)),
            lambda g, u: f"({g} * 7919 % 100003 - 50000)"),
    SqlType("bigint", lambda u: "bigint", _fixed("bigint", st.integers(-2**63, 2**63 - 1).map(str)),
            lambda g, u: f"({g}::bigint * 2654435761)"),
    SqlType("numeric", lambda u: "numeric", _fixed("numeric", _numerics),
            lambda g, u: f"round({g} / 7.0, 9)"),
    SqlType("float8", lambda u: "float8", _fixed("float8", st.floats().map(_float_text)),
            lambda g, u: f"({g} / 3.0)::float8"),
    SqlType("text", lambda u: "text", _fixed("text", _text), lambda g, u: f"md5({g}::text)"),
    SqlType("bool", lambda u: "boolean", _fixed("boolean", st.sampled_from(["true", "false"])),
            lambda g, u: f"({g} % 3 = 0)"),
    SqlType("uuid", lambda u: "uuid", _fixed("uuid", st.uuids().map(str)),
            lambda g, u: f"md5({g}::text)::uuid"),
    SqlType("bytea", lambda u: "bytea",
            _fixed("bytea", st.binary(max_size=30).map(lambda b: "\\x" + b.hex())),
            lambda g, u: f"decode(md5({g}::text), 'hex')"),
    SqlType("jsonb", lambda u: "jsonb",
            _fixed("jsonb", _json.map(lambda v: json.dumps(v, ensure_ascii=False))),
            lambda g, u: f"jsonb_build_object('g', {g}, 'l', jsonb_build_array({g}, 'x', NULL))",
            key=False),
    SqlType("json", lambda u: "json",
            _fixed("json", _json.map(lambda v: json.dumps(v, ensure_ascii=False))),
            lambda g, u: f"json_build_object('g', {g})", key=False, equality=False),
    SqlType("timestamptz", lambda u: "timestamptz", _fixed("timestamptz", _timestamps),
            lambda g, u: f"(timestamptz '2000-01-01 00:00:00+00' + {g} * interval '61 seconds')"),
    SqlType("date", lambda u: "date",
            _fixed("date", st.one_of(st.just("infinity"), st.dates().map(lambda d: d.isoformat()))),
            lambda g, u: f"(date '2000-01-01' + {g})"),
    SqlType("int[]", lambda u: "int[]",
            _fixed("int[]", st.lists(st.none() | st.integers(-2**31, 2**31 - 1).map(str),
                                     max_size=4).map(_array)),
            lambda g, u: f"ARRAY[{g}, NULL, -{g}]", key=False),
    SqlType("text[]", lambda u: "text[]",
            _fixed("text[]", st.lists(st.none() | _text, max_size=4).map(_array)),
            lambda g, u: f"ARRAY[md5({g}::text), NULL, 'a,b\"c{{}}']", key=False),
    SqlType("enum", _enum, lambda u: st.sampled_from(ENUM_LABELS).map(_cast(_enum(u))),
            lambda g, u: f"(enum_range(NULL::{_enum(u)}))[1 + {g} % {len(ENUM_LABELS)}]"),
    SqlType("enum[]", lambda u: _enum(u) + "[]",
            lambda u: st.lists(st.none() | st.sampled_from(ENUM_LABELS), max_size=4)
            .map(_array).map(_cast(_enum(u) + "[]")),
            lambda g, u: f"ARRAY[(enum_range(NULL::{_enum(u)}))[1 + {g} % 3], NULL]", key=False),
    SqlType("int domain", lambda u: qualified(u.schema, u.int_domain),
            lambda u: st.integers(1, 2**31 - 1).map(str).map(_cast(qualified(u.schema, u.int_domain))),
            lambda g, u: f"(1 + {g} % 1000)::{qualified(u.schema, u.int_domain)}"),
    SqlType("text domain", lambda u: qualified(u.schema, u.text_domain),
            lambda u: st.text(st.characters(codec="utf-8", exclude_characters="\x00"),
                              min_size=1, max_size=30)
            .map(_cast(qualified(u.schema, u.text_domain))),
            lambda g, u: f"('v' || {g})::{qualified(u.schema, u.text_domain)}"),
    SqlType("large text", lambda u: "text", _toast_values, lambda g, u: _big(g, "80"),
            key=False, toast=True),
)}

#: Types of the base key column (unique by construction: see ``oracle_workload.key_value``).
BASE_KEY_TYPES = ("int", "bigint", "text", "uuid")
