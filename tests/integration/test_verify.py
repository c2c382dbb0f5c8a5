"""``applier verify``: equal replicas pass; a deleted, an extra and a changed row are each found
by key, with the SQL engine (PostgreSQL 15 and 18) and the Spark engine (one version)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
from replication import create_slot, run_worker

from applier.cli import parse_settings
from applier.exit_codes import ExitCode
from applier.verify import run_verify

pytestmark = pytest.mark.server

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, name text, price numeric, tags text[], seen timestamptz);
CREATE TABLE pairs (a text, b int, v jsonb, PRIMARY KEY (a, b));
CREATE TABLE bag (x int, y text);
ALTER TABLE bag REPLICA IDENTITY FULL;
CREATE TABLE filtered (id int PRIMARY KEY, region text, secret text);
"""

DATA = """
INSERT INTO items SELECT g, 'item ' || g, g * 1.5, ARRAY['a', g::text],
                         '2024-01-01 00:00+00'::timestamptz + g * interval '1 hour'
FROM generate_series(1, 3000) g;
INSERT INTO items VALUES (3001, NULL, 'NaN', '{}', 'infinity');
INSERT INTO pairs SELECT 'k' || (g % 50), g, jsonb_build_object('g', g) FROM generate_series(1, 500) g;
INSERT INTO bag VALUES (1, 'dup'), (1, 'dup'), (2, NULL), (3, 'x');
INSERT INTO filtered SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 's' || g FROM generate_series(1, 100) g;
"""

PUBLICATIONS = ("CREATE PUBLICATION pub FOR TABLE items, pairs, bag;"
                "CREATE PUBLICATION pub_eu FOR TABLE filtered (id, region) WHERE (region = 'eu')")


def _replicate(source_db, target_db) -> None:
    """Source and target as the real worker leaves them: schema, publication, data, progress."""
    source_db.execute(SCHEMA)
    target_db.execute(SCHEMA)
    target_db.execute("ALTER TABLE filtered ALTER COLUMN secret DROP NOT NULL")
    source_db.execute(PUBLICATIONS)
    create_slot(source_db)
    source_db.execute(DATA)
    run_worker(source_db, target_db, publication="pub,pub_eu")


def _verify(source_db, target_db, *extra: str) -> tuple[int, str]:
    settings = parse_settings(["verify", "--source", source_db.dsn, "--target", target_db.dsn,
                               "--publication", "pub,pub_eu", "--settle", "0", *extra], {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run_verify(settings)
    return rc, out.getvalue()


def _tamper(target_db) -> None:
    target_db.execute("DELETE FROM items WHERE id = 1234")                    # missing
    target_db.execute("INSERT INTO items (id, name) VALUES (999999, 'ghost')")  # extra
    target_db.execute("UPDATE items SET price = price + 0.01 WHERE id = 42")   # changed
    target_db.execute("UPDATE pairs SET v = NULL WHERE a = 'k7' AND b = 7")     # changed, composite key
    target_db.execute("DELETE FROM bag WHERE ctid = (SELECT ctid FROM bag WHERE x = 1 LIMIT 1)")  # one dup gone
    target_db.execute("UPDATE filtered SET region = 'EU' WHERE id = 10")      # changed, filtered table


def _check_differences(report: dict) -> None:
    tables = {t["table"]: t for t in report["tables"]}
    assert report["equal"] is False
    items = tables["public.items"]
    assert (items["missing"], items["extra"], items["changed"]) == ([["1234"]], [["999999"]], [["42"]])
    assert (items["source_rows"], items["target_rows"]) == (3001, 3001)
    assert tables["public.pairs"]["changed"] == [["k7", "7"]]
    assert tables["public.pairs"]["missing_count"] == tables["public.pairs"]["extra_count"] == 0
    bag = tables["public.bag"]
    assert bag["missing_count"] == 1 and bag["extra_count"] == 0 and "dup" in bag["missing"][0][0]
    assert tables["public.filtered"]["changed"] == [["10"]]
    assert tables["public.filtered"]["source_rows"] == 50  # the row filter applies on the source


def test_verify_sql_equal_then_finds_each_difference(source_db, target_db) -> None:
    _replicate(source_db, target_db)
    rc, out = _verify(source_db, target_db)
    assert rc == 0, out
    assert out.rstrip().endswith("EQUAL") and "public.items" in out
    # The secret column is not published: a different value there is not a difference.
    target_db.execute("UPDATE filtered SET secret = NULL")
    rc, out = _verify(source_db, target_db, "--json")
    report = json.loads(out)
    assert rc == 0 and report["equal"] and report["target_positions"][0]["slot_name"] == "s"

    _tamper(target_db)
    rc, out = _verify(source_db, target_db, "--json")
    assert rc == ExitCode.CHECK
    _check_differences(json.loads(out))
    rc, out = _verify(source_db, target_db, "--table", "items")
    assert rc == ExitCode.CHECK
    assert "public.items: missing on target: id=1234" in out and "public.items: changed: id=42" in out
    assert "public.pairs" not in out and out.rstrip().endswith("DIFFERENT")


def test_verify_missing_objects(source_db, target_db) -> None:
    source_db.execute(SCHEMA)
    assert _verify(source_db, target_db, "--publication", "nope")[0] == ExitCode.FAILED
    source_db.execute("CREATE PUBLICATION other FOR TABLE items")
    rc, out = _verify(source_db, target_db, "--publication", "other")  # a table missing is a difference
    assert rc == ExitCode.CHECK and "public.items: missing on the target: (the table itself)" in out
    assert _verify(source_db, target_db, "--publication", "other", "--table", "bag")[0] == ExitCode.FAILED


SPARK_PG = max(int(v) for v in re.split(r"[,\s]+", os.environ.get("APPLIER_TEST_PG_VERSIONS", "15,18").strip()) if v)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("pg_pair", [SPARK_PG], indirect=True, ids=[f"pg{SPARK_PG}"])
def test_verify_spark_engine(source_db, target_db) -> None:
    pytest.importorskip("pyspark")
    _replicate(source_db, target_db)
    rc, out = _verify(source_db, target_db, "--engine", "spark", "--master", "local[2]", "--json")
    assert rc == 0, out
    _tamper(target_db)
    rc, out = _verify(source_db, target_db, "--engine", "spark", "--json")
    assert rc == ExitCode.CHECK
    report = json.loads(out)
    assert report["engine"] == "spark"
    _check_differences(report)
