"""Following the source's schema (``--schema-changes follow``): the target table made to fit.

pgoutput carries no DDL, but each Relation message describes a table's columns as of that point
in the stream (name, type OID and modifier, key flag), and a Type message names a type that is
not built in. Owns comparing a Relation with its target table and the statements that make the
target fit, along a safe list only:

* a column the target lacks is added, typed as on the source (a built-in type by OID and
  modifier; another type by the name its Type message gave, which must exist on the target), so
  that the rows the target already has read what the source's do (``source_catalog``): the
  source's missing value as its default when the source added it with one (metadata only, as on
  the source; then the source's current default, and NOT NULL), nothing when it was added
  without. Where the source's existing rows got values the stream does not carry (a volatile
  default, an identity or generated column: the source rewrote the table) or the catalog no
  longer tells (a default without a missing value), the worker stops, saying what to do, unless
  the target table is empty;
* a column whose source type now holds values the target's cannot is widened (smallint, integer,
  bigint; real, double precision; a longer varchar or text; a wider numeric; a longer char);
* a column gone from the source stays, and loses its NOT NULL when it has no default (new rows
  could not be inserted otherwise); a rename is a drop and an add.

A target table that is a partition (its table published through its leaves) is changed through
the root of its partition tree: a partition's columns are its tree's, as on the source.

Any other change of a column's type stops the worker at the first row change of the relation,
naming table, column and both types: a change seen in this session, or since the type the
source had when the worker last aligned the table (``applier.source_columns``, kept per slot in
the same target transaction, so a change made while the worker was stopped is seen too). A type
the target had different from the first it saw is the operator's choice, and kept. Each change
is made in the target transaction of the first row change that needs it (so a crash keeps both
or neither), recorded in ``applier.schema_changes`` and logged. Where a target transaction must
not take the table's ACCESS EXCLUSIVE lock for long (a transaction prepared on the target, which
would hold it until COMMIT PREPARED while later transactions wait for it; a transaction applied
as it streams), the change is committed on its own first and the source sends the transaction
again. Must never decide which transactions are applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from psycopg import sql

from ..errors import ApplyError, Cause
from ..progress.records import SchemaChange
from ..protocol.messages import FIRST_NORMAL_OID, Relation, RelationColumn, Type
from .ddl import DDL_INLINE, after_ddl, before_ddl
from .mapping import TargetColumn, TargetTable
from .source_catalog import AddedColumn
from .transaction import TargetTransaction

__all__ = ["ColumnSource", "SchemaFollower", "TypeCache"]

log = logging.getLogger(__name__)

INT2, INT4, INT8, FLOAT4, FLOAT8 = 21, 23, 20, 700, 701
NUMERIC, VARCHAR, BPCHAR, TEXT = 1700, 1043, 1042, 25
#: Chains of types, each holding every value of those before it.
_CHAINS = ((INT2, INT4, INT8), (FLOAT4, FLOAT8), (VARCHAR, TEXT), (BPCHAR, TEXT))
_VARHDRSZ = 4


class TypeCache(dict[int, tuple[str, str]]):
    """Source type OID -> (schema, name), from the Type messages of the session."""

    def learn(self, msg: Type) -> None:
        self[msg.type_oid] = (msg.namespace, msg.name)


class ColumnSource(Protocol):
    """Where a column the source added is read from (``source_catalog.SourceCatalog``)."""

    def added_column(self, relation_id: int, name: str) -> AddedColumn | None: ...


@dataclass(frozen=True)
class _Change:
    kind: str            # add_column | widen | drop_not_null
    column: str
    statements: tuple[sql.Composable, ...]
    source: RelationColumn | None
    not_null: bool = False
    has_default: bool = False

    @property
    def text(self) -> str:
        return "; ".join(statement.as_string() for statement in self.statements)


class SchemaFollower:
    def __init__(self, tx: TargetTransaction, types: TypeCache, source: ColumnSource | None = None
                 ) -> None:
        self.tx = tx
        self.types = types
        #: The source's catalog, for the rows a new column's table already has (None: they are
        #: taken to read NULL, as a column added without a default gives them).
        self.source = source

    def align(self, relation: Relation, table: TargetTable, previous: Relation | None) -> TargetTable:
        """``table`` made to fit ``relation`` (``previous``: the same relation's description
        before, in this session); the same object when nothing had to change."""
        key = (relation.namespace, relation.name)
        recorded = self.tx.store.source_types(key)
        changes = self._changes(relation, table, previous, recorded)
        seen = {c.name: (c.type_oid, c.type_modifier) for c in relation.columns}
        tx = self.tx
        if not changes:
            # Not inside a transaction prepared on the target (or applied as it streams): its
            # row lock would hold up every later one until it ends. A later one records it.
            if seen != recorded and tx.schema_changes == DDL_INLINE:
                tx.store.record_source_types(key, seen)
            return table
        subject = table.sql_name
        before_ddl(tx, subject)
        tx.store.record_source_types(key, seen)
        for change in changes:
            for statement in change.statements:
                tx.sql(statement.as_string())
            log.info("schema change on %s: %s (the source's %s.%s changed)", table.sql_name,
                     change.text, relation.namespace, relation.name)
            current = tx.current
            tx.store.record_schema_change(SchemaChange(
                table.schema, table.name, change.kind, change.text,
                current.commit_lsn if current is not None else None))
            tx.pending["schema_change"] += 1
            table = self._after(table, change)
        after_ddl(tx, subject)
        return table

    # -- what must change -----------------------------------------------------------------------
    def _changes(self, relation: Relation, table: TargetTable, previous: Relation | None,
                 recorded: dict[str, tuple[int, int]]) -> list[_Change]:
        looked_up: list[tuple[sql.Composable, bool]] = []

        def altered() -> tuple[sql.Composable, bool]:
            """The table the changes are made on, looked up once a change is needed."""
            if not looked_up:
                looked_up.append(self._altered(table))
            return looked_up[0]

        changes: list[_Change] = []
        # What the source's types were: earlier in this session, else when last recorded.
        before = dict(recorded)
        if previous is not None:
            before.update((c.name, (c.type_oid, c.type_modifier)) for c in previous.columns)
        for column in relation.columns:
            target = table.columns.get(column.name)
            if target is not None and target.generated:
                continue  # reported when mapped: a generated column cannot take values
            if target is None:
                changes.append(self._added(relation, table, column, *altered()))
                continue
            if _holds(target, column):
                continue
            widened = self._widened(target, column)
            if widened is not None:
                changes.append(_Change("widen", column.name, (sql.SQL(
                    "ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                        altered()[0], sql.Identifier(column.name), sql.SQL(widened)),), column,
                    target.not_null, target.has_default))
                continue
            # Types that differ off the safe list: a target made so on purpose keeps its type
            # (values go through its input function, as ever), unless the source's type changed
            # since the worker saw it.
            earlier = before.get(column.name)
            if earlier is not None and earlier != (column.type_oid, column.type_modifier):
                raise ApplyError(
                    f"the type of column {column.name!r} of {relation.namespace}.{relation.name} "
                    f"changed on the source to {self._source_name(relation, column)}, which the "
                    f"target's {target.type_sql} cannot hold and applier does not widen to: change "
                    f"the target column's type by hand (ALTER TABLE {table.sql_name} ALTER COLUMN "
                    "...), then restart", cause=Cause.NEEDS_OPERATOR)
        present = {c.name for c in relation.columns}
        for target in table.columns.values():
            if target.name not in present and target.not_null and not target.has_default:
                changes.append(_Change("drop_not_null", target.name, (sql.SQL(
                    "ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                        altered()[0], sql.Identifier(target.name)),), None))
        return changes

    def _altered(self, table: TargetTable) -> tuple[sql.Composable, bool]:
        """The table a change of ``table``'s columns is made on, and whether ``table`` is a
        partition: then the partitioned table at the root of its tree (as the apply session,
        whose search_path is empty, names it: schema-qualified), since a partition's columns are
        its tree's."""
        found = self.tx.sql(
            "SELECT pg_catalog.pg_partition_root(c.oid)::pg_catalog.text "
            "FROM pg_catalog.pg_class c WHERE c.oid = $1::pg_catalog.regclass AND c.relispartition",
            [table.sql_name.encode()])
        root = found.get_value(0, 0) if found.ntuples else None
        if root is None:
            return sql.Identifier(table.schema, table.name), False
        return sql.SQL(root.decode()), True

    def _added(self, relation: Relation, table: TargetTable, column: RelationColumn,
               name: sql.Composable, partition: bool) -> _Change:
        """The statements that add ``column`` to ``name`` (``table``, or the root of the
        partition tree it is a partition of) so that the target's rows read in it what the
        source's read (see the module's docstring). To a tree, only if it is not there yet: the
        next leaf of the tree to need the column finds it there, but reflected on another
        connection before the change commits, its own table does not show it."""
        new = sql.Identifier(column.name)
        type_sql = self._type_sql(relation, column)
        add = sql.SQL("ALTER TABLE {} ADD COLUMN {}{} {}").format(
            name, sql.SQL("IF NOT EXISTS " if partition else ""), new, sql.SQL(type_sql))
        source = (self.source.added_column(relation.relation_id, column.name)
                  if self.source is not None else None)
        if source is None or source.rows_read_null:
            return _Change("add_column", column.name, (add,), column)
        if source.has_missing:
            # Metadata only on the target too: the missing value as the default the column is
            # added with, then the default the source has now (for rows written from now on).
            missing = (sql.SQL(" DEFAULT {}::{}").format(sql.Literal(source.missing), sql.SQL(type_sql))
                       if source.missing is not None else sql.SQL(""))
            not_null = source.not_null and source.missing is not None
            return _Change("add_column", column.name, (
                add + missing + sql.SQL(" NOT NULL" if not_null else ""),
                self._default(name, new, source.default)), column, not_null,
                source.default is not None)
        if self._empty(name):  # no row to read anything: only the default matters
            default = (sql.SQL(" DEFAULT {}").format(sql.SQL(source.default))
                       if source.default is not None else sql.SQL(""))
            return _Change("add_column", column.name, (
                add + default + sql.SQL(" NOT NULL" if source.not_null else ""),), column,
                source.not_null, source.default is not None)
        raise ApplyError(_unknown_rows(relation, table, column.name, type_sql, source),
                         cause=Cause.NEEDS_OPERATOR)

    @staticmethod
    def _default(table: sql.Composable, column: sql.Identifier, default: str | None) -> sql.Composable:
        if default is None:
            return sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(table, column)
        return sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT {}").format(
            table, column, sql.SQL(default))

    def _empty(self, table: sql.Composable) -> bool:
        """The target table (a partition tree: all of it) holds no row (in this transaction)."""
        found = self.tx.sql(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(table).as_string())
        return found.ntuples == 0

    def _after(self, table: TargetTable, change: _Change) -> TargetTable:
        """``table`` as the target has it after ``change`` (in this transaction)."""
        columns = dict(table.columns)
        if change.kind == "drop_not_null":
            columns[change.column] = replace(columns[change.column], not_null=False)
        else:
            source = change.source
            assert source is not None
            type_oid, type_sql, has_equality = self._target_type(table, change.column)
            old = columns.get(change.column)
            columns[change.column] = TargetColumn(
                change.column, type_sql, False, has_equality, type_oid, source.type_modifier,
                change.not_null, change.has_default, old.identity_always if old else False)
        return replace(table, columns=columns)

    def _target_type(self, table: TargetTable, column: str) -> tuple[int, str, bool]:
        """(OID, format_type, has '=') of the column's type, as the target has it now (in this
        transaction)."""
        result = self.tx.sql(
            "SELECT a.atttypid::int8, pg_catalog.format_type(a.atttypid, a.atttypmod), "
            "EXISTS (SELECT 1 FROM pg_catalog.pg_operator o WHERE o.oprname = '=' "
            "AND o.oprleft = a.atttypid AND o.oprright = a.atttypid) "
            "FROM pg_catalog.pg_attribute a WHERE a.attrelid = $1::pg_catalog.regclass "
            "AND a.attname = $2 AND NOT a.attisdropped",
            [table.sql_name.encode(), column.encode()])
        values = [result.get_value(0, i) for i in range(3)]
        return int(values[0] or 0), (values[1] or b"").decode(), values[2] == b"t"

    # -- types ----------------------------------------------------------------------------------
    def _type_sql(self, relation: Relation, column: RelationColumn) -> str:
        """The source column's type as the target writes it."""
        if column.type_oid < FIRST_NORMAL_OID:
            return self._format_type(column.type_oid, column.type_modifier)
        named = self.types.get(column.type_oid)
        if named is None:
            raise ApplyError(f"column {column.name!r} of {relation.namespace}.{relation.name} has "
                             f"type OID {column.type_oid}, which no Type message named",
                             cause=Cause.PROTOCOL)
        found = self.tx.sql("SELECT pg_catalog.to_regtype($1)::oid::int8",
                            [sql.Identifier(*named).as_string().encode()]).get_value(0, 0)
        if found is None:
            raise ApplyError(f"type {named[0]}.{named[1]} of the new column {column.name!r} of "
                             f"{relation.namespace}.{relation.name} does not exist on the target: "
                             "create it there (same schema and name), then restart",
                             cause=Cause.NEEDS_OPERATOR)
        return self._format_type(int(found), column.type_modifier)

    def _format_type(self, type_oid: int, type_modifier: int) -> str:
        value = self.tx.sql("SELECT pg_catalog.format_type($1::pg_catalog.oid, $2::int4)",
                            [str(type_oid).encode(), str(type_modifier).encode()]).get_value(0, 0)
        return (value or b"").decode()

    def _source_name(self, relation: Relation, column: RelationColumn) -> str:
        if column.type_oid < FIRST_NORMAL_OID:
            return self._format_type(column.type_oid, column.type_modifier)
        named = self.types.get(column.type_oid)
        return f"{named[0]}.{named[1]}" if named else f"type OID {column.type_oid}"

    def _widened(self, target: TargetColumn, column: RelationColumn) -> str | None:
        """The type the target column is widened to, if the source's is on the safe list."""
        source_oid, source_mod = column.type_oid, column.type_modifier
        if source_oid == target.type_oid:
            if source_oid == NUMERIC:
                return self._format_type(NUMERIC, _numeric_union(target.type_modifier, source_mod))
            if source_oid in (VARCHAR, BPCHAR):
                return self._format_type(source_oid, -1 if source_mod < 0 else source_mod)
            return None
        for chain in _CHAINS:
            if source_oid in chain and target.type_oid in chain \
                    and chain.index(target.type_oid) < chain.index(source_oid):
                return self._format_type(source_oid, source_mod)
        return None


def _unknown_rows(relation: Relation, table: TargetTable, column: str, type_sql: str,
                  source: AddedColumn) -> str:
    """Why the values of the target's existing rows in a new column cannot be known, and what
    to do."""
    where = f"column {column!r} of {relation.namespace}.{relation.name}"
    if source.identity or source.generated or source.volatile_default:
        how = ("an identity column" if source.identity else "a generated column"
               if source.generated else f"with the volatile default {source.default}")
        why = (f"{where} was added on the source as {how}" if source.identity or source.generated
               else f"{where} was added on the source {how}")
        why += (", so the source rewrote the table to give each existing row its own value; "
                "that rewrite is not in the logical replication stream")
    else:
        why = (f"{where} has the default {source.default} on the source but no missing value, "
               "so its existing rows there hold either NULL (the default was set after the "
               "column was added) or a value the source stored in them when it rewrote the "
               "table; the source's catalog no longer tells which, and the stream does not "
               "carry it")
    default = f" DEFAULT {source.default}" if source.default and not source.identity else ""
    return (f"{why}. Add the column on the target as on the source, with the values the "
            f"existing rows have there (ALTER TABLE {table.sql_name} ADD COLUMN "
            f"{sql.Identifier(column).as_string()} {type_sql}{default}; then UPDATE them as the "
            "source has them), then start the worker again")


def _holds(target: TargetColumn, column: RelationColumn) -> bool:
    """The target column's type holds every value of the source column's."""
    if target.type_oid == 0:
        return True  # not known: leave it to the target's input function, as before
    source_oid, source_mod, target_mod = column.type_oid, column.type_modifier, target.type_modifier
    if source_oid == target.type_oid:
        if source_oid in (VARCHAR, BPCHAR):
            return target_mod < 0 or (0 <= source_mod <= target_mod)
        if source_oid == NUMERIC:
            return target_mod < 0 or (source_mod >= 0 and _numeric_union(target_mod, source_mod) == target_mod)
        return True
    for chain in _CHAINS:
        if source_oid in chain and target.type_oid in chain:
            return chain.index(target.type_oid) >= chain.index(source_oid)
    return False


def _numeric_union(target_mod: int, source_mod: int) -> int:
    """The numeric modifier holding the values of both (-1: unbounded)."""
    if target_mod < 0 or source_mod < 0:
        return -1
    t_prec, t_scale = (target_mod - _VARHDRSZ) >> 16, (target_mod - _VARHDRSZ) & 0xFFFF
    s_prec, s_scale = (source_mod - _VARHDRSZ) >> 16, (source_mod - _VARHDRSZ) & 0xFFFF
    scale = max(t_scale, s_scale)
    digits = max(t_prec - t_scale, s_prec - s_scale)
    return (((digits + scale) << 16) | scale) + _VARHDRSZ

