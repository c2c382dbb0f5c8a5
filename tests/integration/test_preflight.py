"""Checks before anything is created (PostgreSQL 15 and 18): ``applier sync`` refuses a start it
cannot finish at once, listing every problem, and leaves neither a slot on the source nor the
bookkeeping schema, a table or a state row on the target; ``preflight.check_source`` tells
``applier run --create-slot`` the same before it creates its slot."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import forked
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from replication import REPO, replicated_table, run_worker, wait_for

from applier.embedded import Database, PostgresServer, ServerSettings, start_server
from applier.preflight import check_source

pytestmark = pytest.mark.server

#: applier sync retries transient failures for about 30 s; a permanent one must end long before.
AT_ONCE = 12.0


@dataclass
class Dsn:
    """A database reached with other connection parameters (what the helpers need of one)."""

    dsn: str


def with_params(dsn: str, **params: str) -> str:
    return make_conninfo(**{**conninfo_to_dict(dsn), **params})


def sync(source, target, *extra: str, publication: str = "pub") -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = forked.run([sys.executable, "-m", "applier", "sync", "--source", source.dsn,
                       "--target", target.dsn, "--slot", "s", "--publication", publication,
                       "--exit-when-caught-up", *extra], capture_output=True, text=True,
                      timeout=300, cwd=REPO)
    return done, time.monotonic() - started


def assert_nothing_created(source_db, target_db, *tables: str) -> None:
    assert source_db.query("SELECT slot_name FROM pg_replication_slots WHERE database = "
                           "current_database()") == []
    assert target_db.query("SELECT nspname FROM pg_namespace WHERE nspname = 'applier'") == []
    for table in tables:
        assert target_db.query("SELECT to_regclass(%s)", (table,)) == [(None,)], table


def refused(done: subprocess.CompletedProcess, elapsed: float) -> str:
    assert done.returncode == 1, f"rc={done.returncode}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert elapsed < AT_ONCE, f"took {elapsed:.1f} s: retried?\n{done.stderr[-4000:]}"
    return done.stderr


# -- connections ------------------------------------------------------------------------------------

def _write_hba(db: Database, path: str, lines: list[str]) -> None:
    # Written by the server itself (the file belongs to its user, and a container's is not on
    # this machine). CSV with a delimiter and quote no line holds writes each line verbatim;
    # an empty line would come out quoted, so it becomes an empty comment.
    db.execute(sql.SQL("COPY (SELECT unnest({}::text[])) TO {} WITH (FORMAT csv, DELIMITER E'\\x02', "
                       "QUOTE E'\\x01')").format(sql.Literal([line or "#" for line in lines]),
                                                 sql.Literal(path)))
    db.execute("SELECT pg_reload_conf()")


@contextmanager
def password_required(db: Database, role: str) -> Iterator[None]:
    """Connections of ``role`` to ``db``'s server must give its password; every other role stays
    trusted."""
    path = db.query("SELECT current_setting('hba_file')")[0][0]
    original = db.query("SELECT pg_read_file(%s)", (path,))[0][0].splitlines()
    _write_hba(db, path, [f"host all {role} all scram-sha-256", *original])

    def asks_for_password() -> bool:
        try:
            psycopg.connect(with_params(db.dsn, user=role), connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            return "password" in str(exc)
        return False

    try:
        wait_for(asks_for_password, timeout=30, what="pg_hba.conf to be reloaded")
        yield
    finally:
        _write_hba(db, path, original)


@pytest.mark.parametrize("side", ["source", "target"])
def test_wrong_password_fails_at_once_and_creates_nothing(source_db, target_db, side: str) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    db = source_db if side == "source" else target_db
    role = f"pw_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD 'right'").format(sql.Identifier(role)))
    outcomes = []
    try:
        with password_required(db, role):
            for password in ("hunter2wrong", None):
                params = {"user": role, **({"password": password} if password else {})}
                wrong = Dsn(with_params(db.dsn, **params))
                outcomes.append(sync(wrong if side == "source" else source_db,
                                     wrong if side == "target" else target_db))
    finally:
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    (wrong_password, elapsed), (no_password, elapsed_without) = outcomes
    stderr = refused(wrong_password, elapsed)
    assert f"{side}: cannot connect" in stderr and "password authentication failed" in stderr
    assert "hunter2wrong" not in stderr
    stderr = refused(no_password, elapsed_without)
    assert f"{side}: cannot connect" in stderr and "no password supplied" in stderr
    assert_nothing_created(source_db, target_db)


def test_a_role_that_may_not_log_in_fails_at_once(source_db, target_db) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    role = f"nologin_{uuid.uuid4().hex[:8]}"
    source_db.execute(sql.SQL("CREATE ROLE {} NOLOGIN REPLICATION").format(sql.Identifier(role)))
    try:
        done, elapsed = sync(Dsn(with_params(source_db.dsn, user=role)), target_db)
    finally:
        source_db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    stderr = refused(done, elapsed)
    assert "source: cannot connect" in stderr and "is not permitted to log in" in stderr
    assert_nothing_created(source_db, target_db)


# -- the source server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def unfit_server(pg_pair) -> Iterator[PostgresServer]:
    """A server that cannot be a source: wal_level replica, one replication slot, one WAL sender."""
    server = start_server(pg_pair.version, ServerSettings.source(
        wal_level="replica", max_replication_slots=1, max_wal_senders=1),
        name=f"unfit{pg_pair.version}")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def unfit_db(unfit_server: PostgresServer) -> Iterator[Database]:
    name = f"unfit_{uuid.uuid4().hex[:8]}"
    db = unfit_server.create_database(name)
    try:
        yield db
    finally:
        unfit_server.drop_database(name)


def test_source_without_logical_wal_level_is_refused_before_tables_are_created(unfit_db,
                                                                                target_db) -> None:
    unfit_db.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1);"
                     "CREATE PUBLICATION pub FOR TABLE t")
    done, elapsed = sync(unfit_db, target_db, "--create-tables")
    stderr = refused(done, elapsed)
    assert "wal_level is 'replica'" in stderr and "wal_level = logical" in stderr
    assert_nothing_created(unfit_db, target_db, "public.t")


def test_check_source_lists_every_problem_of_a_slot_to_create(unfit_db) -> None:
    """What ``applier run --create-slot`` asks before it creates the slot."""
    role = f"noreplication_{uuid.uuid4().hex[:8]}"
    unfit_db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    unfit_db.execute("SELECT pg_create_physical_replication_slot('taken')")  # the only slot
    try:
        # The only WAL sender.
        with psycopg.connect(unfit_db.dsn, replication="database", autocommit=True), \
                psycopg.connect(with_params(unfit_db.dsn, user=role), autocommit=True) as conn:
            problems = check_source(conn, slot="s", publications=["pub", "other"], create_slot=True)
            assert conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (1,)
    finally:
        unfit_db.execute("SELECT pg_drop_replication_slot('taken')")
        unfit_db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert "wal_level is 'replica'" in text
    assert "all 1 replication slots are in use" in text and "max_replication_slots" in text
    assert "all 1 WAL senders are in use" in text and "max_wal_senders" in text
    assert f'ALTER ROLE "{role}" REPLICATION' in text
    assert "publication(s) 'pub', 'other' do not exist" in text


def test_check_source_of_an_existing_slot(source_db) -> None:
    source_db.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE t")
    source_db.execute("SELECT pg_create_logical_replication_slot('decoded', 'test_decoding')")
    source_db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    with source_db.connect() as conn:
        assert check_source(conn, slot="s", publications=["pub"], create_slot=False) == []
        assert check_source(conn, slot="decoded", publications=["pub"], create_slot=False) == [
            "source: slot 'decoded' uses plugin 'test_decoding'; applier needs a pgoutput slot: "
            "choose another --slot, or drop this one (pg_drop_replication_slot) if nothing else "
            "reads it"]
        assert "does not exist" in check_source(conn, slot="gone", publications=["pub"],
                                                create_slot=False)[0]


def test_run_create_slot_with_a_missing_publication_leaves_no_slot(source_db, target_db) -> None:
    replicated_table(source_db, target_db, with_slot=False)
    done = run_worker(source_db, target_db, "--create-slot", publication="nopub", expect_rc=1)
    assert "'nopub'" in done.stderr
    assert source_db.query("SELECT slot_name FROM pg_replication_slots WHERE database = "
                           "current_database()") == []


def test_run_on_a_missing_slot_creates_nothing(source_db, target_db) -> None:
    """Without --create-slot, the slot and publications are checked before the bookkeeping
    schema is created: a start that cannot stream leaves an empty target empty."""
    replicated_table(source_db, target_db, with_slot=False)
    done = run_worker(source_db, target_db, slot="nosuch", expect_rc=1)
    assert "replication slot 'nosuch' does not exist" in done.stderr, done.stderr
    assert_nothing_created(source_db, target_db)
    source_db.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    done = run_worker(source_db, target_db, publication="nopub", expect_rc=1)
    assert "'nopub'" in done.stderr, done.stderr
    assert target_db.query("SELECT nspname FROM pg_namespace WHERE nspname = 'applier'") == []


# -- publications, tables and columns -----------------------------------------------------------

ACCOUNTS = "CREATE TABLE accounts (id int PRIMARY KEY, owner text, balance numeric)"
LEDGER = "CREATE TABLE ledger (id int PRIMARY KEY, amount numeric, note text)"


def test_every_missing_column_of_every_table_is_named(source_db, target_db) -> None:
    """A target table without a published column was a KeyError traceback from the COPY plan."""
    source_db.execute(f"{ACCOUNTS}; {LEDGER}; CREATE PUBLICATION pub FOR TABLE accounts, ledger")
    source_db.execute("INSERT INTO accounts VALUES (1, 'a', 10)")
    target_db.execute("CREATE TABLE accounts (id int PRIMARY KEY, owner text);"
                      "CREATE TABLE ledger (id int PRIMARY KEY,"
                      " note text GENERATED ALWAYS AS ('n') STORED)")
    for extra in ((), ("--create-tables",)):  # existing tables are checked either way
        done, elapsed = sync(source_db, target_db, *extra)
        stderr = refused(done, elapsed)
        assert 'target table "public"."accounts" has no column "balance"' in stderr
        assert 'target table "public"."ledger" has no column "amount"' in stderr
        assert 'target table "public"."ledger" has only a generated column "note"' in stderr
        assert_nothing_created(source_db, target_db)


def test_every_problem_is_listed_at_once(source_db, target_db) -> None:
    source_db.execute(f"{ACCOUNTS}; {LEDGER}; CREATE PUBLICATION pub FOR TABLE accounts, ledger")
    target_db.execute("CREATE TABLE accounts (id int PRIMARY KEY, owner text)")
    done, elapsed = sync(source_db, target_db, publication="pub,nopub")
    stderr = refused(done, elapsed)
    assert "publication(s) 'nopub' do not exist" in stderr
    assert 'target table "public"."accounts" has no column "balance"' in stderr
    assert 'target table "public"."ledger" does not exist' in stderr and "--create-tables" in stderr
    assert_nothing_created(source_db, target_db, "public.ledger")


@pytest.fixture
def roles(source_db, target_db) -> Iterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    reader, writer = f"reader_{suffix}", f"writer_{suffix}"
    source_db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(reader)))
    target_db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(writer)))
    yield reader, writer
    for db, role in ((source_db, reader), (target_db, writer)):
        db.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(role)))


def test_missing_privileges_are_listed_with_the_grants_that_fix_them(source_db, target_db,
                                                                     roles) -> None:
    reader, writer = roles
    source_db.execute(f"CREATE SCHEMA app; {LEDGER}; CREATE TABLE app.accounts (id int PRIMARY KEY);"
                      "CREATE PUBLICATION pub FOR TABLE ledger, app.accounts")
    source_db.execute(f"GRANT SELECT (id, amount) ON ledger TO {reader}")  # not note
    target_db.execute(f"{LEDGER}; GRANT SELECT, INSERT ON ledger TO {writer}")  # not TRUNCATE
    source, target = Dsn(with_params(source_db.dsn, user=reader)), Dsn(with_params(target_db.dsn, user=writer))
    done, elapsed = sync(source, target, "--create-tables")
    stderr = refused(done, elapsed)
    assert f'ALTER ROLE "{reader}" REPLICATION' in stderr
    assert f'GRANT SELECT ON "public"."ledger" TO "{reader}"' in stderr
    assert f'GRANT SELECT ON "app"."accounts" TO "{reader}"' in stderr
    assert f'GRANT CREATE ON DATABASE "{target_db.name}" TO "{writer}"' in stderr  # applier, app
    assert "bookkeeping schema applier" in stderr and 'schema "app"' in stderr
    assert f'GRANT TRUNCATE ON "public"."ledger" TO "{writer}"' in stderr
    assert f'GRANT SET ON PARAMETER session_replication_role TO "{writer}"' in stderr
    assert_nothing_created(source_db, target_db, "app.accounts")


# -- run --create-slot and sequences (issue 26: a failed start leaves nothing behind) -------------

def test_run_create_slot_checks_the_target_before_creating_anything(source_db, target_db) -> None:
    """The worker created its bookkeeping schema before it looked at the source or the target."""
    source_db.execute(f"{ACCOUNTS}; {LEDGER}; CREATE PUBLICATION pub FOR TABLE accounts, ledger")
    target_db.execute("CREATE TABLE accounts (id int PRIMARY KEY, owner text)")
    started = time.monotonic()
    done = run_worker(source_db, target_db, "--create-slot", publication="pub,nopub", expect_rc=1)
    assert time.monotonic() - started < AT_ONCE
    assert "applier run --create-slot cannot start (nothing was created)" in done.stderr
    assert "publication(s) 'nopub' do not exist" in done.stderr
    assert 'target table "public"."accounts" has no column "balance"' in done.stderr
    assert 'target table "public"."ledger" does not exist' in done.stderr
    assert_nothing_created(source_db, target_db)


def test_run_create_slot_names_the_privileges_applying_needs(source_db, target_db, roles) -> None:
    _, writer = roles
    source_db.execute(f"{LEDGER}; CREATE PUBLICATION pub FOR TABLE ledger")
    target_db.execute(f"{LEDGER}; GRANT SELECT, INSERT ON ledger TO {writer}")
    done = run_worker(source_db, Dsn(with_params(target_db.dsn, user=writer)), "--create-slot",
                      expect_rc=1)
    assert (f'lacks UPDATE, DELETE on "public"."ledger", which applying changes needs: '
            f'GRANT UPDATE, DELETE ON "public"."ledger" TO "{writer}"') in done.stderr
    assert "TRUNCATE" not in done.stderr  # the copy's privilege, not the apply's
    assert_nothing_created(source_db, target_db)


def test_sync_checks_the_sequences_it_sets_after_its_copy(source_db, target_db, roles) -> None:
    reader, writer = roles
    source_db.execute("CREATE TABLE counted (id serial PRIMARY KEY); "
                      "CREATE PUBLICATION pub FOR TABLE counted")
    source_db.execute(f"GRANT SELECT ON counted TO {reader}; ALTER ROLE {reader} REPLICATION")
    target_db.execute(f"CREATE TABLE counted (id serial PRIMARY KEY); "
                      f"GRANT SELECT, INSERT, TRUNCATE ON counted TO {writer}")
    source = Dsn(with_params(source_db.dsn, user=reader))
    target = Dsn(with_params(target_db.dsn, user=writer))
    done, elapsed = sync(source, target)
    stderr = refused(done, elapsed)
    assert (f'source: role "{reader}" may not read sequence "public"."counted_id_seq", which sync '
            f'sets on the target after its copy: GRANT SELECT ON SEQUENCE "public"."counted_id_seq" '
            f'TO "{reader}"') in stderr
    assert (f'target: role "{writer}" may not set sequence "public"."counted_id_seq"' in stderr
            and f'GRANT UPDATE ON SEQUENCE "public"."counted_id_seq" TO "{writer}"' in stderr)
    assert_nothing_created(source_db, target_db)
