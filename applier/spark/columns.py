"""How each column of a replicated table reaches Spark without any value changing.

Owns: the table as a snapshot sees it (:class:`TableInfo`: columns in order with their types, and
the key), an optional scan in the snapshot of the columns whose mapping depends on their data
(:class:`Probe`), and per column the SQL expression of the reading subquery that delivers it to
Spark (:func:`select_expression`): as it is, cast, as text or as JSON text, or failing the read
with a message naming the column. Must never write to the database, and never let a value reach
Spark in a form that silently changes it.

Type mapping (each column goes through a casting subquery; ``text_columns`` forces any column,
or ``"*"`` all, to PostgreSQL's text form). Why each rule exists:

* ``numeric`` without precision: Spark reads decimal(38,18) and rounds past 18 decimals, fails
  past 20 integer digits and on NaN/Infinity -> text. With ``probe=True`` a scan inside the
  snapshot picks ``numeric(p,s)`` when every value fits 38 digits and none is NaN/Infinity.
* ``numeric(p,s)`` with p > 38: Spark reads decimal(38,0) and drops the scale -> text (probe as
  above). ``numeric(p,s)`` with p <= 38 reads exactly; NaN there makes the read fail loudly in
  the driver ("Bad value for type BigDecimal : NaN"); with ``probe=True`` such a column is text.
* ``date``, ``timestamp``, ``timestamptz``: 'infinity' reads as 9999-12-31 and dates before the
  Gregorian reform pass Java's hybrid calendar (1582-10-05..14 shift by ten days, year 1 breaks
  Python) -> such values make the read fail with a message naming the column (an error is
  raised in the subquery); with ``probe=True`` the column is read as text instead.
  ``timestamp`` (without time zone) reads as TimestampNTZ, never shifted by a time zone.
* arrays: one-dimensional arrays of bool, integers, floats and text types stay arrays; a value
  with more than one dimension fails loudly (probe: the column becomes JSON text). Arrays of any
  other element type (numeric rounds, timestamps shift) and declared multi-dimensional arrays are
  read as JSON text (``to_json``), parseable with ``from_json``. Array lower bounds are not kept.
* ``time``/``timetz`` (Spark: a timestamp on 1970-01-01), ``bit`` (Spark: ASCII bytes), money,
  intervals, enums, ranges, composites, domains, network, geometric and every other type -> text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..quoting import ident, literal, qualified
from .snapshot import Snapshot, database_label

__all__ = ["INTEGER_TYPES", "Column", "Probe", "TableInfo", "describe_table", "probe_columns",
           "select_expression"]

#: Integer types: key-range partitions split them into equal widths.
INTEGER_TYPES = frozenset({"int2", "int4", "int8"})
#: Types Spark's PostgreSQL dialect reads exactly as they are.
_NATIVE_TYPES = INTEGER_TYPES | {"bool", "float4", "float8", "text", "varchar", "bpchar", "bytea",
                                 "uuid", "json", "jsonb"}
_ARRAY_ELEMENTS = INTEGER_TYPES | {"bool", "float4", "float8", "text", "varchar", "bpchar"}
_TEMPORAL_TYPES = frozenset({"date", "timestamp", "timestamptz"})
#: Oldest value Java's hybrid calendar and Python's datetime both represent like PostgreSQL does.
_FIRST_GREGORIAN = {"date": "1582-10-15", "timestamp": "1582-10-15 00:00:00",
                    "timestamptz": "1582-10-16 00:00:00+00"}  # a day's margin for any time zone
_MAX_DECIMAL_DIGITS = 38


@dataclass(frozen=True)
class Column:
    name: str
    typname: str
    typtype: str
    typmod: int
    ndims: int
    element: str | None
    declared: str  # format_type(): what the catalog says, for messages

    @property
    def quoted(self) -> str:
        return ident(self.name)

    @property
    def numeric_precision(self) -> int | None:
        """Declared precision of a numeric column, None when unconstrained."""
        return ((self.typmod - 4) >> 16) & 0xFFFF if self.typmod >= 0 else None


@dataclass(frozen=True)
class TableInfo:
    """A table as the snapshot sees it: quoted name, columns in order, key columns."""
    schema: str
    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]

    @property
    def qualified(self) -> str:
        return qualified(self.schema, self.name)

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.name}"

    def column(self, name: str) -> Column:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(f"{self.display} has no column {name!r}")


def describe_table(snap: Snapshot, table: str) -> TableInfo:
    """Columns and key (primary key, else replica identity index) of ``table`` in ``snap``."""
    found = snap.query("SELECT c.oid::int8, n.nspname, c.relname FROM pg_class c "
                       "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
                       (table,))
    if not found:
        raise LookupError(f"table {table!r} does not exist in {database_label(snap.dsn)}")
    oid, schema, name = found[0]
    columns = snap.query(
        "SELECT a.attname, t.typname, t.typtype, a.atttypmod, a.attndims, "
        "CASE WHEN t.typcategory = 'A' THEN e.typname END, format_type(a.atttypid, a.atttypmod) "
        "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "LEFT JOIN pg_type e ON e.oid = t.typelem "
        "WHERE a.attrelid = %s::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", (oid,))
    key = snap.query(
        "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n) "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
        "WHERE i.indrelid = %s::oid AND i.indisvalid AND (i.indisprimary OR i.indisreplident) "
        "ORDER BY i.indisprimary DESC, k.n", (oid,))
    # Both a primary key and a replica identity index may exist: keep the first index's columns.
    key_names: list[str] = []
    for (attname,) in key:
        if attname in key_names:
            break
        key_names.append(attname)
    return TableInfo(schema, name, tuple(Column(*c) for c in columns), tuple(key_names))


def _fail(column: Column, what: str, expected_sql_type: str) -> str:
    """An SQL expression that aborts the read with a message naming the column.

    It depends on the row's value, so the planner cannot fold it into an error at plan time;
    the input cast of a non-literal string raises "invalid input syntax" quoting our text.
    """
    hint = f"column {column.name} holds {what} that Spark cannot represent; read it as text " \
           f"(text_columns=[{column.name!r}]) or let probe=True choose"
    return f"('applier: ' || length({column.quoted}::text)::text || ' ' || {literal(hint)})::{expected_sql_type}"


@dataclass
class Probe:
    """What a scan in the snapshot found about the columns whose mapping depends on data."""
    numeric: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # int digits, scale, special
    unrepresentable: set[str] = field(default_factory=set)  # temporal infinities, old dates, ndims > 1


def probe_columns(snap: Snapshot, info: TableInfo, columns: Sequence[Column]) -> Probe:
    """One scan of ``info`` in the snapshot for what decides how ``columns`` are read."""
    parts: list[tuple[str, str]] = []
    for col in columns:
        q = col.quoted
        if col.typname == "numeric" and col.typtype == "b":
            parts.append((col.name + ":n", f"max(CASE WHEN {q} IN ('NaN', 'Infinity', '-Infinity') THEN 1 ELSE 0 END)"))
            parts.append((col.name + ":i", f"max(CASE WHEN {q} NOT IN ('NaN', 'Infinity', '-Infinity') AND {q} <> 0 "
                                           f"THEN floor(log(abs({q})))::int + 1 ELSE 0 END)"))
            parts.append((col.name + ":s", f"max(scale({q}))"))
        elif col.typname in _TEMPORAL_TYPES:
            parts.append((col.name + ":t", f"max(CASE WHEN NOT isfinite({q}) OR {q} < "
                                           f"{literal(_FIRST_GREGORIAN[col.typname])} THEN 1 ELSE 0 END)"))
        elif col.element in _ARRAY_ELEMENTS:
            parts.append((col.name + ":a", f"max(CASE WHEN array_ndims({q}) > 1 THEN 1 ELSE 0 END)"))
    if not parts:
        return Probe()
    row = snap.query(f"SELECT {', '.join(expr for _, expr in parts)} FROM {info.qualified}")[0]
    found = dict(zip((label for label, _ in parts), row))
    probe = Probe()
    for col in columns:
        if f"{col.name}:n" in found:
            probe.numeric[col.name] = (int(found[f"{col.name}:i"] or 0), int(found[f"{col.name}:s"] or 0),
                                       bool(found[f"{col.name}:n"]))
        elif found.get(f"{col.name}:t") or found.get(f"{col.name}:a"):
            probe.unrepresentable.add(col.name)
    return probe


def select_expression(col: Column, as_text: bool, probe: Probe | None) -> str:
    """The subquery expression that delivers ``col`` to Spark without changing any value."""
    q = col.quoted
    text = f"{q}::text"
    if as_text or col.typtype != "b" and not col.element:  # enums, domains, ranges, composites
        return text
    if probe is not None and col.name in probe.unrepresentable:
        return f"to_json({q})::text" if col.element else text
    if col.typname == "numeric":
        precision = col.numeric_precision
        if probe is None:
            return q if precision is not None and precision <= _MAX_DECIMAL_DIGITS else text
        int_digits, scale, special = probe.numeric.get(col.name, (0, 0, False))
        if special:
            return text
        if precision is not None and precision <= _MAX_DECIMAL_DIGITS:
            return q
        digits = max(int_digits, 1) + scale
        return f"{q}::numeric({digits}, {scale})" if digits <= _MAX_DECIMAL_DIGITS else text
    if col.typname in _TEMPORAL_TYPES:
        if probe is not None:
            return q  # the probe found only finite, representable values
        floor = literal(_FIRST_GREGORIAN[col.typname])
        return (f"CASE WHEN {q} IS NULL OR (isfinite({q}) AND {q} >= {floor}) THEN {q} "
                f"ELSE {_fail(col, 'infinity or a date before 1582-10-15', col.typname)} END")
    if col.element is not None:
        if col.element not in _ARRAY_ELEMENTS or col.ndims > 1:
            return f"to_json({q})::text"
        if probe is not None:
            return q
        return (f"CASE WHEN {q} IS NULL OR array_ndims({q}) <= 1 THEN {q} "
                f"ELSE {_fail(col, 'a multi-dimensional array', col.typname)} END")
    return q if col.typname in _NATIVE_TYPES else text
