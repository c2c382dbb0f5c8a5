"""Checks of the change feed shared by its integration tests: every change row exactly once and
with its data, and the recorded history replayed gives the target table."""

from __future__ import annotations

from collections.abc import Sequence

from replication import rows, source_columns

PENDING = "FFFFFFFF/FFFFFFFF"
#: applier.change_commits, one row per source transaction (a subquery to alias).
COMMITS = ("(SELECT k.slot_name, e.commit_lsn, e.end_lsn FROM applier.change_commits k, "
           "unnest(k.commit_lsns, k.end_lsns) e(commit_lsn, end_lsn))")


def change_table(table: str, schema: str = "public") -> str:
    return f'applier_changes."{schema}.{table}"'


def changes(target_db, table: str, columns: Sequence[str] = ()) -> list[tuple]:
    """(commit LSN, commit time, xid, seq, op, *columns as text) in replay order."""
    cols = "".join(f", {c}::text" for c in columns)
    return target_db.query(
        f"SELECT change_commit_lsn::text, change_commit_time, change_xid, change_seq, "
        f"change_op::text{cols} FROM {change_table(table)} c ORDER BY c.change_commit_lsn, c.change_seq")


def replay(target_db, table: str, columns: Sequence[str], key: Sequence[str]) -> list[tuple]:
    """The table as its change rows rebuild it from empty (its history starts with the table)."""
    state: dict[tuple, tuple] = {}
    positions = [columns.index(k) for k in key]
    for row in changes(target_db, table, columns):
        op, values = row[4], row[5:]
        if op == "T":
            state.clear()
            continue
        k = tuple(values[i] for i in positions)
        if op == "D":
            state.pop(k, None)
        else:
            state[k] = tuple(values)
    return sorted(state.values(), key=repr)


def check_feed(source_db, target_db, table: str, key: Sequence[str] = ("id",)) -> list[tuple]:
    """Every change row once, none pending, none past the applied position, one commit LSN and
    time per source transaction, and the replay equal to the target table. Returns the rows."""
    columns = source_columns(source_db, table)
    found = changes(target_db, table, columns)
    seen = [(lsn, seq) for lsn, _, _, seq, *_ in found]
    assert len(seen) == len(set(seen)), f"{table}: a change row twice"
    assert all(lsn != PENDING for lsn, *_ in found), f"{table}: rows left pending"
    applied = target_db.query("SELECT commit_lsn::text FROM applier.progress")[0][0]
    if found:
        assert target_db.query("SELECT max(change_commit_lsn) <= %s::pg_lsn FROM "
                               f"{change_table(table)}", (applied,)) == [(True,)]
    per_xid: dict[int, set] = {}
    for lsn, time, xid, *_ in found:
        per_xid.setdefault(xid, set()).add((lsn, time))
    assert all(len(v) == 1 for v in per_xid.values()), f"{table}: a transaction with several stamps"
    by_lsn = {next(iter(v))[0] for v in per_xid.values()}
    assert len(by_lsn) == len(per_xid), f"{table}: two transactions with one commit LSN"
    # Each of those transactions has its end LSN, once, past its commit LSN.
    recorded = target_db.query(f"SELECT commit_lsn::text, end_lsn > commit_lsn FROM {COMMITS} commits")
    ends = dict(recorded)
    assert len(ends) == len(recorded), f"{table}: a transaction's end LSN recorded twice"
    assert by_lsn <= set(ends), f"{table}: transactions without an end LSN: {sorted(by_lsn - set(ends))[:5]}"
    assert all(ends[lsn] for lsn in by_lsn), f"{table}: an end LSN not past its commit LSN"
    assert target_db.query("SELECT count(*) FROM applier.change_commits WHERE first_lsn <> commit_lsns[1] "
                           "OR last_lsn <> commit_lsns[cardinality(commit_lsns)]") == [(0,)]
    if key:
        rebuilt, actual = replay(target_db, table, columns, key), rows(target_db, table, columns)
        assert rebuilt == actual, (f"{table}: the recorded changes do not rebuild the table: replay "
                                   f"has {sorted(set(rebuilt) - set(actual))[:5]}, the table "
                                   f"{sorted(set(actual) - set(rebuilt))[:5]}")
    return found


def ops(found: list[tuple]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for row in found:
        counted[row[4]] = counted.get(row[4], 0) + 1
    return counted
