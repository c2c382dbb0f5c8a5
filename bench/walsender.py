"""The walsender's CPU against the subscriber's reading rhythm, with no apply at all.

Owns nothing the product uses; it only measures. One throwaway PostgreSQL source
(``applier.embedded``, the settings of ``bench/apply.py``). For each run it writes one of
``bench/apply.py``'s backlogs (the 100,000 single-row transactions by default) with one slot per
rhythm, then drains every slot with a bare reader that decodes and applies nothing: one reads each
message as it arrives (waits on the socket and reads at once, as ``read_batch`` does), the others
wait for the socket, sleep a few milliseconds, then read whatever has arrived. It prints, per
rhythm, the walsender's CPU seconds and the drain's duration. The walsender is one process and
bounds any subscriber's drain of such a backlog; how it turns messages into TCP segments depends on
the congestion control of the machine (printed) and on when the reader reads (README,
"Why runs differ"). With ``--unix-socket`` the reader takes the stream through the source's
Unix-domain socket instead, where there are no segments and no congestion window.

    .venv/bin/python bench/walsender.py [--workload small] [--pauses 0.5,1,2,5] [--repeat 3]
                                        [--unix-socket]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import statistics
import sys
import termios
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply import (SOURCE_SETTINGS, Workload, _pgbench, _with_work_mem,  # noqa: E402
                   stream_dsn, stream_protocol, transport, workloads)

from applier.embedded import Database, start_server  # noqa: E402
from applier.protocol.lsn import LSN  # noqa: E402
from applier.source.options import StreamOptions  # noqa: E402
from applier.source.stream import ReplicationStream  # noqa: E402

AS_IT_ARRIVES = 0.0


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a local process; None where the server is not a local process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _available(sock: int) -> int:
    waiting = bytearray(4)
    fcntl.ioctl(sock, termios.FIONREAD, waiting)
    return int.from_bytes(waiting, sys.byteorder)


def drain(source: Database, source_dsn: str, slot: str, work_mem: str, end: LSN, pause: float,
          pg_version: int) -> tuple[float, float | None]:
    """(seconds, walsender CPU seconds) to receive everything up to ``end`` from ``slot``,
    reading as it arrives (``pause`` 0) or ``pause`` seconds after the socket became readable.
    The stream options are our worker's defaults for that server version, binary values included."""
    proto, streaming = stream_protocol(pg_version)
    options = StreamOptions(("bench",), proto, streaming, False, True, False, None)
    stream = ReplicationStream(_with_work_mem(source_dsn, work_mem), slot, options)
    conn = stream.connect()
    try:
        started = time.monotonic()
        stream.start(LSN(0))
        walsender = source.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                 (slot,))[0][0]
        sock = conn.pgconn.socket
        while max(stream.keepalive_wal_end, LSN(stream.last_start)) < end:
            if pause == AS_IT_ARRIVES:
                stream.read_batch(1.0, limit=100_000)
                continue
            select.select([sock], [], [], 1.0)
            time.sleep(pause)
            while _available(sock):
                conn.pgconn.consume_input()
            stream.read_batch(0.0, limit=10_000_000)
        return time.monotonic() - started, _cpu_seconds(walsender)
    finally:
        stream.close()


def _backlog(workload: Workload, db: Database, slots: Sequence[str]) -> LSN:
    if workload.pgbench_init:
        _pgbench(db, "-i", "-s", "1", "-q")
    if workload.setup_sql:
        db.execute(workload.setup_sql)
    db.execute(f"CREATE PUBLICATION bench FOR TABLE {', '.join(workload.tables)}")
    for slot in slots:
        db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    workload.write(db)
    end = LSN.parse(db.query("SELECT pg_current_wal_lsn()::text")[0][0])
    db.execute("CHECKPOINT")
    return end


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="small",
                        help="name prefix of one of bench/apply.py's workloads (default: small)")
    parser.add_argument("--pauses", default="0.5,1,2,5",
                        help="comma-separated milliseconds to wait after the socket is readable, "
                             "besides reading as it arrives (default 0.5,1,2,5)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs, each on a fresh backlog (default 3)")
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of the source (default 18)")
    parser.add_argument("--unix-socket", action="store_true",
                        help="read the stream through the source's Unix-domain socket instead of "
                             "TCP on 127.0.0.1; needs the binaries backend, not containers")
    args = parser.parse_args(argv)
    workload = next((w for w in workloads(1.0) if w.name.startswith(args.workload)), None)
    if workload is None:
        parser.error(f"no workload named {args.workload!r}; see bench/apply.py")
    pauses = [AS_IT_ARRIVES] + [float(p) / 1000 for p in args.pauses.split(",") if p.strip()]
    print(f"starting PostgreSQL {args.pg_version} ({os.cpu_count()} cores, "
          f"{transport(args.unix_socket)}) ...", flush=True)
    server = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-walsender",
                          unix_socket=args.unix_socket)
    results: dict[float, list[tuple[float, float | None]]] = {p: [] for p in pauses}
    try:
        for run in range(args.repeat):
            db = server.create_database(f"bench_walsender_{run}")
            slots = [f"rhythm_{i}" for i in range(len(pauses))]
            print(f"run {run + 1}: writing {workload.name} ...", flush=True)
            end = _backlog(workload, db, slots)
            for slot, pause in zip(slots, pauses):
                results[pause].append(drain(db, stream_dsn(db, args.unix_socket), slot,
                                            workload.decoding_work_mem, end, pause, args.pg_version))
            server.drop_database(db.name)
    finally:
        server.cleanup()
    print(f"\n{workload.name}: walsender CPU seconds per run, and the median drain")
    for pause, runs in results.items():
        rhythm = "as it arrives" if pause == AS_IT_ARRIVES else f"every {pause * 1000:g} ms"
        cpu = ", ".join("n/a" if c is None else f"{c:.2f}" for _, c in runs)
        print(f"  {rhythm:<15} walsender CPU {cpu:<30} drain {statistics.median(s for s, _ in runs):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
