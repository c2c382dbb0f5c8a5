"""Conflict detection, policies and records (``apply.conflicts``) without a server: the fake
target answers "no row changed" where a test wants a conflict."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fake_target import relation, rig, table
from test_apply_dispatch import _row, insert, transaction

from applier.apply.conflicts import ConflictHandler
from applier.apply.handlers import default_handlers
from applier.errors import ApplyError, Cause, Directive, decide
from applier.protocol.lsn import LSN
from applier.protocol.messages import Delete, RelationColumn, Update


def _policy(policy: str, **per_table: str):  # type: ignore[no-untyped-def]
    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.conflicts = ConflictHandler(tx, policy, {("public", t): p for t, p in per_table.items()})
        return built
    return handlers


def test_insert_exists_under_apply_updates_the_row_and_records_the_conflict() -> None:
    r = rig(handlers=_policy("apply"))
    r.applier.relation(relation())
    r.target.rows = lambda sql, values: 0 if sql.startswith("INSERT") else 1  # the key exists
    transaction(r, 700, 0x100, insert(1, "remote"))
    (statements,) = r.target.transactions
    assert statements[0].startswith('INSERT INTO "public"."t"') and "ON CONFLICT" in statements[0]
    assert any(s.startswith('UPDATE "public"."t" SET') for s in statements)  # the source row wins
    ((slot, record),) = r.store.committed.conflicts
    assert (slot, record.conflict_type, record.resolution) == ("s", "insert_exists", "applied")
    assert (record.source_xid, record.source_lsn, record.key) == (700, LSN(0x100), '{"id": 1}')
    assert record.local_row == '{"id": 1, "v": "local"}'
    assert r.applier.conflicts == {("public.t", "insert_exists"): 1}


def test_keep_local_leaves_the_row_and_records_a_missing_row_as_skipped() -> None:
    r = rig(handlers=_policy("keep-local"))
    r.applier.relation(relation())
    r.target.rows = lambda sql, values: 0
    transaction(r, 700, 0x100, insert(1), Update(None, 1, None, None, _row(b"2", b"w")),
                Delete(None, 1, "K", _row(b"3", None)))
    (statements,) = r.target.transactions
    assert sum(s.startswith("UPDATE") for s in statements) == 1  # the update itself, no upsert
    kinds = [(c.conflict_type, c.resolution) for _, c in r.store.committed.conflicts]
    assert kinds == [("insert_exists", "kept-local"), ("update_missing", "skipped"),
                     ("delete_missing", "skipped")]
    assert r.commits == [LSN(0x108)]


def test_error_policy_rolls_back_records_the_conflict_and_stops_naming_the_key_as_text() -> None:
    """Issue 23, item 18: the key is printed as the target reads it, not in its wire form."""
    r = rig(handlers=_policy("apply", t="error"))
    r.applier.relation(relation())
    r.target.rows = lambda sql, values: 0 if sql.startswith("DELETE") else 1
    with pytest.raises(ApplyError) as stopped:
        transaction(r, 700, 0x100, insert(5), Delete(None, 1, "K", _row(b"1", None)))
    assert decide(stopped.value) is Directive.STOP and stopped.value.cause is Cause.REFUSED_DATA
    assert 'conflict delete_missing on table "public"."t" (key {"id": 1})' in str(stopped.value)
    assert stopped.value.commit_lsn == LSN(0x100)
    assert r.target.transactions == [] and r.commits == []  # nothing of the transaction
    ((_, record),) = r.store.committed.conflicts  # recorded on its own, for the operator
    assert (record.conflict_type, record.resolution) == ("delete_missing", "error")


def test_update_origin_differs_is_told_from_a_missing_row_by_a_probe() -> None:
    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.conflicts = ConflictHandler(tx, "apply", origin_id=7)
        return built

    r = rig(handlers=handlers)
    r.applier.relation(relation())
    # The guarded update changes nothing (another origin wrote the row); the probe finds the row.
    r.target.rows = lambda sql, values: 0 if "pg_xact_commit_timestamp_origin" in sql else 1
    transaction(r, 700, 0x100, Update(None, 1, None, None, _row(b"1", b"w")))
    (statements,) = r.target.transactions
    guarded, probe = statements[0], statements[1]
    assert "pg_xact_commit_timestamp_origin(xmin)" in guarded and "7::pg_catalog.oid" in guarded
    assert probe.startswith('SELECT 1 FROM "public"."t" WHERE')
    assert statements[-1].startswith('UPDATE "public"."t" SET') and "xmin" not in statements[-1]
    ((_, record),) = r.store.committed.conflicts
    assert (record.conflict_type, record.resolution) == ("update_origin_differs", "applied")


def test_a_probe_is_built_again_when_the_relation_is_described_anew() -> None:
    """Every per-relation structure hangs off the relation cache: a Relation message renaming the
    key column drops the conflict handler's probe built for the old name, as it drops the
    careful path's statements."""
    def handlers(tx):  # type: ignore[no-untyped-def]
        built = default_handlers(tx)
        built.conflicts = ConflictHandler(tx, "apply", origin_id=7)
        return built

    tables = {"t": table("t")}
    r = rig(handlers=handlers, tables=tables)
    r.applier.relation(relation())
    r.target.rows = lambda sql, values: 0 if "pg_xact_commit_timestamp_origin" in sql else 1
    transaction(r, 700, 0x100, Update(None, 1, None, None, _row(b"1", b"w")))
    renamed = relation()
    renamed = replace(renamed, columns=(RelationColumn(1, "key", 23, -1), renamed.columns[1]))
    tables["t"] = replace(table("t"), columns={"key": replace(table("t").columns["id"], name="key"),
                                               "v": table("t").columns["v"]}, unique_key=("key",))
    r.applier.relation(renamed)
    transaction(r, 701, 0x200, Update(None, 1, None, None, _row(b"1", b"x")))
    probe = r.target.transactions[-1][1]
    assert probe.startswith('SELECT 1 FROM "public"."t" WHERE') and '"key"' in probe, probe
