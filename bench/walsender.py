"""The walsender's CPU against the subscriber's reading rhythm, with no apply at all.

Owns nothing the product uses; it only measures. One throwaway PostgreSQL source
(``applier.embedded``, the settings of ``bench/apply.py``). For each run it writes one of
``bench/apply.py``'s backlogs (the 100,000 single-row transactions by default) with one slot per
rhythm, then drains every slot with a bare reader that decodes and applies nothing: one reads each
message as it arrives (waits on the socket and reads at once, as ``read_batch`` does), the others
wait for the socket, sleep a few milliseconds, then read whatever has arrived. With
``--start-delays`` further drains read nothing for that long after START_REPLICATION (as a
subscriber that is still loading) and then every millisecond. It prints, per rhythm, the
walsender's CPU seconds, the drain's duration, and the machine's TCP loss probes and retransmitted
segments during the drain (counters of the whole machine, from /proc/net: nothing else should be
running). The walsender is one process and bounds any subscriber's drain of such a backlog; how it
turns messages into TCP segments depends on the congestion control of the machine (printed) and on
when the reader reads (README, "Why runs differ"). With ``--unix-socket`` the reader takes the
stream through the source's Unix-domain socket instead, where there are no segments and no
congestion window.

    .venv/bin/python bench/walsender.py [--workload small] [--pauses 0.5,1,2,5] [--repeat 3]
                                        [--start-delays 0,100] [--unix-socket]
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_workloads import (  # noqa: E402
    MARKER_TABLE,
    SOURCE_SETTINGS,
    Workload,
    _with_work_mem,
    prepare,
    published_tables,
    stream_dsn,
    stream_protocol,
    transport,
    workloads,
)

from applier.embedded import Database, start_server  # noqa: E402
from applier.protocol.lsn import LSN  # noqa: E402
from applier.source.options import StreamOptions  # noqa: E402
from applier.source.stream import ReplicationStream  # noqa: E402

AS_IT_ARRIVES = 0.0
#: The pause of the drains that begin after a delay: every millisecond, a rhythm that mostly
#: keeps the walsender in its cheap case when there is no delay (README, "Why runs differ").
_AFTER_DELAY_PAUSE = 0.001


@dataclass(frozen=True)
class Rhythm:
    """How a drain reads: ``pause`` seconds after the socket became readable (0: at once), after
    reading nothing for ``delay`` seconds from START_REPLICATION."""

    pause: float
    delay: float = 0.0

    def __str__(self) -> str:
        every = "as it arrives" if self.pause == AS_IT_ARRIVES else f"every {self.pause * 1000:g} ms"
        return every if not self.delay else f"{every} after {self.delay * 1000:g} ms"


@dataclass(frozen=True)
class Drained:
    """One drain: its duration, the walsender's CPU, and the machine's TCP loss probes and
    retransmitted segments meanwhile (None where they cannot be read)."""

    seconds: float
    walsender_cpu: float | None
    loss_probes: int | None
    retransmitted: int | None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a local process; None where the server is not a local process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tcp_counters() -> tuple[int, int] | None:
    """(TCP loss probes, retransmitted segments) of the whole machine so far; None where /proc
    does not have them."""
    def table(path: str) -> dict[str, str]:
        lines = Path(path).read_text().splitlines()
        values: dict[str, str] = {}
        for names, numbers in zip(lines[::2], lines[1::2]):
            prefix = names.split(":", 1)[0]
            values.update((f"{prefix}.{n}", v) for n, v in zip(names.split()[1:], numbers.split()[1:]))
        return values
    try:
        counters = table("/proc/net/netstat") | table("/proc/net/snmp")
        return int(counters["TcpExt.TCPLossProbes"]), int(counters["Tcp.RetransSegs"])
    except (OSError, KeyError, ValueError):
        return None


def _available(sock: int) -> int:
    waiting = bytearray(4)
    fcntl.ioctl(sock, termios.FIONREAD, waiting)
    return int.from_bytes(waiting, sys.byteorder)


def drain(source: Database, source_dsn: str, slot: str, work_mem: str, end: LSN, rhythm: Rhythm,
          pg_version: int) -> Drained:
    """Receive everything up to ``end`` from ``slot`` in ``rhythm``. The stream options are our
    worker's defaults for that server version, binary values included."""
    proto, streaming = stream_protocol(pg_version)
    options = StreamOptions(("bench",), proto, streaming, False, True, False, None)
    stream = ReplicationStream(_with_work_mem(source_dsn, work_mem), slot, options)
    conn = stream.connect()
    try:
        before = _tcp_counters()
        started = time.monotonic()
        stream.start(LSN(0))
        walsender = source.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                 (slot,))[0][0]
        sock = conn.pgconn.socket
        time.sleep(rhythm.delay)
        pause = rhythm.pause
        while max(stream.keepalive_wal_end, LSN(stream.last_start)) < end:
            if pause == AS_IT_ARRIVES:
                stream.read_batch(1.0, limit=100_000)
                continue
            select.select([sock], [], [], 1.0)
            time.sleep(pause)
            while _available(sock):
                conn.pgconn.consume_input()
            stream.read_batch(0.0, limit=10_000_000)
        seconds = time.monotonic() - started
        after = _tcp_counters()
        probes, retransmitted = ((a - b for a, b in zip(after, before)) if before and after
                                 else (None, None))
        return Drained(seconds, _cpu_seconds(walsender), probes, retransmitted)
    finally:
        stream.close()


def _backlog(workload: Workload, db: Database, slots: Sequence[str]) -> LSN:
    prepare(workload, db)
    db.execute(f"CREATE PUBLICATION bench FOR TABLE {', '.join(published_tables(workload))}")
    for slot in slots:
        db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    workload.write(db)
    if workload.marker:
        db.execute(f"INSERT INTO {MARKER_TABLE} VALUES (1)")
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
    parser.add_argument("--start-delays", default="",
                        help="comma-separated milliseconds: for each, one more drain that reads "
                             "nothing for that long after START_REPLICATION (as a subscriber "
                             "still loading), then reads every 1 ms (default: none; 0 is the "
                             "1 ms rhythm itself)")
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
    rhythms = list(dict.fromkeys(  # in order, each once (a delay of 0 may repeat a pause of 1)
        [Rhythm(AS_IT_ARRIVES)]
        + [Rhythm(float(p) / 1000) for p in args.pauses.split(",") if p.strip()]
        + [Rhythm(_AFTER_DELAY_PAUSE, float(d) / 1000) for d in args.start_delays.split(",") if d.strip()]))
    print(f"starting PostgreSQL {args.pg_version} ({os.cpu_count()} cores, "
          f"{transport(args.unix_socket)}) ...", flush=True)
    server = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-walsender",
                          unix_socket=args.unix_socket)
    results: dict[Rhythm, list[Drained]] = {r: [] for r in rhythms}
    try:
        for run in range(args.repeat):
            db = server.create_database(f"bench_walsender_{run}")
            slots = [f"rhythm_{i}" for i in range(len(rhythms))]
            print(f"run {run + 1}: writing {workload.name} ...", flush=True)
            end = _backlog(workload, db, slots)
            for slot, rhythm in zip(slots, rhythms):
                results[rhythm].append(drain(db, stream_dsn(db, args.unix_socket), slot,
                                             workload.decoding_work_mem, end, rhythm,
                                             args.pg_version))
            server.drop_database(db.name)
    finally:
        server.cleanup()
    print(f"\n{workload.name}: walsender CPU seconds and TCP loss probes / retransmitted "
          f"segments per run, and the median drain")
    for rhythm, runs in results.items():
        cpu = ", ".join("n/a" if r.walsender_cpu is None else f"{r.walsender_cpu:.2f}" for r in runs)
        losses = ", ".join("n/a" if r.loss_probes is None else f"{r.loss_probes}/{r.retransmitted}"
                           for r in runs)
        print(f"  {str(rhythm):<26} walsender CPU {cpu:<24} probes/retrans {losses:<20} "
              f"drain {statistics.median(r.seconds for r in runs):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
