"""The oracle's schemas: tables of the shapes users have, as hypothesis draws them, and their DDL.

A table has a base key column whose values are unique by construction (an identity, a serial,
or a value the workload numbers), composite keys add columns beside it, and its replica identity
is a primary key (default or FULL), a unique index (USING INDEX), or FULL without any key. Its
other columns are of every type in ``oracle_values`` (with identity ALWAYS and BY DEFAULT,
serial, and stored generated columns), and it may be partitioned (range, list or hash, a level
nested), published through its root or its leaves. The source may carry a dropped column the
target lacks, and the target may order its columns differently: applier and PostgreSQL's
subscriber both match columns by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from oracle_values import BASE_KEY_TYPES, HOSTILE_NAMES, TYPES, UserTypes, ident, qualified

__all__ = ["MARKER", "Column", "Schema", "Table", "schemas"]

#: The table every example publishes last: a row in it tells that a consumer is caught up.
MARKER = ("public", "oracle marker")

#: Range partitions of an int/bigint base column (workload keys start at 1; changed keys are
#: base + M * n, so a key change moves a row to a later partition).
_RANGES = ("FROM (MINVALUE) TO (500)", "FROM (500) TO (131072)")


@dataclass(frozen=True)
class Column:
    name: str
    type: str                 # a key of oracle_values.TYPES
    nullable: bool = True
    #: "" | "identity always" | "identity by default" | "serial" | "stored" (generated from
    #: ``source``)
    generated: str = ""
    source: str = ""

    @property
    def writable(self) -> bool:
        """An INSERT gives it a value (identity, serial and generated columns take their own)."""
        return self.generated == ""


@dataclass(frozen=True)
class Table:
    schema: str
    name: str
    columns: tuple[Column, ...]
    #: The key's columns, the base column first (empty: FULL without a key).
    key: tuple[str, ...]
    identity: str             # "primary key" | "primary key, full" | "using index" | "full"
    partitioning: str = ""    # "" | "range" | "list" | "hash"
    nested: bool = False      # one partition is itself partitioned (by hash)
    via_root: bool = False    # published through its root (publish_via_partition_root)
    dropped_column: bool = False
    target_order: tuple[int, ...] = ()

    @property
    def qualified(self) -> str:
        return qualified(self.schema, self.name)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    @property
    def base(self) -> Column | None:
        return self.column(self.key[0]) if self.key else None

    def partition_names(self) -> list[str]:
        """Every partition (leaves and the nested level), in creation order."""
        if not self.partitioning:
            return []
        names = [_suffixed(self.name, f"_p{i}") for i in range(3)]
        if self.nested:
            names += [_suffixed(self.name, f"_p1_h{i}") for i in range(2)]
        return names

    def leaves(self) -> list[str]:
        """The tables that hold rows: itself, or its leaf partitions."""
        if not self.partitioning:
            return [self.name]
        names = self.partition_names()
        return [n for n in names if not (self.nested and n == names[1])]


@dataclass(frozen=True)
class Schema:
    types: UserTypes
    tables: tuple[Table, ...]

    def schemas(self) -> list[str]:
        return sorted({self.types.schema, MARKER[0]} | {t.schema for t in self.tables})

    def source_ddl(self) -> list[str]:
        return self._ddl(source=True)

    def target_ddl(self) -> list[str]:
        return self._ddl(source=False)

    def _ddl(self, source: bool) -> list[str]:
        statements = [f"CREATE SCHEMA IF NOT EXISTS {ident(s)}" for s in self.schemas()]
        statements += self.types.ddl()
        for table in self.tables:
            statements += table_ddl(table, self.types, source)
        statements.append(f"CREATE TABLE {qualified(*MARKER)} (n int PRIMARY KEY)")
        return statements

    def publications(self) -> list[str]:
        """Two publications: tables published through their leaves (and the marker), and
        partitioned tables published through their roots."""
        leaf = [t.qualified for t in self.tables if not t.via_root] + [qualified(*MARKER)]
        root = [t.qualified for t in self.tables if t.via_root]
        statements = [f"CREATE PUBLICATION oracle_leaf FOR TABLE {', '.join(leaf)}"]
        statements.append("CREATE PUBLICATION oracle_root"
                          + (f" FOR TABLE {', '.join(root)}" if root else "")
                          + " WITH (publish_via_partition_root = true)")
        return statements

    def leaf_tables(self) -> list[tuple[str, str]]:
        """Every table that holds rows, the marker last."""
        return [(t.schema, leaf) for t in self.tables for leaf in t.leaves()] + [MARKER]


def _suffixed(name: str, suffix: str) -> str:
    """``name`` + ``suffix`` within PostgreSQL's 63 bytes (a longer name would be truncated)."""
    room = 63 - len(suffix.encode())
    base = name.encode()[:room].decode(errors="ignore")
    return base + suffix


def _column_sql(column: Column, table: Table, types: UserTypes) -> str:
    sql_type = TYPES[column.type].ddl(types)
    if column.generated == "serial":
        sql_type = "bigserial" if column.type == "bigint" else "serial"
    text = f"{ident(column.name)} {sql_type}"
    if column.generated.startswith("identity"):
        text += f" GENERATED {column.generated.removeprefix('identity ').upper()} AS IDENTITY"
    elif column.generated == "stored":
        text += f" GENERATED ALWAYS AS ({_generation(table.column(column.source))}) STORED"
    if not column.nullable and not column.generated:
        text += " NOT NULL"
    return text


def _generation(source: Column) -> str:
    """An immutable expression of ``source``: arithmetic for integers, length of text, else
    whether it is NULL (immutable for every type)."""
    if source.type in ("int", "int domain"):
        return f"{ident(source.name)}::bigint * 2 + 1"
    if source.type == "bigint":
        return f"{ident(source.name)} % 1000003 * 2 + 1"
    if source.type in ("text", "text domain", "large text"):
        return f"length({ident(source.name)})"
    return f"{ident(source.name)} IS NULL"


def table_ddl(table: Table, types: UserTypes, source: bool) -> list[str]:
    columns = list(table.columns)
    if not source and table.target_order:
        columns = [columns[i] for i in table.target_order]
    parts = [_column_sql(c, table, types) for c in columns]
    if source and table.dropped_column:
        parts.insert(len(parts) // 2, f"{ident('dropped')} text")
    if table.identity.startswith("primary key"):
        parts.append(f"PRIMARY KEY ({', '.join(ident(k) for k in table.key)})")
    partition_by = {"range": "RANGE", "list": "LIST", "hash": "HASH"}.get(table.partitioning)
    text = f"CREATE TABLE {table.qualified} ({', '.join(parts)})"
    if partition_by:
        text += f" PARTITION BY {partition_by} ({ident(_partition_key(table))})"
    statements = [text]
    if source and table.dropped_column:
        statements.append(f"ALTER TABLE {table.qualified} DROP COLUMN {ident('dropped')}")
    statements += _partitions(table)
    for name in [table.name] + table.partition_names():
        relation = qualified(table.schema, name)
        statements += [f"ALTER TABLE {relation} ALTER COLUMN {ident(c.name)} SET STORAGE EXTERNAL"
                       for c in table.columns if TYPES[c.type].toast]
        if table.identity in ("full", "primary key, full"):
            statements.append(f"ALTER TABLE {relation} REPLICA IDENTITY FULL")
    if table.identity == "using index":
        index = _suffixed(table.name, "_ri")
        statements += [f"CREATE UNIQUE INDEX {ident(index)} ON {table.qualified} "
                       f"({', '.join(ident(k) for k in table.key)})",
                       f"ALTER TABLE {table.qualified} REPLICA IDENTITY USING INDEX {ident(index)}"]
    return statements


def _partition_key(table: Table) -> str:
    return table.key[1] if table.partitioning == "list" else table.key[0]


def _partitions(table: Table) -> list[str]:
    if not table.partitioning:
        return []
    names = [qualified(table.schema, n) for n in table.partition_names()]
    if table.partitioning == "range":
        bounds = [f"FOR VALUES {_RANGES[0]}", f"FOR VALUES {_RANGES[1]}", "DEFAULT"]
    elif table.partitioning == "list":
        bounds = ["FOR VALUES IN (0)", "FOR VALUES IN (1, 2)", "DEFAULT"]
    else:
        bounds = [f"FOR VALUES WITH (MODULUS 3, REMAINDER {i})" for i in range(3)]
    statements = []
    for i, (name, bound) in enumerate(zip(names, bounds)):
        text = f"CREATE TABLE {name} PARTITION OF {table.qualified} {bound}"
        if table.nested and i == 1:
            text += f" PARTITION BY HASH ({ident(table.key[0])})"
        statements.append(text)
    if table.nested:
        statements += [f"CREATE TABLE {names[3 + i]} PARTITION OF {names[1]} "
                       f"FOR VALUES WITH (MODULUS 2, REMAINDER {i})" for i in range(2)]
    return statements


# -- hypothesis ----------------------------------------------------------------------------------

_names = st.sampled_from(HOSTILE_NAMES)
_plain_types = sorted(t for t in TYPES if t != "json")


@st.composite
def tables(draw: st.DrawFn, schema: str, name: str, allow_json: bool, version: int) -> Table:
    identity = draw(st.sampled_from(["primary key", "primary key", "primary key, full",
                                     "using index", "full"]))
    partitioning = ""
    if identity.startswith("primary key"):
        partitioning = draw(st.sampled_from(["", "", "", "range", "list", "hash"]))
    base_generated = ""
    if identity != "full" and not partitioning:  # no identity on partitioned tables before 17
        base_generated = draw(st.sampled_from(["", "", "identity always", "identity by default",
                                               "serial"]))
    base_type = draw(st.sampled_from(("int", "bigint") if base_generated or partitioning == "range"
                                     else BASE_KEY_TYPES))
    names = draw(st.lists(_names, min_size=8, max_size=8, unique=True))
    base = Column(names[0], base_type, nullable=identity == "full", generated=base_generated)
    columns = [base]
    key = [base.name] if identity != "full" else []
    composite = partitioning == "list" or (identity != "full" and draw(st.booleans()))
    if composite:
        extra = "int" if partitioning == "list" else draw(
            st.sampled_from([t for t in _plain_types if TYPES[t].key]))
        columns.append(Column(names[1], extra, nullable=False))
        key.append(names[1])
    types = _plain_types + (["json"] if allow_json else [])
    for column_name in names[2:2 + draw(st.integers(1, 5))]:
        kind = draw(st.sampled_from(types))
        generated = ""
        if kind in ("int", "bigint") and not partitioning and draw(st.integers(0, 3)) == 0:
            generated = draw(st.sampled_from(["identity always", "identity by default", "serial"]))
            if any(c.generated.startswith("identity") for c in columns):
                generated = "serial"  # one identity column per table
        columns.append(Column(column_name, kind, nullable=draw(st.booleans()) and not generated,
                              generated=generated))
    # PostgreSQL 18 refuses to update or delete a row of a FULL identity table that has a
    # generated column it does not publish.
    if (version < 18 or "full" not in identity) and draw(st.booleans()):
        source = draw(st.sampled_from(columns))
        columns.append(Column(names[7], "bigint" if source.type in ("int", "bigint", "int domain")
                              else "int" if source.type in ("text", "text domain", "large text")
                              else "bool", generated="stored", source=source.name))
    order: tuple[int, ...] = ()
    if draw(st.integers(0, 3)) == 0:
        order = tuple(draw(st.permutations(range(len(columns)))))
    return Table(schema, name, tuple(columns), tuple(key), identity, partitioning,
                 nested=bool(partitioning) and draw(st.integers(0, 2)) == 0,
                 via_root=bool(partitioning) and draw(st.booleans()),
                 dropped_column=draw(st.integers(0, 3)) == 0, target_order=order)


@st.composite
def schemas(draw: st.DrawFn, version: int, max_tables: int = 3) -> Schema:
    """One to ``max_tables`` tables in one or two schemas ("public" or a hostile name), and the
    example's own types, that a PostgreSQL ``version`` source can publish."""
    spaces = draw(st.lists(st.sampled_from(("public",) + HOSTILE_NAMES), min_size=1, max_size=2,
                           unique=True))
    count = draw(st.integers(1, max_tables))
    placed = draw(st.lists(st.tuples(st.sampled_from(spaces), _names), min_size=count,
                           max_size=count, unique=True))
    # Types share a namespace with the tables of their schema (each table is a type too).
    taken = {name for schema, name in placed if schema == spaces[0]}
    free = [name for name in HOSTILE_NAMES if name not in taken]
    type_names = draw(st.lists(st.sampled_from(free), min_size=3, max_size=3, unique=True))
    user_types = UserTypes(spaces[0], *type_names)
    allow_json = draw(st.integers(0, 4)) == 0
    return Schema(user_types, tuple(draw(tables(schema, name, allow_json, version))
                                    for schema, name in placed))
