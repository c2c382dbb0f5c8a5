"""The leanest applier outside the target server: a floor for replication lag (bench only).

``bench/apply.py --sustained --floor`` runs it as one more contender. It reads the slot with our
stream reader and decoder and applies each source transaction the moment its Commit arrives, as
PostgreSQL's own subscriber does: one target transaction per source transaction, sent as one
pipeline (BEGIN, one prepared statement per change, COMMIT, a sync point), with
``synchronous_commit = off``. It keeps no progress row, checks no row count, batches nothing and
does not wait for one transaction's result before sending the next (its results are read as they
come back), and confirms each commit to the slot as soon as it is sent (unsafe; acceptable for a
measurement). So no worker of ours that takes the hop through a client process can have less lag
than this one on the same machine: what is left between it and the native subscriber is the hop.

It handles what ``bench/apply_sustained.py`` streams (inserts, updates and deletes of tables with
a primary key, text values); it is not a product and must not be used as one.

    python bench/lag_floor.py --source DSN --target DSN --slot NAME --publication NAME
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass

import psycopg
from psycopg import pq, sql

from applier.protocol.decoder import decode
from applier.protocol.lsn import LSN
from applier.protocol.messages import Commit, Delete, Insert, Relation, TupleData, Update
from applier.source.options import StreamOptions
from applier.source.stream import ReplicationStream


@dataclass(frozen=True)
class _Table:
    insert: bytes   # names of prepared statements
    update: bytes
    delete: bytes
    key: tuple[int, ...]


def _table(msg: Relation, type_names: dict[int, str], conn: psycopg.Connection, serial: int) -> _Table:
    """Prepare the three statements of one relation (every column set, the key columns matched)
    in the pipeline; their names (``serial`` tells apart a relation described again)."""
    name = sql.Identifier(msg.namespace, msg.name)
    columns = [sql.Identifier(c.name) for c in msg.columns]
    n = len(columns)
    casts = [sql.SQL(f"${i + 1}::{{}}").format(sql.SQL(type_names[c.type_oid])) for i, c in enumerate(msg.columns)]
    key = tuple(i for i, c in enumerate(msg.columns) if c.flags & 1)
    # An update's key values follow its n new values: $n+1...
    match = sql.SQL(" AND ").join(
        sql.SQL("{} = ${}::{}").format(columns[i], sql.SQL(str(n + j + 1)),
                                       sql.SQL(type_names[msg.columns[i].type_oid]))
        for j, i in enumerate(key))
    delete_match = sql.SQL(" AND ").join(
        sql.SQL("{} = ${}::{}").format(columns[i], sql.SQL(str(j + 1)),
                                       sql.SQL(type_names[msg.columns[i].type_oid]))
        for j, i in enumerate(key))
    statements = {
        "i": sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            name, sql.SQL(", ").join(columns), sql.SQL(", ").join(casts)),
        "u": sql.SQL("UPDATE {} SET {} WHERE {}").format(name, sql.SQL(", ").join(
            sql.SQL("{} = {}").format(c, v) for c, v in zip(columns, casts, strict=True)), match),
        "d": sql.SQL("DELETE FROM {} WHERE {}").format(name, delete_match),
    }
    if not key:  # pgbench_history: only inserted
        del statements["u"], statements["d"]
    names = dict.fromkeys("iud", b"")
    for kind, statement in statements.items():
        names[kind] = f"floor_{kind}_{serial}".encode()
        conn.pgconn.send_prepare(names[kind], statement.as_string(conn).encode())
    return _Table(names["i"], names["u"], names["d"], key)


def _text(row: TupleData) -> list[bytes | None]:
    return [v if isinstance(v, bytes) else None for v in row.values]


class _Results:
    """Reads the target's results as they come back, never waiting for them: each source
    transaction is sent as soon as it commits, whether or not the one before has returned."""

    def __init__(self, pgconn: pq.abc.PGconn) -> None:
        self.pgconn = pgconn
        self.syncs = 0   # sync points sent and not read back

    def read(self, wait: bool = False) -> None:
        pgconn = self.pgconn
        pgconn.flush()
        while self.syncs:
            if not wait:
                pgconn.consume_input()
                if pgconn.is_busy():
                    return
            result = pgconn.get_result()
            if result is None:
                continue
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                self.syncs -= 1
            elif result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
                raise SystemExit("lag_floor: the target failed: "
                                 + (result.error_message or b"").decode(errors="replace"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the source database (replication is asked for)")
    parser.add_argument("--target", required=True, help="the target database")
    parser.add_argument("--slot", required=True, help="an existing pgoutput slot")
    parser.add_argument("--publication", required=True, help="the publication to stream")
    args = parser.parse_args()
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))

    target = psycopg.connect(args.target, autocommit=True)
    target.execute("SET synchronous_commit = off")
    type_names = {oid: name for oid, name in target.execute(
        "SELECT oid::int, format('%I.%I', typnamespace::regnamespace, typname) FROM pg_catalog.pg_type")}
    pgconn = target.pgconn
    pgconn.enter_pipeline_mode()
    results = _Results(pgconn)
    stream = ReplicationStream(args.source, args.slot, StreamOptions(
        (args.publication,), 1, "off", False, False, False, None), status_interval=1.0)
    stream.connect()
    stream.start(LSN(0))
    tables: dict[int, _Table] = {}
    described: list[int] = []
    changes: list[tuple[bytes, list[bytes | None]]] = []
    while not stopping:
        for payload in stream.read_batch(timeout=0.2):
            msg = decode(payload)
            if isinstance(msg, Relation):
                tables[msg.relation_id] = _table(msg, type_names, target, len(described))
                described.append(msg.relation_id)
            elif isinstance(msg, Insert):
                changes.append((tables[msg.relation_id].insert, _text(msg.new_tuple)))
            elif isinstance(msg, Update):
                table = tables[msg.relation_id]
                key = _text(msg.old_tuple or msg.new_tuple)
                changes.append((table.update, _text(msg.new_tuple) + [key[i] for i in table.key]))
            elif isinstance(msg, Delete):
                table = tables[msg.relation_id]
                key = _text(msg.old_tuple)
                changes.append((table.delete, [key[i] for i in table.key]))
            elif isinstance(msg, Commit):
                pgconn.send_query_params(b"BEGIN", None)
                for statement, values in changes:
                    pgconn.send_query_prepared(statement, values)
                pgconn.send_query_params(b"COMMIT", None)
                pgconn.pipeline_sync()
                results.syncs += 1
                changes.clear()
                stream.confirm(msg.end_lsn)  # as sent, not as committed: a floor, not an applier
        results.read()
    results.read(wait=True)
    stream.send_status()
    stream.close()
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
