"""The fast path's batch: folding of repeated row changes, grouping into multi-row statements,
and the exact row counts every statement must affect."""

from __future__ import annotations

from applier.apply.copy import copy_binary, copy_binary_data, copy_text_pure
from applier.apply.fast.batch import Batch
from applier.apply.fast.sql import COPY_MIN_ROWS
from applier.apply.mapping import RelationMapping, TargetColumn, TargetTable, map_relation
from applier.protocol.messages import UNCHANGED_TOAST, Relation, RelationColumn, TupleData


def _mapping(identity: str = "d", relation_id: int = 1, independent: bool = False) -> RelationMapping:
    relation = Relation(None, relation_id, "public", f"t{relation_id}", identity, (
        RelationColumn(1, "id", 23, -1), RelationColumn(0, "v", 25, -1), RelationColumn(0, "big", 25, -1)))
    columns = {name: TargetColumn(name, kind, False, True)
               for name, kind in (("id", "integer"), ("v", "text"), ("big", "text"))}
    return map_relation(relation, TargetTable("public", f"t{relation_id}", columns, ("id",), False,
                                              independent))


def _row(*values: bytes | None | object) -> TupleData:
    kinds = bytes(ord("n") if v is None else ord("u") if v is UNCHANGED_TOAST else ord("t") for v in values)
    return TupleData(kinds, tuple(values))  # type: ignore[arg-type]


def test_repeated_updates_of_one_row_fold_into_the_last() -> None:
    batch, mapping = Batch(), _mapping()
    for n in range(5):
        batch.update(mapping, _row(b"1", str(n).encode(), b"x"), None)
    for key in range(2, 11):  # nine other rows: ten distinct rows in all, one multi-row statement
        batch.update(mapping, _row(str(key).encode(), b"other", b"y"), None)
    (statement,) = batch.statements()
    assert statement.expected_rows == 10
    assert statement.values[:8] == [b"1", b"4", b"x", b"1", b"2", b"other", b"y", b"2"]
    assert statement.sql.startswith('UPDATE "public"."t1" AS t SET')


def test_insert_then_updates_becomes_one_insert_of_the_final_row() -> None:
    batch, mapping = Batch(), _mapping()
    batch.insert(mapping, _row(b"1", b"a", b"x"))
    batch.update(mapping, _row(b"1", b"b", b"x"), None)
    batch.update(mapping, _row(b"1", b"c", b"z"), None)
    (statement,) = batch.statements()
    assert statement.sql.startswith('INSERT INTO "public"."t1"')
    assert "ON CONFLICT" in statement.sql
    assert statement.values == [b"1", b"c", b"z"] and statement.expected_rows == 1


def test_an_update_with_fewer_columns_does_not_replace_an_earlier_one() -> None:
    batch, mapping = Batch(), _mapping()
    batch.update(mapping, _row(b"1", b"a", b"big value"), None)
    batch.update(mapping, _row(b"1", b"b", UNCHANGED_TOAST), None)  # big unchanged: keep the first
    statements = list(batch.statements())
    assert [s.expected_rows for s in statements] == [1, 1]
    assert b"big value" in statements[0].values


def test_delete_and_key_change_end_folding() -> None:
    batch, mapping = Batch(), _mapping()
    batch.update(mapping, _row(b"1", b"a", b"x"), None)
    batch.delete(mapping, _row(b"1", None, None))
    batch.insert(mapping, _row(b"1", b"again", b"x"))
    batch.update(mapping, _row(b"9", b"moved", b"x"), _row(b"1", None, None))  # key 1 -> 9
    batch.update(mapping, _row(b"9", b"after", b"x"), None)
    kinds = [s.sql.split()[0] for s in batch.statements()]
    assert kinds == ["UPDATE", "DELETE", "INSERT", "UPDATE", "UPDATE"]


def test_runs_become_multi_row_statements_in_a_small_ladder_of_sizes() -> None:
    batch, mapping = Batch(), _mapping()
    for n in range(123):  # below COPY_MIN_ROWS
        batch.insert(mapping, _row(str(n).encode(), b"v", None))
    for n in range(12):
        batch.delete(mapping, _row(str(n).encode(), None, None))
    statements = list(batch.statements())
    sizes = [(s.sql.split()[0], s.expected_rows) for s in statements]
    assert sizes == [("INSERT", 100), ("INSERT", 10), ("INSERT", 10), ("INSERT", 1), ("INSERT", 1),
                     ("INSERT", 1), ("DELETE", 10), ("DELETE", 1), ("DELETE", 1)]
    assert sum(s.expected_rows for s in statements if s.sql.startswith("INSERT")) == 123
    assert len({s.cache_key for s in statements}) == 5  # one prepared form per (shape, size)


def test_long_insert_runs_become_one_copy_unless_a_value_is_binary() -> None:
    batch, mapping = Batch(), _mapping()
    for n in range(COPY_MIN_ROWS + 34):
        batch.insert(mapping, _row(str(n).encode(), b"tab\there", None))
    (statement,) = batch.statements()
    assert statement.sql == 'COPY "public"."t1" ("id", "v", "big") FROM STDIN'
    assert statement.expected_rows == COPY_MIN_ROWS + 34 and statement.cache_key is None
    assert statement.copy_data is not None
    assert statement.copy_data.startswith(b"0\ttab\\there\t\\N\n1\t")  # the tab escaped

    batch.clear()
    for n in range(COPY_MIN_ROWS):
        batch.insert(mapping, _row(str(n).encode(), b"v", None))
    batch.insert(mapping, TupleData(b"tbn", (b"1000", b"\x00", None)))  # a binary value
    kinds = {s.sql.split()[0] for s in batch.statements()}
    assert kinds == {"INSERT"}


def test_full_identity_changes_stand_alone_and_truncate_orders_everything() -> None:
    batch, full = Batch(), _mapping("f")
    batch.update(full, _row(b"1", b"b", b"x"), _row(b"1", b"a", b"x"))
    batch.update(full, _row(b"1", b"c", b"x"), _row(b"1", b"b", b"x"))
    batch.statement('TRUNCATE "public"."t1"')
    batch.delete(full, _row(b"1", b"c", b"x"))
    statements = list(batch.statements())
    assert [s.expected_rows for s in statements] == [1, 1, None, 1]
    assert "ctid" in statements[0].sql and statements[2].sql == 'TRUNCATE "public"."t1"'


def test_row_and_byte_counts_bound_the_batch() -> None:
    batch, mapping = Batch(), _mapping()
    batch.insert(mapping, _row(b"1", b"abc", None))
    batch.update(mapping, _row(b"1", b"abcd", UNCHANGED_TOAST), None)
    assert batch.rows == 2 and batch.bytes == (1 + 3) + (1 + 4)
    assert batch.inserts == 1  # parts are due by inserted rows and by the others apart
    batch.clear()
    assert not batch and batch.rows == 0 and batch.inserts == 0


def test_changes_of_independent_tables_are_gathered_per_table() -> None:
    # pgbench-like: each source transaction updates one table and inserts into another.
    batch = Batch()
    accounts, history = _mapping(relation_id=1, independent=True), _mapping(relation_id=2, independent=True)
    for n in range(1, 11):
        batch.update(accounts, _row(str(n).encode(), b"v", b"x"), None)
        batch.insert(history, _row(str(n).encode(), b"h", b"x"))
    statements = list(batch.statements())
    assert [(s.sql.split()[0], s.expected_rows) for s in statements] == [("UPDATE", 10), ("INSERT", 10)]
    # Within a table the order stands: a delete between two inserts of one key keeps its place.
    batch.clear()
    batch.insert(accounts, _row(b"9", b"a", b"x"))
    batch.insert(history, _row(b"1", b"h", b"x"))
    batch.delete(accounts, _row(b"9", None, None))
    batch.insert(accounts, _row(b"9", b"b", b"x"))
    assert [s.sql.split()[0] for s in batch.statements()] == ["INSERT", "DELETE", "INSERT", "INSERT"]


def test_a_dependent_table_is_a_barrier_for_gathering() -> None:
    # A table with a replica trigger (or a partition, or a TRUNCATE) sees everything before it.
    batch = Batch()
    plain, triggered = _mapping(relation_id=1, independent=True), _mapping(relation_id=2)
    batch.insert(plain, _row(b"1", b"a", b"x"))
    batch.insert(triggered, _row(b"1", b"a", b"x"))
    batch.insert(plain, _row(b"2", b"a", b"x"))
    tables = [s.sql.split()[2] for s in batch.statements()]
    assert tables == ['"public"."t1"', '"public"."t2"', '"public"."t1"']


class _Run:
    """A run as the lane's C type holds it (``_speedups.Run``)."""

    def __init__(self, columns: int, binary: bool = False) -> None:
        self.data, self.columns, self.rows, self.binary = bytearray(), columns, 0, binary
        self.feed: bytearray | None = None  # not a recorded table
        self.feed_rows = 0

    def take(self, rows: list[tuple[bytes | None, ...]]) -> None:
        """Rows as the lane writes them."""
        self.data += copy_binary(rows) if self.binary else copy_text_pure(rows)
        self.rows += len(rows)


def _lane_rows(count: int, start: int = 100) -> list[tuple[bytes | None, ...]]:
    return [(str(n).encode(), b"lane", b"x") for n in range(start, start + count)]


def test_an_open_run_takes_its_tables_inserts_as_copy_text_in_place() -> None:
    batch = Batch()
    items, other = _mapping(relation_id=1, independent=True), _mapping(relation_id=2, independent=True)
    batch.update(items, _row(b"9", b"before", b"x"), None)
    run = _Run(3)
    batch.open_run(items, run, kind="I")
    run.take(_lane_rows(COPY_MIN_ROWS - 1))
    batch.insert(other, _row(b"5", b"o", b"y"))
    batch.insert(items, _row(b"2", b"b\tc", None))  # the ordinary path joins the open run
    statements = list(batch.statements())
    assert [s.sql.split()[0] for s in statements] == ["UPDATE", "COPY", "INSERT"]
    copy = statements[1]
    assert copy.sql == 'COPY "public"."t1" ("id", "v", "big") FROM STDIN'
    assert bytes(copy.copy_data) == copy_text_pure(_lane_rows(COPY_MIN_ROWS - 1)) + b"2\tb\\tc\t\\N\n"
    assert copy.expected_rows == COPY_MIN_ROWS


def test_a_short_run_goes_as_the_ordinary_paths_multi_row_insert_in_the_pipeline() -> None:
    """A COPY costs round trips of its own: a run of a few rows is read back into values, which
    keep their format, for the INSERT the ordinary path prepares for the same rows."""
    for binary in (False, True):
        rows = [(b"1", b"tab\there", None), (b"2", b"back\\slash\nline\r", b"")]
        if binary:
            rows = [(b"\x00\x00\x00\x01", b"a", None), (b"\x00\x00\x00\x02", b"", b"\t\n")]
        batch = Batch()
        items = _mapping(relation_id=1, independent=True)
        run = _Run(3, binary)
        batch.open_run(items, run, kind="I")
        run.take(rows)
        inserts = list(batch.statements())
        assert all(s.copy_data is None and s.sql.startswith("INSERT") for s in inserts)
        assert sum(s.expected_rows or 0 for s in inserts) == 2
        assert [v for s in inserts for v in s.values] == [value for row in rows for value in row]
        assert [f for s in inserts for f in s.formats] == [int(binary)] * 6
        ordinary = Batch()
        for row in rows:
            ordinary.insert(items, TupleData((b"b" if binary else b"t") * 3, row))
        assert [(s.sql, s.cache_key) for s in inserts] == [(s.sql, s.cache_key) for s in ordinary.statements()]


def test_a_binary_run_is_sent_as_copy_binary_with_header_and_trailer() -> None:
    batch = Batch()
    items = _mapping(relation_id=1, independent=True)
    run = _Run(3, binary=True)
    batch.open_run(items, run, kind="I")
    lane = [(n.to_bytes(4, "big"), b"a", None) for n in range(COPY_MIN_ROWS - 1)]
    run.take(lane)
    batch.insert(items, TupleData(b"bbb", (b"\x00\x00\x00\x02", b"b", b"c")))  # joins the run
    batch.insert(items, _row(b"3", b"c", b"d"))  # text: closes the binary run
    copy, insert = batch.statements()
    assert copy.sql == 'COPY "public"."t1" ("id", "v", "big") FROM STDIN (FORMAT binary)'
    assert bytes(copy.copy_data) == copy_binary_data(copy_binary(
        [*lane, (b"\x00\x00\x00\x02", b"b", b"c")]))
    assert copy.expected_rows == COPY_MIN_ROWS and insert.sql.startswith("INSERT")


def test_a_long_run_of_binary_inserts_goes_as_copy_binary_and_mixed_formats_as_inserts() -> None:
    batch, mapping = Batch(), _mapping()
    rows = [TupleData(b"bbn", (n.to_bytes(4, "big"), b"v", None)) for n in range(COPY_MIN_ROWS)]
    for row in rows:
        batch.insert(mapping, row)
    (copy,) = batch.statements()
    assert copy.sql.endswith("(FORMAT binary)")
    assert bytes(copy.copy_data) == copy_binary_data(copy_binary([row.values for row in rows]))
    batch.clear()
    for row in rows[:-1]:
        batch.insert(mapping, row)
    batch.insert(mapping, TupleData(b"btn", (b"\x00\x00\x00\x00", b"v", None)))  # mixed
    assert all(s.sql.startswith("INSERT") for s in batch.statements())


def test_another_change_of_the_table_closes_its_run_and_a_barrier_closes_every_run() -> None:
    batch = Batch()
    items, other = _mapping(relation_id=1, independent=True), _mapping(relation_id=2, independent=True)
    triggered = _mapping(relation_id=3)
    batch.open_run(items, _Run(3), kind="I")
    batch.open_run(other, _Run(3), kind="I")
    for n in range(COPY_MIN_ROWS):
        batch.insert(items, _row(str(n).encode(), b"a", b"x"))
    batch.delete(items, _row(b"1", None, None))  # must follow those inserts: the run closes
    assert set(batch.runs) == {2}
    batch.insert(items, _row(b"1", b"b", b"x"))  # after the delete, as an ordinary insert
    batch.insert(triggered, _row(b"7", b"t", b"z"))
    assert batch.runs == {}
    kinds = [s.sql.split()[0] for s in batch.statements()]
    # items: COPY (the run), DELETE, INSERT; other's run is empty and sends nothing; then the barrier.
    assert kinds == ["COPY", "DELETE", "INSERT", "INSERT"]


def test_a_table_starting_with_a_copy_goes_before_the_other_gathered_tables() -> None:
    """A COPY leaves the pipeline, waiting for every statement before it: it goes first, so the
    pipelined statements after it are not waited for."""
    batch = Batch()
    accounts, history = _mapping(relation_id=1, independent=True), _mapping(relation_id=2, independent=True)
    batch.update(accounts, _row(b"1", b"a", b"x"), None)
    run = _Run(3)
    batch.open_run(history, run, kind="I")
    run.take(_lane_rows(COPY_MIN_ROWS))
    batch.update(accounts, _row(b"2", b"b", b"x"), None)
    assert [s.sql.split()[0] for s in batch.statements()] == ["COPY", "UPDATE", "UPDATE"]
