"""Decoder throughput benchmark: our C path, our pure-Python path, and pypgoutput, side by side.

Owns nothing the product uses; it only measures. It starts a throwaway PostgreSQL server
(``applier.embedded``), writes the workloads, captures the messages the server really sends with
``pg_logical_slot_peek_binary_changes`` (5-column inserts, key-changing updates that carry the old
key, and one large transaction streamed in progress), then decodes each workload single-threaded
with every implementation in the same run and prints messages/s and MB/s. pypgoutput
(``pip install .[bench]``) is optional and only decodes what it supports: protocol 1 inserts and
updates.

    .venv/bin/python bench/decoder.py [--messages N] [--repeat R] [--pg-version 15|18]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from applier.embedded import ServerSettings, start_server  # noqa: E402
from applier.protocol.decoder import ACCELERATED, decode, decode_pure  # noqa: E402

try:
    import pypgoutput
except ImportError:
    pypgoutput = None


@dataclass(frozen=True)
class Workload:
    name: str
    messages: list[bytes]
    in_stream: bool
    pypgoutput_class: str | None  # the pypgoutput decoder class for it, if it supports it


_PEEK = ("SELECT data FROM pg_logical_slot_peek_binary_changes('bench', NULL, NULL, "
         "'proto_version', %s, 'publication_names', 'bench', 'streaming', %s)")


def capture_workloads(count: int, major: int) -> list[Workload]:
    """Write the workloads on a scratch server and capture what its walsender code emits."""
    server = start_server(major, ServerSettings.source(), name="bench-decoder")
    try:
        db = server.create_database("bench")
        db.execute("CREATE TABLE orders (id int PRIMARY KEY, note text, placed timestamptz, "
                   "amount numeric(12, 2), paid bool)")
        db.execute("CREATE PUBLICATION bench FOR TABLE orders")
        db.execute("SELECT pg_create_logical_replication_slot('bench', 'pgoutput')")
        db.execute("INSERT INTO orders SELECT g, 'customer ' || g || ' ordered ' || g %% 97 || ' items', "
                   "timestamptz '2024-04-25 10:34:56.123456+00' + g * interval '1.337 ms', "
                   "(g * 7919) %% 1000000 / 100.0, g %% 3 <> 0 FROM generate_series(1, %s) g", (count,))
        db.execute("UPDATE orders SET id = id + 10000000")  # a key change: the old key is sent (K)
        with db.connect() as conn:
            # Whole transactions at commit (protocol 1, as pypgoutput reads them) ...
            conn.execute("SET logical_decoding_work_mem = '1GB'")
            whole = [bytes(row[0]) for row in conn.execute(_PEEK, ("1", "off"))]
            # ... and the same insert transaction streamed in progress (protocol 2).
            conn.execute("SET logical_decoding_work_mem = '64kB'")
            streamed_all = [bytes(row[0]) for row in conn.execute(_PEEK, ("2", "on"))]
    finally:
        server.cleanup()
    inserts = [m for m in whole if m[:1] == b"I"]
    updates = [m for m in whole if m[:1] == b"U"]
    streamed = [m for m in streamed_all if m[:1] in (b"S", b"E", b"I")]
    return [
        Workload("insert", inserts, False, "Insert"),
        Workload("update (old key)", updates, False, "Update"),
        Workload("streamed insert", streamed, True, None),
    ]


def best_rate(run: Callable[[], None], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` passes (the least disturbed by the machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def ours(decoder: Callable[..., object], messages: Sequence[bytes], in_stream: bool) -> Callable[[], None]:
    def run() -> None:
        for data in messages:
            decoder(data, in_stream)
    return run


def theirs(cls: type, messages: Sequence[bytes]) -> Callable[[], None]:
    def run() -> None:
        for data in messages:
            cls(data)
    return run


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000, help="messages per workload")
    parser.add_argument("--repeat", type=int, default=3, help="passes per measurement (best kept)")
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of the server the messages are captured from")
    args = parser.parse_args(argv)

    print(f"capturing {args.messages:,} rows of each workload from PostgreSQL {args.pg_version} ...",
          flush=True)
    workloads = capture_workloads(args.messages, args.pg_version)
    impls: list[tuple[str, Callable[[Workload], Callable[[], None] | None]]] = [
        ("applier C" if ACCELERATED else "applier C (not built)",
         (lambda w: ours(decode, w.messages, w.in_stream)) if ACCELERATED else (lambda w: None)),
        ("applier pure", lambda w: ours(decode_pure, w.messages, w.in_stream)),
        ("pypgoutput" if pypgoutput else "pypgoutput (not installed)",
         lambda w: theirs(getattr(pypgoutput.decoders, w.pypgoutput_class), w.messages)
         if pypgoutput and w.pypgoutput_class else None),
    ]

    print(f"\n{'workload':<18} {'implementation':<27} {'msgs/s':>12} {'MB/s':>8} {'vs pypgoutput':>14}")
    for workload in workloads:
        size_mb = sum(map(len, workload.messages)) / 1e6
        rates: dict[str, float | None] = {}
        for name, make in impls:
            run = make(workload)
            rates[name] = None if run is None else best_rate(run, args.repeat)
        baseline = rates.get("pypgoutput")
        for name, seconds in rates.items():
            if seconds is None:
                print(f"{workload.name:<18} {name:<27} {'-':>12} {'-':>8} {'-':>14}")
                continue
            ratio = f"{baseline / seconds:.1f}x" if baseline else "-"
            print(f"{workload.name:<18} {name:<27} {len(workload.messages) / seconds:>12,.0f} "
                  f"{size_mb / seconds:>8.1f} {ratio:>14}")
    print(f"\n(single thread, best of {args.repeat}; pypgoutput supports protocol 1 "
          "insert/update only)")


if __name__ == "__main__":
    main()
