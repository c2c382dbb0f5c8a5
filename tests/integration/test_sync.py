"""applier sync: a consistent copy of every published table, then streaming with no gap and no
overlap (PostgreSQL 15 and 18)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import forked
import pytest
from replication import REPO, assert_same_rows, run_worker, wait_for

from applier.protocol import LSN

pytestmark = pytest.mark.server


def sync_command(source_db, target_db, *extra: str, slot: str = "s", publication: str = "pub") -> list[str]:
    return [sys.executable, "-m", "applier", "sync", "--source", source_db.dsn, "--target",
            target_db.dsn, "--slot", slot, "--publication", publication, "--log-level", "INFO",
            "--progress-interval", "1", *extra]


def run_sync(source_db, target_db, *extra: str, expect_rc: int | None = 0, publication: str = "pub",
             timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = forked.run(sync_command(source_db, target_db, "--exit-when-caught-up", *extra,
                                   publication=publication),
                      capture_output=True, text=True, timeout=timeout, cwd=REPO,
                      env={**os.environ, **(env or {})})
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def sync_states(target_db, slot: str = "s") -> dict[str, tuple[str, str | None]]:
    return {f"{schema}.{name}": (state, lsn) for schema, name, state, lsn in target_db.query(
        "SELECT schema_name, table_name, state, sync_lsn::text FROM applier.table_sync "
        "WHERE slot_name = %s", (slot,))}


def test_concurrent_pgbench_workload_during_copy(pg_pair, source_db, target_db) -> None:
    """pgbench (TPC-B-like) writes throughout the copy; after catch-up the target equals the source."""
    pgbench = str(pg_pair.source.pgbench_path)
    subprocess.run([pgbench, "-i", "-s", "1", "-q", source_db.dsn], check=True, capture_output=True)
    subprocess.run([pgbench, "-i", "-I", "dtp", "-q", target_db.dsn], check=True, capture_output=True)
    source_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    # Rate-limited so the 2-core test machine keeps up; the copy still runs under a steady stream.
    workload = subprocess.Popen([pgbench, "-n", "-c", "2", "-R", "200", "-T", "600", source_db.dsn],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: source_db.query("SELECT count(*) FROM pgbench_history")[0][0] > 50,
                 what="the workload to start")
        # 64kB ranges cut pgbench_accounts (~13 MB) into ~200 pieces copied by 3 sessions.
        proc = run_sync(source_db, target_db, "--jobs", "3", "--range-size", "64kB")
        copied_during = source_db.query("SELECT count(*) FROM pgbench_history")[0][0]
    finally:
        # SIGTERM, not SIGINT: a suite started in the background by a shell without job control
        # inherits SIGINT ignored, and PostgreSQL 15's pgbench keeps it so (it then ran its 600 s).
        workload.terminate()
        workload.wait(timeout=60)
    assert "piece(s)" in proc.stderr and "binary COPY" in proc.stderr
    assert "copied \"public\".\"pgbench_accounts\": 100000 rows" in proc.stderr
    assert copied_during > 50
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "pgbench_accounts", "pgbench_branches",
                     "pgbench_tellers", "pgbench_history")
    assert {state for state, _ in sync_states(target_db).values()} == {"done"}


SMALL_TABLES = 25


@pytest.mark.parametrize("relay", ["C", "Python"])
def test_large_table_in_ranges_many_small_tables_and_types(source_db, target_db, relay: str) -> None:
    if relay == "C":
        pytest.importorskip("applier.sync._relay", reason="the C relay is not built")
    schema = ["CREATE TYPE mood AS ENUM ('sad', 'happy')",
              "CREATE TABLE big (id bigint PRIMARY KEY, payload text, n numeric)",
              "CREATE TABLE typed (id int PRIMARY KEY, m mood, arr int[], j jsonb, ts timestamptz, "
              "iv interval, f float8, b bytea)",
              # No rows: a binary COPY still sends its header and trailer, a text COPY nothing.
              "CREATE TABLE empty_binary (id int PRIMARY KEY)",
              "CREATE TABLE empty_text (id int PRIMARY KEY, m mood)"]
    schema += [f'CREATE TABLE "Small {i}" (id int PRIMARY KEY, v text)' for i in range(SMALL_TABLES)]
    for statement in schema:
        source_db.execute(statement)
        target_db.execute(statement)
    source_db.execute("INSERT INTO big SELECT g, repeat(md5(g::text), 3), g / 7.0 "
                      "FROM generate_series(1, 30000) g")
    source_db.execute("INSERT INTO typed VALUES (1, 'happy', '{1,NULL}', '{\"a\": [1]}', "
                      "'2024-02-29 12:34:56.789+05:30', '1 year 2 mons 04:05:06.789', "
                      "1.0000000000000002, '\\x00ff'), (2, NULL, NULL, NULL, 'infinity', NULL, "
                      "'NaN', NULL)")
    # A row larger than a relay block (the C relay's 256 kB, the Python relay's 64 kB).
    source_db.execute("INSERT INTO typed (id, b) VALUES (3, convert_to(repeat('0123456789', 40000), 'UTF8'))")
    for i in range(SMALL_TABLES):
        source_db.execute(f'INSERT INTO "Small {i}" SELECT g, %s FROM generate_series(1, {i + 1}) g',
                          (f"t{i}",))
    source_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    proc = run_sync(source_db, target_db, "--jobs", "3", "--range-size", "128kB",
                    env={"APPLIER_PURE_PYTHON": "1" if relay == "Python" else "0"})
    assert f"relaying in {relay}" in proc.stderr
    pieces = int(proc.stderr.split(" piece(s)")[0].rsplit(" ", 1)[1])
    assert pieces > SMALL_TABLES + 4 + 5, "big must have been cut into several block ranges"
    assert "copied \"public\".\"typed\"" in proc.stderr and "(text COPY)" in proc.stderr
    assert "copied \"public\".\"big\"" in proc.stderr
    tables = ["big", "typed", "empty_binary", "empty_text"] + [f'"Small {i}"' for i in range(SMALL_TABLES)]
    assert_same_rows(source_db, target_db, *tables)
    # The stream continues exactly where the copy ended.
    source_db.execute("UPDATE big SET payload = 'changed' WHERE id % 1000 = 0")
    source_db.execute("DELETE FROM big WHERE id > 29990")
    source_db.execute('INSERT INTO "Small 3" VALUES (100, \'new\')')
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *tables)


def index_catalog(db, tables: tuple[str, ...]) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """(indexes with their flags and OIDs, constraints, columns' NOT NULL and replica identity)."""
    names = list(tables)
    indexes = db.query("SELECT c.relname, pg_get_indexdef(x.indexrelid), x.indisreplident, "
                       "x.indisclustered, x.indexrelid FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid "
                       "WHERE c.relname = ANY(%s) ORDER BY 1, 2", (names,))
    constraints = db.query("SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM "
                           "pg_constraint WHERE conrelid = ANY(%s::regclass[]) ORDER BY 1, 2", (names,))
    columns = db.query("SELECT c.relname, c.relreplident, a.attname, a.attnotnull FROM pg_attribute a "
                       "JOIN pg_class c ON c.oid = a.attrelid WHERE c.relname = ANY(%s) AND a.attnum > 0 "
                       "ORDER BY 1, 3", (names,))
    return indexes, constraints, columns


def test_indexes_built_after_the_data_come_back_as_they_were(source_db, target_db) -> None:
    """A table copied whole has its indexes dropped and built again around the COPY, in its
    transaction; they return exactly as defined. A table a foreign key references keeps them."""
    ddl = """
        CREATE TABLE accounts (id int PRIMARY KEY, code text NOT NULL, email text, v int,
                               CONSTRAINT accounts_v UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
        CREATE UNIQUE INDEX accounts_code ON accounts (code);
        ALTER TABLE accounts REPLICA IDENTITY USING INDEX accounts_code;
        ALTER TABLE accounts CLUSTER ON accounts_pkey;
        CREATE UNIQUE INDEX accounts_email ON accounts (lower(email)) WHERE email IS NOT NULL;
        CREATE INDEX "Accounts by v" ON accounts (v DESC) WITH (fillfactor = 70);
        CREATE TABLE referenced (id int PRIMARY KEY, v text);
        CREATE TABLE referencing (id int PRIMARY KEY, ref int REFERENCES referenced);
    """
    source_db.execute(ddl)
    target_db.execute(ddl)
    source_db.execute("INSERT INTO accounts SELECT g, 'c' || g, CASE WHEN g % 3 = 0 THEN 'e' || g END, "
                      "g FROM generate_series(1, 5000) g")
    source_db.execute("INSERT INTO referenced SELECT g, 'r' FROM generate_series(1, 100) g")
    source_db.execute("INSERT INTO referencing SELECT g, g FROM generate_series(1, 100) g")
    source_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    tables = ("accounts", "referenced", "referencing")
    indexes, constraints, columns = index_catalog(target_db, tables)
    run_sync(source_db, target_db)
    indexes_after, constraints_after, columns_after = index_catalog(target_db, tables)
    assert [row[:4] for row in indexes_after] == [row[:4] for row in indexes]
    assert (constraints_after, columns_after) == (constraints, columns)
    oids = {row[1]: row[4] for row in indexes}
    rebuilt = {row[0] for row in indexes_after if oids[row[1]] != row[4]}
    assert rebuilt == {"accounts", "referencing"}, "referenced must have kept its indexes"
    assert_same_rows(source_db, target_db, *tables)
    # The stream goes on through the rebuilt replica identity index.
    source_db.execute("UPDATE accounts SET email = 'changed' || id WHERE id <= 10")
    source_db.execute("DELETE FROM accounts WHERE id > 4990")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *tables)


def test_column_list_and_row_filter(source_db, target_db) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text, secret text, flag boolean)")
    target_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text, flag boolean, "
                      "local text DEFAULT 'target-only')")
    source_db.execute("INSERT INTO t SELECT g, 'a' || g, 's' || g, g % 3 = 0 FROM generate_series(1, 300) g")
    # Two publications: the filters are OR'ed, as the stream does.
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t (id, a, flag) WHERE (id % 2 = 0)")
    source_db.execute("CREATE PUBLICATION pub2 FOR TABLE t (id, a, flag) WHERE (flag)")
    run_sync(source_db, target_db, publication="pub,pub2")
    expected = source_db.query("SELECT id, a, flag FROM t WHERE id % 2 = 0 OR flag ORDER BY id")
    assert target_db.query("SELECT id, a, flag FROM t ORDER BY id") == expected
    assert target_db.query("SELECT DISTINCT local FROM t") == [("target-only",)]
    source_db.execute("INSERT INTO t VALUES (1000, 'x', 's', false), (1002, 'y', 's', false)")
    run_worker(source_db, target_db, publication="pub,pub2")
    expected = source_db.query("SELECT id, a, flag FROM t WHERE id % 2 = 0 OR flag ORDER BY id")
    assert target_db.query("SELECT id, a, flag FROM t ORDER BY id") == expected


def test_partitioned_tables(source_db, target_db) -> None:
    partitioned = """
        CREATE TABLE {name} (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
        CREATE TABLE {name}_eu PARTITION OF {name} FOR VALUES IN ('eu');
        CREATE TABLE {name}_us PARTITION OF {name} FOR VALUES IN ('us');
    """
    for db in (source_db, target_db):
        db.execute(partitioned.format(name="via_root"))
        db.execute(partitioned.format(name="leaves"))
    for name in ("via_root", "leaves"):
        source_db.execute(f"INSERT INTO {name} SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g "
                          "FROM generate_series(1, 500) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE via_root WITH (publish_via_partition_root = true)")
    source_db.execute("CREATE PUBLICATION pub2 FOR TABLE leaves")
    run_sync(source_db, target_db, publication="pub,pub2")
    assert set(sync_states(target_db)) == {"public.via_root", "public.leaves_eu", "public.leaves_us"}
    assert_same_rows(source_db, target_db, "via_root", "leaves", "via_root_eu", "leaves_us")
    source_db.execute("UPDATE via_root SET v = -v WHERE id <= 20")
    source_db.execute("UPDATE leaves SET region = 'eu' WHERE id = 1")  # moves a row between leaves
    run_worker(source_db, target_db, publication="pub,pub2")
    assert_same_rows(source_db, target_db, "via_root", "leaves", "leaves_eu", "leaves_us")


def test_killed_during_copy_resumes_without_recopying(source_db, target_db) -> None:
    names = [f"t{i:02}" for i in range(8)]
    for db in (source_db, target_db):
        for i, name in enumerate(names):
            db.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
    for i, name in enumerate(names):
        # t07 is the smallest, so with one job it is copied last.
        source_db.execute(f"INSERT INTO {name} SELECT g, 'v' FROM generate_series(1, {2000 - 200 * i}) g")
    source_db.execute("ANALYZE")
    source_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    # A trigger that fires even in replica role waits for an advisory lock the test holds: the COPY
    # into t07 blocks, and the process is killed with t00..t06 done and t07 mid-copy.
    target_db.execute("""
        CREATE FUNCTION wait_for_test() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NEW; END $$;
        CREATE TRIGGER gate BEFORE INSERT ON t07 FOR EACH ROW EXECUTE FUNCTION wait_for_test();
        ALTER TABLE t07 ENABLE ALWAYS TRIGGER gate""")
    gate = target_db.connect()
    gate.execute("SELECT pg_advisory_lock(4242)")
    proc = forked.Popen(sync_command(source_db, target_db, "--jobs", "1"), cwd=REPO,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _table_sync_exists(target_db) and len(
            [s for s, _ in sync_states(target_db).values() if s == "done"]) == 7,
                 timeout=120, what="seven tables copied")
        assert sync_states(target_db)["public.t07"][0] == "copying"
        during = _status(source_db, target_db)
        assert "public.t07: in the copy under way (begun " in during, during
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        gate.close()
    target_db.execute("DROP TRIGGER gate ON t07")
    # No process runs: status must not say the table is being copied.
    wait_for(lambda: json.loads(_status(source_db, target_db, "--json"))["running"] is None,
             what="the killed sync's target sessions to end")
    after = _status(source_db, target_db)
    assert "copying" not in after and "in the copy under way" not in after, after
    assert "public.t07: not copied: the copy that began " in after, after
    assert "stopped unfinished, and no sync runs; run applier sync to finish it" in after
    first = sync_states(target_db)
    # Rows keep the xmin of the transaction that copied them: a recopy would change it.
    xmin_sql = "SELECT DISTINCT xmin::text FROM {} WHERE id > 10"
    xmins = {name: target_db.query(xmin_sql.format(name)) for name in names[:7]}
    # Changes while nothing runs: to finished tables (the stream must apply them) and to the
    # unfinished one (the new copy holds them; the stream must not apply them again).
    source_db.execute("UPDATE t00 SET v = 'after kill' WHERE id <= 10")
    source_db.execute("DELETE FROM t03 WHERE id > 100")
    source_db.execute("UPDATE t07 SET v = v || '+1' WHERE id <= 50")
    source_db.execute("INSERT INTO t07 VALUES (5000, 'new')")
    source_db.execute("DELETE FROM t07 WHERE id BETWEEN 60 AND 70")
    # An apply worker must refuse to stream onto a half-copied table, having created nothing.
    origins = "SELECT count(*) FROM pg_replication_origin"
    assert target_db.query(origins) == [(0,)]
    refused = run_worker(source_db, target_db, expect_rc=1)
    assert "initial copy for slot 's' is unfinished" in refused.stderr and "public.t07" in refused.stderr
    assert target_db.query(origins) == [(0,)], "a refused start left a replication origin"
    proc2 = run_sync(source_db, target_db, "--jobs", "2")
    assert "temporary slot" in proc2.stderr
    second = sync_states(target_db)
    for name in names[:7]:
        assert second[f"public.{name}"] == first[f"public.{name}"]
        assert target_db.query(xmin_sql.format(name)) == xmins[name], f"{name} was copied again"
    assert second["public.t07"][0] == "done"
    assert LSN.parse(second["public.t07"][1]) > LSN.parse(first["public.t00"][1])
    source_db.execute("UPDATE t07 SET v = v || '+2' WHERE id <= 5")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, *names)


def _status(source_db, target_db, *extra: str) -> str:
    done = forked.run([sys.executable, "-m", "applier", "status", "--source", source_db.dsn,
                       "--target", target_db.dsn, "--slot", "s", *extra], capture_output=True,
                      text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _table_sync_exists(target_db) -> bool:
    return bool(target_db.query("SELECT to_regclass('applier.table_sync') IS NOT NULL")[0][0])


def _applier_schema_exists(target_db) -> bool:
    return bool(target_db.query("SELECT count(*) FROM pg_namespace WHERE nspname = 'applier'")[0][0])


def test_create_tables_on_empty_target_and_target_checks(source_db, target_db) -> None:
    source_db.execute("""
        CREATE SCHEMA "App";
        CREATE TABLE "App"."Orders" (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            customer text NOT NULL,
            amount numeric(12, 2) NOT NULL DEFAULT 0,
            status text DEFAULT 'new',
            created timestamptz NOT NULL DEFAULT now(),
            serial_no serial
        );
        CREATE INDEX orders_customer ON "App"."Orders" (customer);
        CREATE TABLE keyed (a int NOT NULL, b text NOT NULL, v text);
        CREATE UNIQUE INDEX keyed_ab ON keyed (a, b);
        ALTER TABLE keyed REPLICA IDENTITY USING INDEX keyed_ab;
        INSERT INTO "App"."Orders" (customer, amount) SELECT 'c' || g % 10, g FROM generate_series(1, 200) g;
        INSERT INTO keyed SELECT g, 'k' || g, 'v' FROM generate_series(1, 50) g;
        CREATE PUBLICATION pub FOR ALL TABLES;
    """)
    missing = run_sync(source_db, target_db, expect_rc=1)
    assert 'target table "App"."Orders" does not exist' in missing.stderr
    assert 'target table "public"."keyed" does not exist' in missing.stderr
    assert not _applier_schema_exists(target_db)  # refused before anything was created

    run_sync(source_db, target_db, "--create-tables")
    assert_same_rows(source_db, target_db, '"App"."Orders"', "keyed")
    columns = dict(target_db.query(
        "SELECT attname, attnotnull FROM pg_attribute WHERE attrelid = '\"App\".\"Orders\"'::regclass "
        "AND attnum > 0 AND NOT attisdropped"))
    assert columns == {"id": True, "customer": True, "amount": True, "status": False,
                       "created": True, "serial_no": True}
    indexes = {row[0] for row in target_db.query("SELECT indexrelid::regclass::text FROM pg_index "
                                                 "WHERE indrelid = '\"App\".\"Orders\"'::regclass")}
    assert indexes == {'"App"."Orders_pkey"', '"App".orders_customer'}
    assert target_db.query("SELECT relreplident FROM pg_class WHERE oid = 'keyed'::regclass") == [("i",)]
    assert target_db.query("SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef WHERE adrelid = "
                           "'\"App\".\"Orders\"'::regclass AND adnum = 3") == [("0",)]
    # Streaming continues into the created tables.
    source_db.execute("""UPDATE "App"."Orders" SET status = 'paid' WHERE id <= 5;
                         DELETE FROM keyed WHERE a <= 3; UPDATE keyed SET b = 'moved' WHERE a = 4""")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, '"App"."Orders"', "keyed")


def test_non_empty_target_refused_unless_truncate(source_db, target_db) -> None:
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source_db.execute("INSERT INTO t SELECT g, 'src' FROM generate_series(1, 100) g")
    target_db.execute("INSERT INTO t VALUES (1, 'stale'), (1000, 'extra')")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    refused = run_sync(source_db, target_db, expect_rc=1)
    assert 'target table(s) "public"."t" are not empty' in refused.stderr
    assert "--truncate-target" in refused.stderr
    assert target_db.query("SELECT count(*) FROM t")[0][0] == 2
    run_sync(source_db, target_db, "--truncate-target")
    assert_same_rows(source_db, target_db, "t")


def test_copied_rows_are_the_workers_own_not_another_origins(source_db, target_db) -> None:
    """Rows applier sync copied carry no replication origin; on PostgreSQL 16+ with
    track_commit_timestamp the worker must still know them as its own (no update_origin_differs,
    no fall back to row-by-row apply), while a genuine local write on the target is a conflict."""
    source_db.execute("CREATE TABLE c (id int PRIMARY KEY, n int)")
    target_db.execute("CREATE TABLE c (id int PRIMARY KEY, n int)")
    source_db.execute("INSERT INTO c SELECT g, 0 FROM generate_series(1, 3000) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE c")
    run_sync(source_db, target_db, "--jobs", "2")
    source_db.execute("UPDATE c SET n = n + 1")
    bulk = run_worker(source_db, target_db, "--log-level", "INFO")
    assert "row by row" not in bulk.stderr, bulk.stderr[-3000:]
    assert target_db.query("SELECT count(*) FROM applier.conflicts") == [(0,)]
    target_db.execute("UPDATE c SET n = -1 WHERE id = 5")  # a local write
    source_db.execute("UPDATE c SET n = n + 1 WHERE id IN (5, 6)")
    run_worker(source_db, target_db)
    expected = [("update_origin_differs", "5")] if target_db.version >= 16 else []
    assert target_db.query("SELECT conflict_type, key->>'id' FROM applier.conflicts") == expected
    assert_same_rows(source_db, target_db, "c")


def test_a_sync_that_streams_nothing_after_its_copy_leaves_the_replica_at_the_copys_position(
        source_db, target_db) -> None:
    """The copy is the replica's state as of the slot's consistent point: the target records that
    position (every commit before the point applied), not none, and the stream goes on from it."""
    for db in (source_db, target_db):
        db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    source_db.execute("INSERT INTO t SELECT g, 'a' FROM generate_series(1, 100) g")
    source_db.execute("CREATE PUBLICATION pub FOR TABLE t")
    run_sync(source_db, target_db)
    (sync_lsn,) = {lsn for _, lsn in sync_states(target_db).values()}
    assert target_db.query("SELECT commit_lsn::text, end_lsn::text, commit_time FROM applier.progress "
                           "WHERE slot_name = 's'") == [(str(LSN(int(LSN.parse(sync_lsn)) - 1)),
                                                         sync_lsn, None)]
    source_db.execute("INSERT INTO t VALUES (101, 'b')")
    source_db.execute("UPDATE t SET v = 'c' WHERE id = 1")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "t")
    (commit_lsn,) = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0]
    assert LSN.parse(commit_lsn) > LSN.parse(sync_lsn)


SHOP = """
    CREATE SCHEMA app;
    CREATE TABLE app.customers (
        id int GENERATED ALWAYS AS IDENTITY (START WITH 100 INCREMENT BY 5) PRIMARY KEY,
        email text COLLATE "C" NOT NULL UNIQUE,
        name text,
        CONSTRAINT name_not_blank CHECK (name <> ''));
    CREATE TABLE app.orders (
        id bigserial PRIMARY KEY,
        customer_id int NOT NULL REFERENCES app.customers (id),
        total numeric(10, 2) NOT NULL DEFAULT 0 CHECK (total >= 0),
        doubled numeric GENERATED ALWAYS AS (total * 2) STORED,
        note text,
        placed timestamptz NOT NULL DEFAULT now());
    CREATE INDEX orders_customer ON app.orders (customer_id) INCLUDE (total);
    CREATE INDEX orders_note ON app.orders (lower(note));
    INSERT INTO app.customers (email, name) SELECT 'c' || g || '@x', 'n' || g FROM generate_series(1, 30) g;
    INSERT INTO app.orders (customer_id, total, note)
        SELECT 100 + 5 * (g % 30), g, 'n' || g FROM generate_series(1, 300) g;
    CREATE PUBLICATION pub FOR TABLE app.customers, app.orders;
"""


def _differences(source_db, target_db) -> list[str]:
    from applier.lifecycle.schemas import schema_differences
    from applier.sync.catalog import published_tables

    with source_db.connect() as source, target_db.connect() as target:
        source.autocommit = target.autocommit = True
        return schema_differences(source, target, published_tables(source, ["pub"]))


def test_create_tables_builds_the_sources_schema(source_db, target_db) -> None:
    """--create-tables makes a target one can cut over to: identity stays ALWAYS, serial columns
    keep their sequences (set past the source's values), CHECK and foreign keys are there and
    validated, unique constraints, collations, generated columns and indexes as on the source;
    the schema comparison finds no difference, and finds one made afterwards."""
    source_db.execute(SHOP)
    run_sync(source_db, target_db, "--create-tables")
    assert _differences(source_db, target_db) == []
    assert target_db.query("SELECT attidentity FROM pg_attribute WHERE attrelid = "
                           "'app.customers'::regclass AND attname = 'id'") == [("a",)]
    assert target_db.query("SELECT conname, convalidated FROM pg_constraint WHERE contype IN "
                           "('c', 'f') AND connamespace = 'app'::regnamespace ORDER BY 1") == [
        ("name_not_blank", True), ("orders_customer_id_fkey", True), ("orders_total_check", True)]
    # Sequences set past what the source handed out: rows written on the target after a
    # cutover do not collide.
    target_db.execute("INSERT INTO app.customers (email) VALUES ('after@x')")
    target_db.execute("INSERT INTO app.orders (customer_id, total) VALUES (100, 1)")
    assert target_db.query("SELECT id FROM app.customers WHERE email = 'after@x'") == [(250,)]
    assert target_db.query("SELECT max(id), max(doubled) FROM app.orders")[0][0] == 301
    target_db.execute("DELETE FROM app.orders WHERE id = 301; DELETE FROM app.customers WHERE id = 250")
    # Streaming goes on into them (identity values taken as the source gives them).
    source_db.execute("INSERT INTO app.customers (email, name) VALUES ('late@x', 'late')")
    source_db.execute("INSERT INTO app.orders (customer_id, total) VALUES (250, 7)")
    run_worker(source_db, target_db)
    assert_same_rows(source_db, target_db, "app.customers", "app.orders")
    # A difference made on the target is named.
    target_db.execute("ALTER TABLE app.orders DROP CONSTRAINT orders_total_check; "
                      "ALTER TABLE app.customers ALTER COLUMN id SET GENERATED BY DEFAULT")
    assert _differences(source_db, target_db) == [
        '"app"."customers": column "id": identity ALWAYS on the source, BY DEFAULT on the target',
        '"app"."orders": constraint "orders_total_check" is not on the target (CHECK ((total >= '
        '(0)::numeric)))']
