"""What ``--create-tables`` builds on the target for a published table: the source's definition
(``schema.TableSchema``), as PostgreSQL's catalog functions print it, limited to what the
replica receives.

Owns turning a source table's definition into the target's statements, in the order the copy
needs them:

* before the table: the sequences its columns' defaults use (serial and others), with the
  source's options (their values are set after the copy, by ``applier sequences``);
* the table: the published columns (type, collation, NOT NULL, default, identity ALWAYS or BY
  DEFAULT with its sequence's name and options), and generated columns the publication does not
  send whose inputs it does (computed on the target as on the source), with the primary key;
  then the sequences' owners and the replica identity (its index first when it is not the
  primary key);
* after the table's data: its other indexes, unique and exclusion constraints;
* after every table of the round is copied: CHECK and foreign key constraints, added NOT VALID
  and then validated (unless the source's is not validated either), so each is checked once
  against the whole data, and a foreign key finds the table it references filled.

A partitioned source table becomes a plain target table. What cannot be built because it names a
column the publication leaves out is listed (``left_out``); ``applier cutover`` lists it as a
difference. Must never run a statement or read a catalog.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quoting import ident, qualified
from .schema import Column, SequenceDefinition, TableSchema

__all__ = ["AddedConstraint", "TableDefinition", "table_definition"]


@dataclass(frozen=True)
class AddedConstraint:
    """A CHECK or foreign key constraint, added once the round's data is in."""

    name: str
    add: str                     # ALTER TABLE ... ADD CONSTRAINT ... NOT VALID
    validate: str | None         # ALTER TABLE ... VALIDATE CONSTRAINT ... (None: not on the source)
    references: str | None       # a foreign key's referenced table


@dataclass(frozen=True)
class TableDefinition:
    sequences: tuple[str, ...]                      # CREATE SEQUENCE IF NOT EXISTS, before the table
    create_table: str
    key_indexes: tuple[str, ...]                    # owners of sequences, replica identity & its index
    secondary_indexes: tuple[tuple[str, str], ...]  # (index name, statement) after the data
    constraints: tuple[AddedConstraint, ...]        # after the round's data
    left_out: tuple[str, ...]                       # what names a column the replica does not get


def _column_sql(column: Column, identity: SequenceDefinition | None, published: bool) -> str:
    part = f"{ident(column.name)} {column.type_sql}"
    if column.collation:
        part += f" COLLATE {column.collation}"
    if column.generated and not published:
        kind = "STORED" if column.generated == "s" else "VIRTUAL"
        return part + f" GENERATED ALWAYS AS ({column.expression}) {kind}"
    if column.identity:
        kind = "ALWAYS" if column.identity == "a" else "BY DEFAULT"
        options = f" (SEQUENCE NAME {identity.name} {identity.options})" if identity else ""
        part += f" GENERATED {kind} AS IDENTITY{options}"
    elif column.default is not None and not column.generated:
        part += f" DEFAULT {column.default}"
    if column.not_null:
        part += " NOT NULL"
    return part


def table_definition(source: TableSchema, published: tuple[str, ...]) -> TableDefinition:
    """The target's statements for ``source`` whose columns ``published`` the replica receives."""
    table = qualified(source.schema, source.name)
    wanted = set(published)
    # A generated column the stream does not send is computed on the target, when its inputs are
    # there; one it sends (PostgreSQL 18's publish_generated_columns) is a plain column there.
    columns = [c for c in source.columns
               if c.name in wanted or (c.generated and c.uses and set(c.uses) <= wanted)]
    built = {c.name for c in columns}
    left_out: list[str] = [f"column {ident(c.name)}" for c in source.columns if c.name not in built]
    identities = {s.owner: s for s in source.sequences if s.identity}
    sequences = [s for s in source.sequences if not s.identity
                 and (s.owner is None or s.owner in built)]
    parts = [_column_sql(c, identities.get(c.name), c.name in wanted) for c in columns]
    key_indexes: list[str] = []
    secondary: list[tuple[str, str]] = []
    constraints: list[AddedConstraint] = []
    for constraint in source.constraints.values():
        if not set(constraint.columns) <= built:
            left_out.append(f"constraint {ident(constraint.name)}")
            continue
        add = f"CONSTRAINT {ident(constraint.name)} {constraint.definition}"
        identity = f"ALTER TABLE {table} REPLICA IDENTITY USING INDEX {ident(constraint.name)}"
        if constraint.kind == "p":
            parts.append(add)
            key_indexes += [identity] if constraint.replica_identity else []
        elif constraint.replica_identity:  # the apply's key: with the table, before the data
            key_indexes += [f"ALTER TABLE {table} ADD {add}", identity]
        elif constraint.kind in ("u", "x"):
            secondary.append((constraint.name, f"ALTER TABLE {table} ADD {add}"))
        else:
            not_valid = "" if constraint.definition.endswith(" NOT VALID") else " NOT VALID"
            constraints.append(AddedConstraint(
                constraint.name, f"ALTER TABLE {table} ADD {add}{not_valid}",
                f"ALTER TABLE {table} VALIDATE CONSTRAINT {ident(constraint.name)}"
                if constraint.validated else None, constraint.references))
    for index in source.indexes.values():
        if not set(index.columns) <= built:
            left_out.append(f"index {ident(index.name)}")
        elif index.replica_identity:
            key_indexes += [index.definition,
                            f"ALTER TABLE {table} REPLICA IDENTITY USING INDEX {ident(index.name)}"]
        else:
            secondary.append((index.name, index.definition))
    key_indexes += [f"ALTER SEQUENCE {s.name} OWNED BY {table}.{ident(s.owner)}"
                    for s in sequences if s.owner is not None]
    if source.replica_identity in ("f", "n"):
        key_indexes.append(f"ALTER TABLE {table} REPLICA IDENTITY "
                           f"{'FULL' if source.replica_identity == 'f' else 'NOTHING'}")
    return TableDefinition(
        tuple(f"CREATE SEQUENCE IF NOT EXISTS {s.name} AS {s.type_sql} {s.options}"
              for s in sequences),
        f"CREATE TABLE {table} (\n    " + ",\n    ".join(parts) + "\n)",
        tuple(key_indexes), tuple(secondary), tuple(constraints), tuple(left_out))
