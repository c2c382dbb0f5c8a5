"""Spark reads of the replica: partitioned reads, one snapshot for all partitions, the source
position, and every type Spark's PostgreSQL dialect gets wrong (local Spark, real PostgreSQL).

One SparkSession for the whole test session; one PostgreSQL version (the newest configured) to
keep the Spark suite to a minute or two.
"""

from __future__ import annotations

import os
import re
import threading
import time
from decimal import Decimal

import forked
import pytest

pyspark = pytest.importorskip("pyspark")

from applier.progress.schema import make_engine, upgrade_schema  # noqa: E402
from applier.protocol.lsn import LSN  # noqa: E402
from applier.spark import spark_session  # noqa: E402
from applier.spark.reader import open_snapshot, read_table, read_tables, source_position  # noqa: E402

SPARK_PG = max(int(v) for v in re.split(r"[,\s]+", os.environ.get("APPLIER_TEST_PG_VERSIONS", "15,18").strip()) if v)

pytestmark = [pytest.mark.server, pytest.mark.spark, pytest.mark.slow,
              pytest.mark.parametrize("pg_pair", [SPARK_PG], indirect=True, ids=[f"pg{SPARK_PG}"])]


@pytest.fixture(scope="session")
def spark():
    session = spark_session("local[2]", app_name="applier-tests")
    yield session
    session.stop()


def _record_position(db, slot: str = "s", lsn: str = "0/16B3748") -> None:
    upgrade_schema(make_engine(db.dsn))
    db.execute("INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn, commit_time) "
               "VALUES (%s, %s, %s::pg_lsn + 40, '2026-01-02 03:04:05.123456+00')", (slot, lsn, lsn))


def test_partitioned_read_equals_sql_read(spark, target_db) -> None:
    target_db.execute("""
        CREATE TABLE orders (id bigint PRIMARY KEY, customer int, total numeric(12,2), note text,
                             tags text[], placed timestamptz, day date, doc jsonb, raw bytea);
        INSERT INTO orders SELECT g, g % 97, g * 1.25, CASE WHEN g % 5 = 0 THEN NULL ELSE 'n' || g END,
               ARRAY['t' || g % 3, 'x'], '2024-01-01 00:00+00'::timestamptz + g * interval '1 minute',
               '2024-01-01'::date + g % 400, jsonb_build_object('g', g), decode(md5(g::text), 'hex')
        FROM generate_series(1, 5000) g;
        CREATE TABLE words (w text PRIMARY KEY, n int);
        INSERT INTO words SELECT md5(g::text), g FROM generate_series(1, 1000) g;
    """)
    with open_snapshot(target_db.dsn) as snap:
        frames = read_tables(spark, ["orders", "public.words"], snap, num_partitions=3)
        orders, words = frames["orders"], frames["public.words"]
        assert orders.rdd.getNumPartitions() == 3
        assert words.rdd.getNumPartitions() == 3  # text key: split at quantiles
        spark_rows = sorted(tuple(r) for r in orders.collect())
        word_rows = sorted(tuple(r) for r in words.collect())
    sql_rows = sorted(target_db.query("SELECT * FROM orders"))
    assert len(spark_rows) == 5000
    for got, want in zip(spark_rows, sql_rows):
        assert got[:4] == want[:4] and got[4] == want[4] and got[6] == want[6]
        assert got[5].timestamp() == want[5].timestamp()  # the same instant
        assert got[7] == f'{{"g": {want[0]}}}' and bytes(got[8]) == bytes(want[8])
    assert word_rows == sorted(target_db.query("SELECT w, n FROM words"))
    assert [f.dataType.simpleString() for f in orders.schema.fields] == [
        "bigint", "int", "decimal(12,2)", "string", "array<string>", "timestamp", "date", "string",
        "binary"]


def test_given_bounds_and_empty_table(spark, target_db) -> None:
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE empty (id int PRIMARY KEY);"
                      "INSERT INTO t SELECT g, 'v' FROM generate_series(-50, 150) g")
    with open_snapshot(target_db.dsn) as snap:
        # Bounds narrower than the data: the outer partitions still take every row.
        narrow = read_table(spark, "t", snap, bounds=(0, 100), num_partitions=4)
        assert narrow.rdd.getNumPartitions() == 4 and narrow.count() == 201
        assert read_table(spark, "empty", snap).count() == 0


def test_one_snapshot_for_all_partitions_under_concurrent_writes(spark, target_db) -> None:
    target_db.execute("CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL);"
                      "INSERT INTO acct SELECT g, 100 FROM generate_series(1, 40000) g")
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        # Transfers keep the total constant; inserts and deletes hit every partition's range.
        with target_db.connect(autocommit=True) as conn:
            n = 0
            while not stop.is_set():
                n += 1
                a, b = (n * 7919) % 40000 + 1, (n * 104729) % 40000 + 1
                with conn.transaction():
                    conn.execute("UPDATE acct SET balance = balance - 1 WHERE id = %s", (a,))
                    conn.execute("UPDATE acct SET balance = balance + 1 WHERE id = %s", (b,))
                conn.execute("DELETE FROM acct WHERE id = %s", ((n * 31) % 40000 + 1,))
                conn.execute("INSERT INTO acct VALUES (%s, 5) ON CONFLICT DO NOTHING", (40000 + n,))
                writes[0] += 1

    with open_snapshot(target_db.dsn) as snap:
        frame = read_table(spark, "acct", snap, num_partitions=4)
        thread = threading.Thread(target=writer)
        thread.start()
        try:
            time.sleep(0.5)  # writes are committed before any partition starts ...
            first = frame.agg({"balance": "sum", "id": "count"}).collect()[0]
            second = frame.agg({"balance": "sum", "id": "max"}).collect()[0]  # ... and during it
        finally:
            stop.set()
            thread.join()
    assert writes[0] > 20
    assert (first["sum(balance)"], first["count(id)"]) == (4_000_000, 40000)
    assert (second["sum(balance)"], second["max(id)"]) == (4_000_000, 40000)
    assert target_db.query("SELECT max(id) > 40000 FROM acct")[0][0]  # the writes did land
    # After the snapshot closed, a re-read fails loudly instead of reading another state.
    with pytest.raises(Exception, match="snapshot"):
        frame.count()


def test_source_position_metadata_and_columns(spark, target_db) -> None:
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
    _record_position(target_db)
    with open_snapshot(target_db.dsn) as snap:
        frame = read_table(spark, "t", snap, position_columns=True)
        # Progress moving on after the export is not what this read reflects.
        target_db.execute("UPDATE applier.progress SET commit_lsn = '1/0', end_lsn = '1/0'")
        rows = frame.collect()
        derived = frame.select("id").where("id > 1")
    position = source_position(derived)
    assert position is not None and position.snapshot == snap.snapshot_id
    (slot,) = position.positions
    assert (slot.slot_name, slot.commit_lsn, slot.end_lsn) == ("s", "0/16B3748", "0/16B3770")
    assert slot.commit_time == "2026-01-02T03:04:05.123456Z"
    assert {r["_applier_commit_lsn"] for r in rows} == {"0/16B3748"}
    # Several slots feeding one target: all rows by default, one when asked.
    target_db.execute("INSERT INTO applier.progress (slot_name, commit_lsn, end_lsn) VALUES ('b', '0/5', '0/6')")
    with open_snapshot(target_db.dsn) as snap:
        assert [p.slot_name for p in snap.position.positions] == ["b", "s"]
        with pytest.raises(ValueError, match="exactly one"):
            read_table(spark, "t", snap, position_columns=True)
    with open_snapshot(target_db.dsn, slot="b") as snap:
        assert read_table(spark, "t", snap, position_columns=True).first()["_applier_commit_lsn"] == "0/5"
    with pytest.raises(LookupError, match="no applier.progress row"):
        open_snapshot(target_db.dsn, slot="nope")


TRICKY = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE tricky (id int PRIMARY KEY, n numeric, n40 numeric(40,2), n10 numeric(10,2),
                     m int[], na numeric[], ts timestamp, tz timestamptz, d date, tm time, tt timetz,
                     b bit(3), mo money, e mood, iv interval, r int4range, f8 float8);
INSERT INTO tricky VALUES
 (1, 123456789012345678901234567890.123456789012345678901, 12345678901234567890123456789012345678.25,
  1.50, '{1,2,3}', '{1.123456789012345678901}', '2024-02-29 12:00:00.5', '2024-02-29 12:00+05',
  '2024-02-29', '12:34:56.789', '12:00+02', '101', 12.5, 'happy', '1 day 02:03:04', '[1,5)', 'NaN'),
 (2, 'NaN', -1.99, 2.25, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'Infinity'),
 (3, 'Infinity', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '-Infinity'),
 (4, 0.000000000000000000000000001, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, '-0');
"""


def _pg_text(db, column: str) -> dict[int, str | None]:
    return dict(db.query(f"SELECT id, {column}::text FROM tricky"))


def test_tricky_types_round_trip_as_text_or_exact(spark, target_db) -> None:
    target_db.execute(TRICKY)
    with open_snapshot(target_db.dsn) as snap:
        frame = read_table(spark, "tricky", snap)
        rows = {r["id"]: r for r in frame.collect()}
    types = {f.name: f.dataType.simpleString() for f in frame.schema.fields}
    assert types == {"id": "int", "n": "string", "n40": "string", "n10": "decimal(10,2)",
                     "m": "array<int>", "na": "string", "ts": "timestamp_ntz", "tz": "timestamp",
                     "d": "date", "tm": "string", "tt": "string", "b": "string", "mo": "string",
                     "e": "string", "iv": "string", "r": "string", "f8": "double"}
    for column in ("n", "n40", "tm", "tt", "b", "mo", "e", "iv", "r"):
        assert {i: r[column] for i, r in rows.items()} == _pg_text(target_db, column), column
    assert rows[1]["n10"] == Decimal("1.50") and rows[1]["m"] == [1, 2, 3]
    assert rows[1]["na"] == "[1.123456789012345678901]"  # JSON text: no rounding to 18 places
    assert str(rows[1]["ts"]) == "2024-02-29 12:00:00.500000"  # no time zone shift
    assert rows[1]["tz"].timestamp() == target_db.query("SELECT extract(epoch FROM tz) FROM tricky WHERE id = 1")[0][0]
    f8 = [rows[i]["f8"] for i in (1, 2, 3, 4)]
    assert f8[0] != f8[0] and f8[1:3] == [float("inf"), float("-inf")] and str(f8[3]) == "-0.0"


def test_tricky_types_probe_picks_decimals(spark, target_db) -> None:
    target_db.execute("CREATE TABLE p (id int PRIMARY KEY, small numeric, wide numeric(50,4), special numeric, "
                      "n10 numeric(10,2));"
                      "INSERT INTO p VALUES (1, 12345.678901234567890123, 123456789.1234, 1, 1.25), "
                      "(2, -0.5, NULL, 'NaN', 'NaN'), (3, 0, -1, 'Infinity', NULL)")
    with open_snapshot(target_db.dsn) as snap:
        frame = read_table(spark, "p", snap, probe=True)
        rows = {r["id"]: r for r in frame.collect()}
    types = {f.name: f.dataType.simpleString() for f in frame.schema.fields}
    assert types == {"id": "int", "small": "decimal(23,18)", "wide": "decimal(13,4)",
                     "special": "string", "n10": "string"}
    assert rows[1]["small"] == Decimal("12345.678901234567890123")
    assert rows[2]["special"] == "NaN" and rows[3]["special"] == "Infinity" and rows[2]["n10"] == "NaN"


@pytest.mark.parametrize("value, column_type, what", [
    ("'infinity'", "timestamptz", "infinity"),
    ("'-infinity'", "timestamp", "infinity"),
    ("'infinity'", "date", "infinity"),
    ("'1582-10-10'", "date", "before 1582-10-15"),  # would read ten days late
    ("'{{1,2},{3,4}}'", "int[]", "multi-dimensional"),
])
def test_unrepresentable_values_fail_loudly_or_read_as_text(spark, target_db, value, column_type, what) -> None:
    target_db.execute(f"CREATE TABLE x (id int PRIMARY KEY, v {column_type}); "
                      f"INSERT INTO x VALUES (1, NULL), (2, {value})")
    expected = target_db.query("SELECT v::text, to_json(v)::text FROM x WHERE id = 2")[0]
    with open_snapshot(target_db.dsn) as snap:
        with pytest.raises(Exception, match=f"column v holds .*{re.escape(what.split()[0])}"):
            read_table(spark, "x", snap).collect()
        probed = {r["id"]: r["v"] for r in read_table(spark, "x", snap, probe=True).collect()}
        as_text = {r["id"]: r["v"] for r in read_table(spark, "x", snap, text_columns=["v"]).collect()}
    assert probed[2] == (expected[1] if column_type == "int[]" else expected[0]) and probed[1] is None
    assert as_text == {1: None, 2: expected[0]}


def test_numeric_nan_in_constrained_column_fails_loudly(spark, target_db) -> None:
    target_db.execute("CREATE TABLE x (id int PRIMARY KEY, v numeric(10,2)); INSERT INTO x VALUES (1, 'NaN')")
    with open_snapshot(target_db.dsn) as snap, pytest.raises(Exception, match="NaN"):
        read_table(spark, "x", snap).collect()


def test_missing_table_and_bad_fetchsize(spark, target_db) -> None:
    with open_snapshot(target_db.dsn) as snap:
        with pytest.raises(LookupError, match="does not exist"):
            read_table(spark, "nope", snap)
        with pytest.raises(ValueError, match="fetchsize"):
            read_table(spark, "pg_class", snap, fetchsize=0)


def _pipeline(output, target_db, *extra: str) -> dict:
    """One ``applier pipeline`` run in this process (its Spark session is the tests' own)."""
    import contextlib
    import io
    import json

    from applier.cli import parse_settings
    from applier.spark.pipeline import run_pipeline

    settings = parse_settings(["pipeline", "--target", target_db.dsn, "--output", str(output), *extra], {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_pipeline(settings)
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


def _frame(spark, output):
    import json

    state = json.loads((output / "_applier_state.json").read_text())
    return spark.read.parquet(str(output / state["data"]))


def _result(spark, output) -> dict:
    return {r["customer_id"]: (r["rows"], r["count_total"], r["sum_total"], r["source_commit_lsn"])
            for r in _frame(spark, output).collect()}


def _expected(target_db, lsn: str) -> dict:
    return {c: (n, k, s, lsn) for c, n, k, s in
            target_db.query("SELECT customer_id, count(*), count(total), sum(total) FROM orders GROUP BY 1")}


def _index(spark, output, ids) -> dict:
    """The key index's current entries of ``ids``, as (id, group, measure)."""
    import json

    from applier.spark.keyindex import KeyIndex, lookup

    state = json.loads((output / "_applier_state.json").read_text())
    keys = spark.createDataFrame([(i,) for i in ids], "id int")
    found = lookup(spark, output, KeyIndex.from_state(state["key_index"]), keys, ("id",)).collect()
    return {r["id"]: (r["id"], r["customer_id"], r["total"]) for r in found}


FEED_ROUNDS = [
    # inserts (a new group, the NULL group), updates of the measure (to NULL too), rows moving
    # between groups, deletes, a key that changes
    ["INSERT INTO orders SELECT g, g % 20, g * 0.5 FROM generate_series(3001, 3030) g",
     "INSERT INTO orders VALUES (4001, 99, 1), (4002, NULL, 2)",
     "UPDATE orders SET total = 0 WHERE id BETWEEN 1 AND 15",
     "UPDATE orders SET total = NULL WHERE id BETWEEN 60 AND 62",
     "UPDATE orders SET customer_id = 201 WHERE id BETWEEN 16 AND 25",
     "DELETE FROM orders WHERE id BETWEEN 26 AND 40",
     "UPDATE orders SET id = id + 10000 WHERE id BETWEEN 41 AND 43"],
    # a group emptied, then one row back in it; every measure of group 8 NULL (its sum NULL),
    # a value in the all-NULL group 300 (its sum no longer NULL)
    ["DELETE FROM orders WHERE customer_id = 7",
     "UPDATE orders SET customer_id = NULL WHERE id = 50",
     "UPDATE orders SET customer_id = 7 WHERE id = 51",
     "UPDATE orders SET total = NULL WHERE customer_id = 8",
     "UPDATE orders SET total = 3.5 WHERE id = 2001",
     "INSERT INTO orders VALUES (4003, 99, 5)"],
    [],  # nothing changed
    # a key inserted, updated and deleted within the round; one updated twice; a new group; the
    # last measure of group 300 back to NULL; a whole group deleted and not back
    ["INSERT INTO orders VALUES (5001, 500, 1)", "UPDATE orders SET total = 2 WHERE id = 5001",
     "DELETE FROM orders WHERE id = 5001", "UPDATE orders SET total = 7 WHERE id = 52",
     "UPDATE orders SET total = 8, customer_id = 9 WHERE id = 52",
     "INSERT INTO orders VALUES (5002, 600, 6)", "UPDATE orders SET total = NULL WHERE id = 2001",
     "DELETE FROM orders WHERE customer_id = 11"],
    # every row changed: deltas still (no fallback to a full recompute)
    ["UPDATE orders SET total = total + 1"],
    ["TRUNCATE orders", "INSERT INTO orders SELECT g, g % 4, g FROM generate_series(1, 100) g"],
    ["UPDATE orders SET customer_id = 5 WHERE id < 10", "DELETE FROM orders WHERE id = 50"],
]


def test_pipeline_through_the_change_feed_equals_a_full_recompute_after_each_round(
        spark, source_db, target_db, tmp_path, monkeypatch) -> None:
    """The worker records orders in the change feed; each pipeline run after the first reads only
    the changes since the previous one and the key index (no table row), and its result equals a
    full recompute of the replica and a GROUP BY on it, types included, after every round."""
    from replication import create_slot, run_worker

    from applier.spark import keyindex
    from applier.spark.changes import read_changes

    # Two layers at most: a round that would add a third folds them into a new base instead.
    monkeypatch.setattr(keyindex, "MAX_LAYERS", 2)
    ddl = "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(12,2))"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE orders")
    create_slot(source_db)
    source_db.execute("INSERT INTO orders SELECT g, g % 200, CASE WHEN g % 9 = 0 THEN NULL "
                      "ELSE g * 0.5 END FROM generate_series(1, 2000) g")
    source_db.execute("INSERT INTO orders SELECT g, 300, NULL FROM generate_series(2001, 2003) g")
    run_worker(source_db, target_db, "--change-feed", "all")
    output = tmp_path / "incremental"
    first = _pipeline(output, target_db)
    assert first["mode"] == "full (no previous result with a key index)"
    assert _result(spark, output) == _expected(target_db, first["commit_lsn"])
    previous = first
    layers = []
    for n, statements in enumerate(FEED_ROUNDS):
        before = {r[0]: r for r in target_db.query("SELECT id, customer_id, total FROM orders")}
        for statement in statements:
            source_db.execute(statement)
        run_worker(source_db, target_db, "--change-feed", "all")
        after = {r[0]: r for r in target_db.query("SELECT id, customer_id, total FROM orders")}
        # net=True against a recomputation from the rows before and after: one row per key
        # with its final state, every changed key among them, and after a truncate its marker
        # and only the keys changed since.
        with open_snapshot(target_db.dsn) as snap:
            rows = read_changes(spark, "public.orders", snap, start_lsn=previous["commit_lsn"],
                                net=True).collect()
        markers = [r for r in rows if r["change_op"] == "T"]
        net = {r["id"]: r for r in rows if r["change_op"] != "T"}
        assert len(net) + len(markers) == len(rows), n  # one row per key
        truncate = any(s.startswith("TRUNCATE") for s in statements)
        assert len(markers) == int(truncate), n
        changed = {k for k in before.keys() | after.keys()
                   if (None if truncate else before.get(k)) != after.get(k)}
        assert changed <= set(net), n
        if n == 0:
            assert set(net) == changed
        for key, row in net.items():
            if row["change_op"] == "D":
                assert key not in after, n
            else:
                assert (row["id"], row["customer_id"], row["total"]) == after[key], n
        if n == 1:  # what a round that died before its commit leaves: gone after the next one
            (output / "layer-0-16B3748-1").mkdir()
        state = _pipeline(output, target_db)
        assert state["mode"] == ("full (the table was truncated)" if n == 5 else "incremental"), (n, state)
        assert _result(spark, output) == _expected(target_db, state["commit_lsn"]), n
        full = _pipeline(tmp_path / "full", target_db, "--full")
        assert full["mode"] == "full (--full)" and full["commit_lsn"] == state["commit_lsn"]
        incremental, recomputed = _frame(spark, output), _frame(spark, tmp_path / "full")
        # decimal(22,2) sums and bigint counts both ways (metadata aside: a read's position)
        assert [(f.name, f.dataType) for f in incremental.schema] == \
            [(f.name, f.dataType) for f in recomputed.schema], n
        assert sorted(map(tuple, incremental.collect()), key=repr) == \
            sorted(map(tuple, recomputed.collect()), key=repr), n
        # The key index holds every key's row as the replica has it, and no deleted key.
        assert _index(spark, output, before.keys() | after.keys()) == after, n
        layers.append(len(state["key_index"]["layers"]))
        # Only what the state names is left: the previous round's directories went after the switch.
        named = {state["data"], state["key_index"]["base"],
                 *(la["directory"] for la in state["key_index"]["layers"])}
        assert {p.name for p in output.iterdir()} == named | {"_applier_state.json"}, n
        # The counts in the state were taken by the writes themselves: they are what was written.
        assert state["groups"] == len(_expected(target_db, state["commit_lsn"])), n
        for directory, rows in [(state["key_index"]["base"], state["key_index"]["base_rows"]),
                                *((la["directory"], la["rows"]) for la in state["key_index"]["layers"])]:
            assert spark.read.parquet(str(output / directory)).count() == rows, (n, directory)
        if state["mode"] == "incremental":
            assert state["changed_keys"] == len(net), n
        previous = state
    # Rounds 1-2 add a layer each, round 3 (no change) none, round 4 would make a third: it folds
    # them into a new base; round 5 changes every row (more than the layers' share of the base:
    # a new base again), the truncate recomputes a base, and the last round adds a layer.
    assert layers == [1, 2, 2, 0, 0, 0, 1], layers
    assert _result(spark, output) == _expected(target_db, previous["commit_lsn"])


def test_pipeline_loop_until_sigterm_each_round_committed(source_db, target_db, tmp_path, spark) -> None:
    """``--every``: rounds in one process; the changes applied meanwhile show up in a later
    round, and SIGTERM ends the loop between rounds with exit code 0."""
    import json
    import signal
    import subprocess
    import sys

    from replication import REPO, create_slot, run_worker

    ddl = "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(12,2))"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE orders")
    create_slot(source_db)
    source_db.execute("INSERT INTO orders SELECT g, g % 10, g FROM generate_series(1, 500) g")
    run_worker(source_db, target_db, "--change-feed", "all")
    loop = subprocess.Popen([sys.executable, "-m", "applier", "pipeline", "--target", target_db.dsn,
                             "--output", str(tmp_path), "--every", "1s", "--master", "local[1]"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert loop.stdout is not None
        first = json.loads(loop.stdout.readline())
        assert first["mode"] == "full (no previous result with a key index)"
        source_db.execute("DELETE FROM orders WHERE customer_id = 3")
        source_db.execute("UPDATE orders SET customer_id = 4, total = NULL WHERE id < 20")
        run_worker(source_db, target_db, "--change-feed", "all")
        (applied,) = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0]
        while (state := json.loads(loop.stdout.readline()))["commit_lsn"] != applied:
            assert state["mode"] == "incremental"
        assert state["mode"] == "incremental" and state["changed_keys"] == 67
        loop.send_signal(signal.SIGTERM)
        out, err = loop.communicate(timeout=120)
    finally:
        if loop.poll() is None:
            loop.kill()
    assert loop.returncode == 0, err[-3000:]
    for line in out.splitlines():  # a round under way when the signal came still commits
        assert json.loads(line)["commit_lsn"] == applied
    committed = json.loads((tmp_path / "_applier_state.json").read_text())
    assert committed["commit_lsn"] == applied
    assert _result(spark, tmp_path) == _expected(target_db, applied)


def test_pipeline_rounds_back_to_back(spark, source_db, target_db, tmp_path) -> None:
    """``--rounds N``: N rounds in one call, a JSON line each, the first in full."""
    import contextlib
    import io
    import json

    from applier.cli import parse_settings
    from applier.spark.pipeline import run_pipeline

    target_db.execute("CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(12,2));"
                      "INSERT INTO orders SELECT g, g % 3, g FROM generate_series(1, 30) g")
    _record_position(target_db, lsn="0/10")
    settings = parse_settings(["pipeline", "--target", target_db.dsn, "--output", str(tmp_path),
                               "--rounds", "3"], {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_pipeline(settings) == 0
    states = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(states) == 3 and {s["commit_lsn"] for s in states} == {"0/10"}
    # Not recorded in a change feed: every round recomputes.
    assert states[1]["mode"].startswith("full (the change feed does not record")
    assert _result(spark, tmp_path) == _expected(target_db, "0/10")


def test_pipeline_right_after_a_sync_that_streamed_nothing(spark, source_db, target_db, tmp_path) -> None:
    """applier sync leaves the replica at the copy's position: the pipeline tags its first
    result with it, and the next run reads the changes after it."""
    import sys

    from replication import REPO, run_worker

    ddl = "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(12,2))"
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("INSERT INTO orders SELECT g, g % 10, g FROM generate_series(1, 300) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE orders")
    done = forked.run([sys.executable, "-m", "applier", "sync", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", "--publication", "pub",
                       "--change-feed", "all", "--exit-when-caught-up"],
                      cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (position,) = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0]
    first = _pipeline(tmp_path, target_db)
    assert first["commit_lsn"] == position
    assert _result(spark, tmp_path) == _expected(target_db, position)
    source_db.execute("UPDATE orders SET customer_id = 42 WHERE id <= 5")
    source_db.execute("DELETE FROM orders WHERE id > 295")
    run_worker(source_db, target_db, "--change-feed", "all")
    state = _pipeline(tmp_path, target_db)
    assert state["mode"] == "incremental" and state["changed_keys"] == 10
    assert _result(spark, tmp_path) == _expected(target_db, state["commit_lsn"])


def test_pipeline_of_a_table_the_feed_does_not_record_recomputes(spark, target_db, tmp_path) -> None:
    target_db.execute("CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(12,2));"
                      "INSERT INTO orders SELECT g, g % 3, g FROM generate_series(1, 30) g")
    _record_position(target_db, lsn="0/10")
    _pipeline(tmp_path, target_db)
    target_db.execute("DELETE FROM orders WHERE customer_id = 0")
    target_db.execute("UPDATE applier.progress SET commit_lsn = '0/20', end_lsn = '0/20'")
    assert _pipeline(tmp_path, target_db)["mode"].startswith("full (the change feed does not record")
    assert _result(spark, tmp_path) == _expected(target_db, "0/20")


def test_written_directories_are_read_once_per_session(spark, tmp_path, pg_pair) -> None:
    """A directory a pipeline wrote is listed and its schema read once; forgetting it (the round
    that removes it) makes the next read a new one. (``pg_pair``: this module's servers, unused.)"""
    from applier.spark.written import forget, read_written

    directory = tmp_path / "data-1"
    spark.range(3).write.parquet(str(directory))
    first = read_written(spark, directory)
    assert read_written(spark, directory) is first
    assert first.count() == 3
    forget(directory)
    again = read_written(spark, directory)
    assert again is not first and again.count() == 3


def test_a_directory_written_is_read_back_with_its_own_schema(spark, tmp_path, pg_pair) -> None:
    """What ``write_counted`` wrote is counted by the write and read back (with the schema it
    was written with, no inference) as Parquet would give it: same columns, types and rows.
    (``pg_pair``: this module's servers, unused.)"""
    import datetime
    import decimal

    from applier.spark.written import read_written, write_counted

    frame = spark.createDataFrame(
        [(1, "a", decimal.Decimal("1.50"), datetime.datetime(2026, 1, 2, 3, 4, 5), [1, 2], None),
         (2, None, None, None, None, 2.5)],
        "id bigint not null, name string, amount decimal(12,2), at timestamp, tags array<int>, "
        "f double")
    directory = tmp_path / "data-2"
    assert write_counted(frame, directory, coalesce=True) == 2
    kept = read_written(spark, directory)
    inferred = spark.read.parquet(str(directory))
    assert kept.schema == inferred.schema
    assert sorted(kept.collect()) == sorted(inferred.collect()) == sorted(frame.collect())
    assert write_counted(frame.where("id > 5"), tmp_path / "data-3") == 0


def test_net_changes_of_a_composite_key_with_awkward_names(spark, source_db, target_db) -> None:
    """net=True on a key of two columns, one named with a space and a quote, read in three parts
    by the key's hash: one row per changed key, its final row or a delete, none lost or twice."""
    from replication import create_slot, run_worker

    from applier.spark.changes import read_changes

    odd = '"b ""c"""'  # the column b "c"
    ddl = f'CREATE TABLE "odd keys" (a int, {odd} text, v int, PRIMARY KEY (a, {odd}))'
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute('CREATE PUBLICATION pub FOR TABLE "odd keys"')
    create_slot(source_db)
    source_db.execute('INSERT INTO "odd keys" SELECT g % 7, \'k\' || g, g FROM generate_series(1, 300) g')
    run_worker(source_db, target_db, "--change-feed", "all")
    start = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    before = {(r[0], r[1]): r for r in target_db.query('SELECT * FROM "odd keys"')}
    for statement in ['UPDATE "odd keys" SET v = v + 1000 WHERE v % 5 = 0',
                      'UPDATE "odd keys" SET v = -v WHERE v % 10 = 0',  # a second update of some keys
                      'DELETE FROM "odd keys" WHERE v % 3 = 0',
                      'INSERT INTO "odd keys" VALUES (1, \'new\', 1), (2, \'gone\', 2)',
                      f'DELETE FROM "odd keys" WHERE {odd} = \'gone\'',
                      f'UPDATE "odd keys" SET {odd} = \'moved\' WHERE v = 7']:  # a key change
        source_db.execute(statement)
    run_worker(source_db, target_db, "--change-feed", "all")
    after = {(r[0], r[1]): r for r in target_db.query('SELECT * FROM "odd keys"')}
    with open_snapshot(target_db.dsn) as snap:
        rows = read_changes(spark, 'public."odd keys"', snap, start_lsn=start, net=True,
                            num_partitions=3).collect()
    net = {(r["a"], r['b "c"']): r for r in rows}
    assert len(net) == len(rows)  # one row per key
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert set(net) == changed | {(2, "gone")}  # inserted and deleted in the range: a delete
    for key, row in net.items():
        if row["change_op"] == "D":
            assert key not in after
        else:
            assert (row["a"], row['b "c"'], row["v"]) == after[key]
    # Every change carries its transaction's end LSN: one per transaction, past its commit LSN
    # and not past the next transaction's; the last one's is the end LSN the progress row has.
    with open_snapshot(target_db.dsn) as snap:
        every = read_changes(spark, 'public."odd keys"', snap, start_lsn=start).collect()
    ends = {(int(r["change_position"]), LSN.parse(r["change_end_lsn"])) for r in every}
    assert len(ends) == len({commit for commit, _ in ends}) == 6
    ordered = sorted(ends)
    for (commit, end), (next_commit, _) in zip(ordered, ordered[1:] + [(1 << 64, 0)]):
        assert commit < end <= next_commit
    assert str(ordered[-1][1]) == target_db.query("SELECT end_lsn::text FROM applier.progress")[0][0]


# -- the change feed as a Structured Streaming source ---------------------------------------------

STREAM_DDL = ("CREATE TABLE events (id int PRIMARY KEY, v int, note text, u uuid, j jsonb, "
              "amount numeric(10,2), at timestamptz, tags text[])")


def _stream_setup(source_db, target_db, *worker_args: str) -> None:
    from replication import create_slot, run_worker

    source_db.execute(STREAM_DDL)
    target_db.execute(STREAM_DDL)
    source_db.execute("CREATE PUBLICATION pub FOR TABLE events")
    create_slot(source_db)
    source_db.execute("INSERT INTO events SELECT g, g, 'n' || g, gen_random_uuid(), "
                      "jsonb_build_object('g', g), g / 4.0, now(), ARRAY['a', g::text] "
                      "FROM generate_series(1, 200) g")
    run_worker(source_db, target_db, "--change-feed", "all", *worker_args)


def _run_stream(frame, checkpoint, batches: dict) -> None:
    """One availableNow run of ``frame`` into ``batches`` (batch id -> its rows), as a sink
    keyed by batch id: a batch Spark runs again replaces what it wrote."""
    def sink(batch, batch_id: int) -> None:
        batches[batch_id] = batch.collect()

    query = (frame.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()


def _by_change(rows) -> dict:
    keyed = {(int(r["change_position"]), r["change_seq"]): tuple(r) for r in rows}
    assert len(keyed) == len(rows), "a change twice"
    return keyed


def test_change_stream_gives_each_change_once_across_restarts_and_a_batch_run_again(
        spark, source_db, target_db, tmp_path) -> None:
    """A checkpointed streaming query of the feed delivers every change after its start exactly
    once, in the columns and types of read_changes, whatever rounds of changes and restarts come;
    a batch Spark runs again after a crash (its commit not recorded) reads the same changes even
    though more were applied since."""
    from replication import run_worker

    from applier.spark.changes import read_changes
    from applier.spark.stream import read_change_stream

    _stream_setup(source_db, target_db)
    start = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    frame = read_change_stream(spark, target_db.dsn, "public.events", num_partitions=3)  # latest
    checkpoint, batches = tmp_path / "checkpoint", {}
    _run_stream(frame, checkpoint, batches)
    assert sum(len(rows) for rows in batches.values()) == 0  # nothing after the start yet

    rounds = [["UPDATE events SET v = v + 1, j = j || '{\"x\": 1}' WHERE id % 3 = 0",
               "DELETE FROM events WHERE id % 7 = 0",
               "INSERT INTO events VALUES (1000, 1, NULL, NULL, NULL, NULL, NULL, NULL)"],
              ["UPDATE events SET id = id + 5000 WHERE id = 10", "TRUNCATE events",
               "INSERT INTO events SELECT g, g FROM generate_series(1, 50) g"]]
    for statements in rounds:
        for statement in statements:
            source_db.execute(statement)
        run_worker(source_db, target_db, "--change-feed", "all")
        _run_stream(frame, checkpoint, batches)
    last = max(batches)
    replayed = batches[last]
    assert replayed, "the last round's batch holds its changes"
    # A crash after the batch ran but before Spark recorded its commit: Spark runs it again with
    # the offsets it logged, after more changes were applied.
    for name in (str(last), f".{last}.crc"):  # the commit and Hadoop's checksum of it
        (checkpoint / "commits" / name).unlink()
    source_db.execute("UPDATE events SET note = 'after' WHERE id <= 5")
    run_worker(source_db, target_db, "--change-feed", "all")
    _run_stream(frame, checkpoint, batches)
    assert sorted(batches[last]) == sorted(replayed)
    assert max(batches) == last + 1 and len(batches[last + 1]) == 5

    streamed = [row for rows in batches.values() for row in rows]
    with open_snapshot(target_db.dsn) as snap:
        expected = read_changes(spark, "public.events", snap, start_lsn=start)
        assert [(f.name, f.dataType) for f in frame.schema.fields] == \
            [(f.name, f.dataType) for f in expected.schema.fields]
        expected_rows = expected.collect()
    assert _by_change(streamed) == _by_change(expected_rows)
    ops = {r["change_op"] for r in streamed}
    assert ops == {"I", "U", "D", "T"}
    # The key change, in its transaction's order: the old key as a delete, the new row as an
    # update, its whole row (unchanged values, uuid and jsonb as text) carried.
    new_row = next(r for r in streamed if r["id"] == 5010)
    moved = sorted((r["change_seq"], r["change_op"], r["id"]) for r in streamed
                   if r["change_position"] == new_row["change_position"])
    assert [(op, key) for _, op, key in moved] == [("D", 10), ("U", 5010)]
    assert (new_row["v"], new_row["note"], new_row["j"], new_row["tags"]) == (10, "n10", '{"g": 10}', ["a", "10"])
    assert isinstance(new_row["u"], str) and len(new_row["u"]) == 36


def test_change_stream_never_starts_or_resumes_past_lost_history(spark, source_db, target_db,
                                                                  tmp_path) -> None:
    """A start older than the retained history fails at once, naming what is retained; a
    stopped query whose next changes retention dropped fails when it resumes, and reads nothing
    partial; "earliest" starts at the retained history."""
    from datetime import UTC, datetime, timedelta

    import psycopg
    from feed_checks import change_table
    from replication import run_worker

    from applier.progress.feed_registry import FeedRegistry
    from applier.spark.changes import HistoryNotRetained
    from applier.spark.stream import read_change_stream

    # A short retention sizes partitions small (64 kB of WAL), so a few rounds make several.
    _stream_setup(source_db, target_db, "--change-feed-retention", "7s")
    with pytest.raises(HistoryNotRetained, match="does not record public.orders"):
        target_db.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        read_change_stream(spark, target_db.dsn, "public.orders")

    frame = read_change_stream(spark, target_db.dsn, "public.events", starting_lsn="earliest")
    batches: dict = {}
    _run_stream(frame, tmp_path / "checkpoint", batches)
    assert sum(len(rows) for rows in batches.values()) == 200  # the first inserts
    read_up_to = target_db.query("SELECT commit_lsn FROM applier.progress")[0][0]

    def write_and_prune(rounds: int) -> None:
        for n in range(rounds):
            source_db.execute("UPDATE events SET note = repeat(%s, 400)", (str(n),))
            run_worker(source_db, target_db, "--change-feed", "all", "--change-feed-retention", "7s")
        with psycopg.connect(target_db.dsn) as conn:  # retention, as if a day had passed
            FeedRegistry(conn).prune("s", 7, datetime.now(UTC) + timedelta(days=1))

    def retained():
        return target_db.query("SELECT retained_after FROM applier.change_tables")[0][0]

    def applied():
        return target_db.query("SELECT commit_lsn FROM applier.progress")[0][0]

    write_and_prune(4)
    assert retained() > read_up_to, "the test needs the stream's next changes dropped"
    with pytest.raises(Exception, match="are not all retained"):
        _run_stream(frame, tmp_path / "checkpoint", batches)
    assert sum(len(rows) for rows in batches.values()) == 200  # nothing partial was delivered
    with pytest.raises(HistoryNotRetained, match=f"holds those committed after {retained()}"):
        read_change_stream(spark, target_db.dsn, "public.events", starting_lsn=str(read_up_to))

    # Started at the retained history; then retention drops its start but nothing after its
    # checkpoint: it resumes from the checkpoint.
    write_and_prune(0)
    # Rounds until a partition after the retained one exists (its size follows the WAL rate, so
    # how many rounds fill one varies with the machine's load), at least four.
    for n in range(12):
        source_db.execute("UPDATE events SET note = repeat(%s, 400)", (str(n),))
        run_worker(source_db, target_db, "--change-feed", "all", "--change-feed-retention", "7s")
        if n >= 3 and target_db.query("SELECT count(*) FROM applier.change_partitions")[0][0] > 1:
            break
    first = retained()
    frame = read_change_stream(spark, target_db.dsn, "public.events", starting_lsn="earliest")
    batches = {}
    _run_stream(frame, tmp_path / "checkpoint-2", batches)
    kept = target_db.query(f"SELECT count(*) FROM {change_table('events')}")[0][0]
    assert sum(len(rows) for rows in batches.values()) == kept > 0
    checkpointed = applied()
    write_and_prune(0)
    assert first < retained() < checkpointed, "the test needs the start, not the checkpoint, dropped"
    source_db.execute("UPDATE events SET v = -v WHERE id <= 3")
    run_worker(source_db, target_db, "--change-feed", "all", "--change-feed-retention", "7s")
    _run_stream(frame, tmp_path / "checkpoint-2", batches)
    assert sorted(r["v"] for r in batches[max(batches)]) == [-3, -2, -1]


def test_an_idle_change_stream_polls_on_one_connection_and_picks_up_new_changes(
        spark, source_db, target_db, tmp_path) -> None:
    """While nothing changes, Spark asks the source for its latest offset many times a second:
    the stream asks the replica on one connection, not a new session each time; changes applied
    later still reach the running query."""
    from replication import run_worker

    from applier.spark.stream import read_change_stream

    _stream_setup(source_db, target_db)
    frame = read_change_stream(spark, target_db.dsn, "public.events")
    seen: list = []
    query = (frame.writeStream.foreachBatch(lambda batch, _: seen.extend(batch.collect()))
             .option("checkpointLocation", str(tmp_path / "checkpoint")).start())
    try:
        query.processAllAvailable()

        def sessions() -> int:
            return target_db.query("SELECT sessions FROM pg_stat_database "
                                   "WHERE datname = current_database()")[0][0]

        before = sessions()
        time.sleep(3)
        assert sessions() - before <= 2  # the two queries of sessions() itself
        source_db.execute("UPDATE events SET v = -v WHERE id <= 10")
        run_worker(source_db, target_db, "--change-feed", "all")
        query.processAllAvailable()
        assert sorted(r["v"] for r in seen) == list(range(-10, 0))
    finally:
        query.stop()


def test_a_change_stream_across_schema_changes(spark, source_db, target_db, tmp_path) -> None:
    """A running query keeps the columns it started with: a column added on the source is left
    out; a widened column whose new values no longer fit stops it with an error saying to start
    it again, and started again from its checkpoint it reads that batch with the columns as they
    are now, the added one included."""
    from replication import run_worker

    from applier.spark.stream import read_change_stream

    _stream_setup(source_db, target_db)
    checkpoint = tmp_path / "checkpoint"
    seen: list = []

    def start():
        frame = read_change_stream(spark, target_db.dsn, "public.events")
        return (frame.writeStream.foreachBatch(lambda batch, _: seen.extend(batch.collect()))
                .option("checkpointLocation", str(checkpoint)).start())

    query = start()
    try:
        query.processAllAvailable()
        source_db.execute("ALTER TABLE events ADD COLUMN extra text")
        source_db.execute("UPDATE events SET extra = 'x', v = v + 100 WHERE id <= 3")
        run_worker(source_db, target_db, "--change-feed", "all")
        query.processAllAvailable()
        assert sorted(r["v"] for r in seen) == [101, 102, 103]
        assert "extra" not in seen[0].asDict()
        source_db.execute("ALTER TABLE events ALTER COLUMN v TYPE bigint")
        source_db.execute("UPDATE events SET v = 5000000000 WHERE id = 1")
        run_worker(source_db, target_db, "--change-feed", "all")
        with pytest.raises(Exception, match="does not fit the stream's type") as failed:
            query.processAllAvailable()
        assert "start the query again" in str(failed.value)
    finally:
        query.stop()
    query = start()
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    last = seen[-1].asDict()
    assert len(seen) == 4 and (last["id"], last["v"], last["extra"]) == (1, 5000000000, "x")


def test_a_change_stream_bounded_by_wal_per_batch(spark, source_db, target_db, tmp_path) -> None:
    """max_wal_per_batch reads a backlog in many micro-batches, none spanning more source WAL
    than the bound, none empty where the table had no change for a stretch of WAL (the next
    batch starts at its next change), and every change exactly once."""
    from replication import run_worker

    from applier.spark.changes import read_changes
    from applier.spark.stream import read_change_stream

    _stream_setup(source_db, target_db)
    start = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    for n in range(30):
        source_db.execute("UPDATE events SET note = (SELECT string_agg(md5(random()::text), '') "
                          "FROM generate_series(1, 60)) WHERE id %% 30 = %s", (n,))  # 2 kB, random
    source_db.execute("CREATE TABLE unpublished (x text)")  # 2 MB of WAL without a change to events
    source_db.execute("INSERT INTO unpublished SELECT repeat('g', 1000) FROM generate_series(1, 2000)")
    for n in range(5):
        source_db.execute("UPDATE events SET v = v + 1 WHERE id %% 5 = %s", (n,))
    run_worker(source_db, target_db, "--change-feed", "all")

    bound = 64 * 1024
    frame = read_change_stream(spark, target_db.dsn, "public.events", starting_lsn=start,
                               max_wal_per_batch="64kB")
    batches: dict = {}
    _run_stream(frame, tmp_path / "checkpoint", batches)
    spans = [max(int(r["change_position"]) for r in rows) - min(int(r["change_position"]) for r in rows)
             for rows in batches.values() if rows]
    assert len(spans) == len(batches) > 5, (spans, len(batches))  # many batches, none empty
    assert max(spans) <= bound
    with open_snapshot(target_db.dsn) as snap:
        expected = read_changes(spark, "public.events", snap, start_lsn=start).collect()
    assert _by_change([r for rows in batches.values() for r in rows]) == _by_change(expected)
    with pytest.raises(ValueError, match="invalid size"):
        read_change_stream(spark, target_db.dsn, "public.events", max_wal_per_batch="lots")
