"""Consistent, partitioned, lossless Spark reads of replicated tables over JDBC.

Owns: reading a table over JDBC in one exported snapshot (:mod:`.snapshot` holds it open and
reads the source position the applier worker recorded in it), through a subquery whose
expressions deliver every column unchanged (:mod:`.columns` maps PostgreSQL types Spark's dialect
gets wrong), in planned key-range partitions, and attaching the position to the DataFrame. Must
never write to the database, never read with ``fetchsize=0`` (which buffers whole partitions in
the executor), and never let a value reach Spark in a form that silently changes it.

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
or ``"*"`` all, to PostgreSQL's text form; ``probe=True`` lets a scan in the snapshot choose):
see :mod:`.columns`, which gives the reason for each rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from psycopg.conninfo import conninfo_to_dict

from ..quoting import ident
from .columns import INTEGER_TYPES, Column, TableInfo, describe_table, probe_columns, select_expression
from .session import JDBC_DRIVER
from .snapshot import ReadPosition, SlotPosition, Snapshot, open_snapshot

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["ReadPosition", "SlotPosition", "Snapshot", "TableInfo", "describe_table", "jdbc_options",
           "open_snapshot", "read_table", "read_tables", "source_position", "spark_column",
           "with_position"]

#: Rows per round trip: large enough to keep the network busy, small enough that a partition
#: never holds more than this many rows of driver memory. Never 0 (0 buffers whole partitions).
DEFAULT_FETCHSIZE = 10_000
METADATA_KEY = "applier.position"


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
    if column.typname in INTEGER_TYPES:
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
    probed = probe_columns(snapshot, info, [c for c in chosen if c.name not in as_text]) if probe else None
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
    subquery = (f"(SELECT {', '.join(f'{expr} AS {ident(name)}' for name, expr in expressions.items())} "
                f"FROM {info.qualified}{filter_sql}) applier_read")

    url, properties = jdbc_options(snapshot.dsn)
    properties |= {"fetchsize": str(fetchsize), "sessionInitStatement": snapshot.session_init_statement,
                   "preferTimestampNTZ": "true"}
    if predicates:
        frame = spark.read.jdbc(url, subquery, predicates=predicates, properties=properties)
    else:
        frame = spark.read.format("jdbc").option("url", url).option("dbtable", subquery) \
            .options(**properties).load()
    return with_position(frame, snapshot.position, position_columns, hidden)


def with_position(frame: DataFrame, position: ReadPosition, add_columns: bool,
                  hidden: Sequence[str]) -> DataFrame:
    """``frame`` with the source position in every column's metadata (``source_position``), the
    ``hidden`` columns left out, and (``add_columns``) the position as two more columns."""
    from pyspark.sql import functions as F

    metadata = {METADATA_KEY: position.to_json()}
    projected = [F.col(spark_column(name)).alias(name, metadata=metadata) for name in frame.columns
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


def spark_column(name: str) -> str:
    """``name`` as a column reference in Spark's own SQL (backquoted, for names with dots or
    spaces): Spark reads it, not PostgreSQL."""
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
