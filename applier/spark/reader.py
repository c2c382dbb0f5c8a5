"""Consistent, partitioned, lossless Spark reads of replicated tables over JDBC.

Owns: exporting one snapshot of a database and holding it open (:class:`Snapshot`), reading the
source position the applier worker recorded in that same snapshot, planning key-range partitions,
mapping PostgreSQL types Spark's dialect gets wrong, and attaching the position to the DataFrame.
Must never write to the database, never read with ``fetchsize=0`` (which buffers whole partitions
in the executor), and never let a value reach Spark in a form that silently changes it.

Usage::

    with open_snapshot(replica_dsn) as snap:            # one consistent state for everything
        orders = read_table(spark, "public.orders", snap)
        orders.groupBy("customer_id").count().write.parquet(path)  # actions inside the block
    source_position(orders)  # -> ReadPosition(positions=(SlotPosition(commit_lsn=...), ...))

Consistency: ``open_snapshot`` runs ``pg_export_snapshot()`` in a REPEATABLE READ, READ ONLY
transaction that stays open until the ``with`` block ends; every partition's connection imports
it in ``sessionInitStatement``. Each Spark action re-reads the table, so run every action (or
``persist()`` and materialise) inside the block; after it the read fails loudly with
"snapshot ... does not exist", never with a different state.

Source position: the rows of ``applier.progress`` visible in the snapshot (optionally one slot),
are exposed two ways (documented contract):

* column metadata: every column carries ``{"applier.position": "<json>"}`` with the snapshot id,
  the database's own WAL position and per slot ``slot_name, commit_lsn, end_lsn, commit_time``;
  :func:`source_position` decodes it (metadata survives ``select`` and most projections);
* optionally (``position_columns=True``) literal columns ``_applier_commit_lsn`` and
  ``_applier_commit_time`` (only with exactly one slot row).

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

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ..connections import connect
from .session import JDBC_DRIVER

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["ReadPosition", "SlotPosition", "Snapshot", "TableInfo", "jdbc_options", "open_snapshot", "quote_ident",
           "read_table", "read_tables", "source_position"]

#: Rows per round trip: large enough to keep the network busy, small enough that a partition
#: never holds more than this many rows of driver memory. Never 0 (0 buffers whole partitions).
DEFAULT_FETCHSIZE = 10_000
METADATA_KEY = "applier.position"

_INTEGER_TYPES = frozenset({"int2", "int4", "int8"})
#: Types Spark's PostgreSQL dialect reads exactly as they are.
_NATIVE_TYPES = _INTEGER_TYPES | {"bool", "float4", "float8", "text", "varchar", "bpchar", "bytea",
                                  "uuid", "json", "jsonb"}
_ARRAY_ELEMENTS = _INTEGER_TYPES | {"bool", "float4", "float8", "text", "varchar", "bpchar"}
_TEMPORAL_TYPES = frozenset({"date", "timestamp", "timestamptz"})
#: Oldest value Java's hybrid calendar and Python's datetime both represent like PostgreSQL does.
_FIRST_GREGORIAN = {"date": "1582-10-15", "timestamp": "1582-10-15 00:00:00",
                    "timestamptz": "1582-10-16 00:00:00+00"}  # a day's margin for any time zone
_MAX_DECIMAL_DIGITS = 38


@dataclass(frozen=True)
class SlotPosition:
    """One ``applier.progress`` row: the last source transaction applied through a slot."""
    slot_name: str
    commit_lsn: str
    end_lsn: str
    commit_time: str | None  # ISO 8601, UTC
    applied_at: str | None


@dataclass(frozen=True)
class ReadPosition:
    """What a read reflects: the snapshot, this database's WAL position, the applied source."""
    snapshot: str
    wal_lsn: str
    positions: tuple[SlotPosition, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReadPosition:
        data = json.loads(text)
        return cls(data["snapshot"], data["wal_lsn"],
                   tuple(SlotPosition(**row) for row in data["positions"]))


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
        return quote_ident(self.name)

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
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.name}"

    def column(self, name: str) -> Column:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(f"{self.display} has no column {name!r}")


def quote_ident(name: str) -> str:
    """``name`` as a PostgreSQL identifier, always quoted (so case and odd characters survive)."""
    return '"' + name.replace('"', '""') + '"'


def jdbc_options(dsn: str) -> tuple[str, dict[str, str]]:
    """A libpq DSN (URL or key=value) as a pgjdbc URL and connection properties."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    if "," in host or host.startswith("/"):
        raise ValueError(f"JDBC needs one TCP host; {dsn!r} names {host!r} (a socket directory or a "
                         "host list): give host=NAME or an IP address")
    port = str(params.get("port") or 5432)
    user = str(params.get("user") or "")
    database = str(params.get("dbname") or user)
    host_part = f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in a URL
    properties = {"driver": JDBC_DRIVER, "user": user}
    # pgjdbc reads ~/.pgpass itself when no password is given, like libpq does.
    renamed = {"password": "password", "sslmode": "sslmode", "sslrootcert": "sslrootcert",
               "sslcert": "sslcert", "sslkey": "sslkey", "application_name": "ApplicationName",
               "connect_timeout": "connectTimeout", "options": "options"}
    for libpq_name, jdbc_name in renamed.items():
        if params.get(libpq_name):
            properties[jdbc_name] = str(params[libpq_name])
    return f"jdbc:postgresql://{host_part}:{port}/{database}", properties


class Snapshot:
    """An exported snapshot held open by a REPEATABLE READ, READ ONLY transaction.

    ``query`` runs in the snapshot (used for bounds, probes and the catalog); partitions import
    ``snapshot_id``. Close it (or leave the ``with`` block) only after every Spark action ran.
    """

    def __init__(self, dsn: str, conn: psycopg.Connection[Any], position: ReadPosition) -> None:
        self.dsn = dsn
        self.position = position
        self._conn = conn

    @property
    def snapshot_id(self) -> str:
        return self.position.snapshot

    @property
    def session_init_statement(self) -> str:
        # The isolation level must be in BEGIN: without it the import is refused, and the
        # SET TRANSACTION ISOLATION form is silently inconsistent with autocommit reads.
        return ("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
                f"SET TRANSACTION SNAPSHOT '{self.snapshot_id}'")

    def query(self, statement: str | sql.SQL | sql.Composed,
              params: Sequence[Any] | Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        if self._conn.closed:
            raise RuntimeError(f"snapshot {self.snapshot_id} is closed")
        return self._conn.execute(statement, params).fetchall()

    def literal(self, value: Any) -> str:
        """``value`` as an SQL literal, quoted the way this connection would."""
        return sql.Literal(value).as_string(self._conn)

    def close(self) -> None:
        if not self._conn.closed:
            self._conn.rollback()
            self._conn.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_snapshot(dsn: str, *, slot: str | None = None) -> Snapshot:
    """Export a snapshot of ``dsn`` and read, in it, the position the worker had applied.

    ``slot`` restricts the reported ``applier.progress`` rows to one slot (an error if it has
    none); by default every row is reported (normally there is one). A database without
    ``applier.progress`` (a source, say) reports no slot positions, only its WAL position.
    """
    conn = connect(dsn, application_name="applier spark snapshot")
    try:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        row = conn.execute("SELECT pg_export_snapshot(), CASE WHEN pg_is_in_recovery() "
                           "THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text").fetchone()
        assert row is not None
        snapshot_id, wal_lsn = row
        # A long Spark job must not lose its snapshot to the server's idle-in-transaction limit.
        conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
        positions: list[SlotPosition] = []
        if conn.execute("SELECT to_regclass('applier.progress')").fetchone() != (None,):
            rows = conn.execute(
                "SELECT slot_name, commit_lsn::text, end_lsn::text, "
                "to_char(commit_time AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
                "to_char(applied_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') "
                "FROM applier.progress WHERE %(slot)s::text IS NULL OR slot_name = %(slot)s "
                "ORDER BY slot_name", {"slot": slot}).fetchall()
            positions = [SlotPosition(*r) for r in rows]
        if slot is not None and not positions:
            raise LookupError(f"no applier.progress row for slot {slot!r} in {_redact(dsn)}: "
                              "has the worker applied anything through it?")
        return Snapshot(dsn, conn, ReadPosition(snapshot_id, wal_lsn, tuple(positions)))
    except BaseException:
        conn.close()
        raise


def _redact(dsn: str) -> str:
    params = conninfo_to_dict(dsn)
    return f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', '')}"


def describe_table(snap: Snapshot, table: str) -> TableInfo:
    """Columns and key (primary key, else replica identity index) of ``table`` in ``snap``."""
    found = snap.query("SELECT c.oid::int8, n.nspname, c.relname FROM pg_class c "
                       "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
                       (table,))
    if not found:
        raise LookupError(f"table {table!r} does not exist in {_redact(snap.dsn)}")
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
    return f"('applier: ' || length({column.quoted}::text)::text || ' ' || {_quote_text(hint)})::{expected_sql_type}"


def _quote_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass
class _Probe:
    """What a scan in the snapshot found about the columns whose mapping depends on data."""
    numeric: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # int digits, scale, special
    unrepresentable: set[str] = field(default_factory=set)  # temporal infinities, old dates, ndims > 1


def _probe(snap: Snapshot, info: TableInfo, columns: Sequence[Column]) -> _Probe:
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
                                           f"{_quote_text(_FIRST_GREGORIAN[col.typname])} THEN 1 ELSE 0 END)"))
        elif col.element in _ARRAY_ELEMENTS:
            parts.append((col.name + ":a", f"max(CASE WHEN array_ndims({q}) > 1 THEN 1 ELSE 0 END)"))
    if not parts:
        return _Probe()
    row = snap.query(f"SELECT {', '.join(expr for _, expr in parts)} FROM {info.qualified}")[0]
    found = dict(zip((label for label, _ in parts), row))
    probe = _Probe()
    for col in columns:
        if f"{col.name}:n" in found:
            probe.numeric[col.name] = (int(found[f"{col.name}:i"] or 0), int(found[f"{col.name}:s"] or 0),
                                       bool(found[f"{col.name}:n"]))
        elif found.get(f"{col.name}:t") or found.get(f"{col.name}:a"):
            probe.unrepresentable.add(col.name)
    return probe


def select_expression(col: Column, as_text: bool, probe: _Probe | None) -> str:
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
        floor = _quote_text(_FIRST_GREGORIAN[col.typname])
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


def _partitions(snap: Snapshot, info: TableInfo, column: Column, where: str | None,
                bounds: tuple[Any, Any] | None, count: int) -> list[str] | None:
    """WHERE predicates, one per Spark partition, covering every row exactly once.

    Integer keys split ``[lower, upper]`` into equal widths; other orderable keys split at
    quantiles computed in the snapshot (one ordered scan). The first range also takes values
    below the bounds and NULLs, the last everything above, so given bounds never lose rows.
    """
    q = column.quoted
    filter_sql = f" WHERE {where}" if where else ""
    cuts: list[str]
    if column.typname in _INTEGER_TYPES:
        if bounds is None:
            lower, upper = snap.query(f"SELECT min({q}), max({q}) FROM {info.qualified}{filter_sql}")[0]
        else:
            lower, upper = bounds
        if lower is None or upper is None or count <= 1:
            return None
        count = min(count, int(upper) - int(lower) + 1)
        span = int(upper) - int(lower) + 1
        cuts = [str(int(lower) + span * i // count) for i in range(1, count)]
    else:
        if count <= 1:
            return None
        fractions = [i / count for i in range(1, count)]
        row = snap.query(f"SELECT percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {q})::text[] "
                         f"FROM {info.qualified}{filter_sql}", (fractions,))[0][0]
        if row is None:
            return None
        cuts = [f"{snap.literal(value)}::{column.declared}" for value in dict.fromkeys(row)]
    if not cuts:
        return None
    predicates = [f"{q} < {cuts[0]} OR {q} IS NULL"]
    predicates += [f"{q} >= {lo} AND {q} < {hi}" for lo, hi in zip(cuts, cuts[1:])]
    predicates.append(f"{q} >= {cuts[-1]}")
    return predicates


def read_table(spark: SparkSession, table: str, snapshot: Snapshot, *,
               columns: Sequence[str] | None = None, where: str | None = None,
               partition_column: str | None = None, bounds: tuple[Any, Any] | None = None,
               num_partitions: int | None = None, fetchsize: int = DEFAULT_FETCHSIZE,
               text_columns: Iterable[str] | Literal["*"] = (), probe: bool = False,
               position_columns: bool = False) -> DataFrame:
    """``table`` as ``snapshot`` sees it, read in parallel key-range partitions.

    ``columns`` selects (default all, in table order); ``where`` is an SQL condition on the table
    (for example a publication's row filter). The partition column defaults to the first key
    column; ``bounds`` (lower, upper) replace the table's min/max for integer keys;
    ``num_partitions`` defaults to Spark's default parallelism. See the module docstring for
    the type mapping, ``text_columns`` and ``probe``.
    """
    if fetchsize <= 0:
        raise ValueError("fetchsize must be positive: 0 makes pgjdbc buffer whole partitions in memory")
    info = describe_table(snapshot, table)
    chosen = [info.column(name) for name in columns] if columns else list(info.columns)
    as_text = {c.name for c in chosen} if text_columns == "*" else set(text_columns)
    probed = _probe(snapshot, info, [c for c in chosen if c.name not in as_text]) if probe else None
    expressions = {c.name: select_expression(c, c.name in as_text, probed) for c in chosen}
    predicates = None
    hidden: list[str] = []
    split_name = partition_column or (info.key[0] if info.key else None)
    if split_name is not None:
        split = info.column(split_name)
        if split_name not in expressions:  # read it for the predicates, drop it afterwards
            expressions[split_name] = split.quoted
            hidden.append(split_name)
        # Predicates apply to the subquery's output, so they must compare the unconverted value.
        if expressions[split_name] == split.quoted:
            count = num_partitions or spark.sparkContext.defaultParallelism
            predicates = _partitions(snapshot, info, split, where, bounds, count)
    filter_sql = f" WHERE {where}" if where else ""
    subquery = (f"(SELECT {', '.join(f'{expr} AS {quote_ident(name)}' for name, expr in expressions.items())} "
                f"FROM {info.qualified}{filter_sql}) applier_read")

    url, properties = jdbc_options(snapshot.dsn)
    properties |= {"fetchsize": str(fetchsize), "sessionInitStatement": snapshot.session_init_statement,
                   "preferTimestampNTZ": "true"}
    if predicates:
        frame = spark.read.jdbc(url, subquery, predicates=predicates, properties=properties)
    else:
        frame = spark.read.format("jdbc").option("url", url).option("dbtable", subquery) \
            .options(**properties).load()
    return _with_position(frame, snapshot.position, position_columns, hidden)


def _with_position(frame: DataFrame, position: ReadPosition, add_columns: bool,
                   hidden: Sequence[str]) -> DataFrame:
    from pyspark.sql import functions as F

    metadata = {METADATA_KEY: position.to_json()}
    projected = [F.col(_backquote(name)).alias(name, metadata=metadata) for name in frame.columns
                 if name not in hidden]
    if add_columns:
        if len(position.positions) != 1:
            raise ValueError(f"position_columns needs exactly one applier.progress row; the snapshot "
                             f"has {len(position.positions)} (pass slot= to open_snapshot)")
        slot = position.positions[0]
        projected.append(F.lit(slot.commit_lsn).alias("_applier_commit_lsn", metadata=metadata))
        commit_time = (datetime.fromisoformat(slot.commit_time.replace("Z", "+00:00"))
                       if slot.commit_time else None)
        projected.append(F.lit(commit_time).cast("timestamp").alias("_applier_commit_time",
                                                                    metadata=metadata))
    return frame.select(*projected)


def _backquote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def read_tables(spark: SparkSession, tables: Iterable[str], snapshot: Snapshot,
                **options: Any) -> dict[str, DataFrame]:
    """Several tables from one snapshot (so mutually consistent), keyed by the given names."""
    return {table: read_table(spark, table, snapshot, **options) for table in tables}


def source_position(frame: DataFrame) -> ReadPosition | None:
    """The position a DataFrame from :func:`read_table` reflects, from its column metadata."""
    for struct_field in frame.schema.fields:
        text = struct_field.metadata.get(METADATA_KEY)
        if text:
            return ReadPosition.from_json(text)
    return None

