"""``applier status``: what the target records about a slot, read-only.

Shows the applied position, prepared source transactions still pending (prepared on the target,
or deferred in the applier schema), the replication origin tagging the worker's writes and, per
origin seen in the stream, the origin LSN of the last transaction applied from it, conflict counts
per table and type, a pending skip request and skipped transactions, and logical messages
received. With ``--source`` it adds the slot's confirmed position and lag. ``--json`` prints one
JSON object. Exit status 0, or 1 when the target has no applier schema.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .apply.origins import default_origin_name
from .config import Settings

__all__ = ["run_status", "collect_status"]

log = logging.getLogger(__name__)


def _table_exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]  # type: ignore[index]


def _rows(conn: psycopg.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql, params).fetchall()  # type: ignore[arg-type]


def collect_status(target: str, slot: str, source: str | None = None) -> dict[str, Any]:
    """Everything ``applier status`` shows, as plain JSON-able values."""
    with psycopg.connect(target, autocommit=True) as conn:
        if not _table_exists(conn, "applier.progress"):
            raise LookupError("the target has no applier schema: no worker has run against it")
        database, database_oid = conn.execute(
            "SELECT current_database(), (SELECT oid FROM pg_database "
            "WHERE datname = current_database())").fetchone()  # type: ignore[misc]
        status: dict[str, Any] = {"slot": slot, "database": database}
        status["position"] = (_rows(conn, "SELECT commit_lsn::text, end_lsn::text, commit_time, "
                                          "applied_at FROM applier.progress WHERE slot_name = %s",
                                    (slot,)) or [None])[0]
        gid_prefix = f"applier_{database_oid}_"
        prepared = [dict(row, mode="prepare") for row in _rows(
            conn, "SELECT gid, prepared, owner FROM pg_prepared_xacts WHERE database = "
                  "current_database() AND starts_with(gid, %s) AND right(gid, %s) = %s",
            (gid_prefix, len(slot) + 1, "_" + slot))]
        origin_name = default_origin_name(slot, database)
        tag = {"name": origin_name, "exists": False}
        try:
            found = _rows(conn, "SELECT o.roident, s.remote_lsn::text, s.local_lsn::text "
                                "FROM pg_replication_origin o LEFT JOIN "
                                "pg_replication_origin_status s ON s.local_id = o.roident "
                                "WHERE o.roname = %s", (origin_name,))
            if found:
                tag.update(found[0], exists=True)
        except psycopg.errors.InsufficientPrivilege:
            tag["error"] = "not permitted to read pg_replication_origin"
        status["replication_origin"] = tag
        if _table_exists(conn, "applier.prepared_transactions"):
            prepared += _rows(conn, "SELECT xid, source_gid, mode, prepare_lsn::text, "
                                    "end_lsn::text, prepare_time, origin_name, changes "
                                    "FROM applier.prepared_transactions WHERE slot_name = %s "
                                    "AND mode = 'defer' ORDER BY prepare_lsn", (slot,))
            status["origins"] = _rows(conn, "SELECT origin_name, origin_lsn::text, commit_lsn::text, "
                                            "commit_time, transactions, applied_at FROM "
                                            "applier.origins WHERE slot_name = %s "
                                            "ORDER BY origin_name", (slot,))
            status["conflicts"] = _rows(conn, "SELECT table_schema, table_name, conflict_type, "
                                              "resolution, count(*) AS count, max(detected_at) "
                                              "AS last FROM applier.conflicts WHERE slot_name = %s "
                                              "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4", (slot,))
            status["skip_request"] = (_rows(conn, "SELECT lsn::text, requested_at FROM "
                                                  "applier.skip_requests WHERE slot_name = %s",
                                            (slot,)) or [None])[0]
            status["skipped"] = _rows(conn, "SELECT finish_lsn::text, end_lsn::text, xid, "
                                            "source_gid, kind, changes, tables, skipped_at FROM "
                                            "applier.skipped_transactions WHERE slot_name = %s "
                                            "ORDER BY id DESC LIMIT 20", (slot,))
            status["messages"] = _rows(conn, "SELECT count(*) AS count, max(lsn)::text AS last_lsn "
                                             "FROM applier.messages WHERE slot_name = %s",
                                       (slot,))[0]
        status["prepared"] = prepared
    if source:
        with psycopg.connect(source, autocommit=True) as conn:
            status["source_slot"] = (_rows(
                conn, "SELECT active, confirmed_flush_lsn::text, pg_current_wal_lsn()::text "
                      "AS current_lsn, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)"
                      "::bigint AS lag_bytes FROM pg_replication_slots WHERE slot_name = %s",
                (slot,)) or [None])[0]
    return status


def format_status(status: dict[str, Any]) -> str:
    lines = [f"slot {status['slot']!r} on target database {status['database']!r}"]
    position = status.get("position")
    if position:
        lines.append(f"  applied through commit LSN {position['commit_lsn']} (end "
                     f"{position['end_lsn']}), source commit time {position['commit_time']}, "
                     f"applied at {position['applied_at']}")
    else:
        lines.append("  nothing applied yet")
    source = status.get("source_slot")
    if source:
        lines.append(f"  source slot: active={source['active']} confirmed {source['confirmed_flush_lsn']}"
                     f", source at {source['current_lsn']}, lag {source['lag_bytes']} bytes")
    tag = status["replication_origin"]
    if tag.get("exists"):
        lines.append(f"  writes tagged with replication origin {tag['name']!r} (id {tag['roident']}, "
                     f"remote LSN {tag.get('remote_lsn')})")
    else:
        lines.append(f"  replication origin {tag['name']!r}: "
                     f"{tag.get('error') or 'not created (writes untagged, or a custom name)'}")
    lines.append(f"  prepared source transactions pending: {len(status['prepared'])}")
    for row in status["prepared"]:
        if row["mode"] == "prepare":
            lines.append(f"    prepared on the target as {row['gid']!r} at {row['prepared']}")
        else:
            lines.append(f"    deferred xid {row['xid']} GID {row['source_gid']!r} prepare LSN "
                         f"{row['prepare_lsn']}, {row['changes']} changes")
    origins = status.get("origins") or []
    lines.append(f"  origins seen in the stream: {len(origins)}")
    for row in origins:
        lines.append(f"    {row['origin_name']!r}: origin LSN {row['origin_lsn']}, last applied "
                     f"source commit {row['commit_lsn']} ({row['transactions']} transactions)")
    conflicts = status.get("conflicts") or []
    lines.append(f"  conflicts: {sum(row['count'] for row in conflicts)}")
    for row in conflicts:
        lines.append(f"    {row['table_schema']}.{row['table_name']} {row['conflict_type']} "
                     f"({row['resolution']}): {row['count']}")
    request = status.get("skip_request")
    if request:
        lines.append(f"  skip requested for the transaction finishing at {request['lsn']}")
    skipped = status.get("skipped") or []
    lines.append(f"  skipped transactions: {len(skipped)}")
    for row in skipped:
        lines.append(f"    {row['kind']} at {row['finish_lsn']} xid {row['xid']}: {row['changes']} "
                     f"changes to {', '.join(row['tables']) or 'no table'}")
    messages = status.get("messages")
    if messages:
        lines.append(f"  logical messages stored: {messages['count']} (last LSN {messages['last_lsn']})")
    return "\n".join(lines)


def run_status(settings: Settings) -> int:
    settings.require("target", "slot")
    try:
        status = collect_status(settings.target, settings.slot, settings.values.get("source"))
    except LookupError as exc:
        log.error("%s", exc)
        return 1
    except psycopg.Error as exc:
        log.error("cannot read the status: %s", str(exc).strip())
        return 1
    print(json.dumps(status, default=str, indent=2) if settings.json else format_status(status))
    return 0
