"""Decoder throughput benchmark: our C path, our pure-Python path, and pypgoutput, side by side.

Owns nothing the product uses; it only measures. It builds a corpus of realistic pgoutput
messages with the tests' encoder (byte for byte what PostgreSQL sends), decodes each workload
single-threaded with every implementation in the same run, and prints messages/s and MB/s.
pypgoutput (``pip install .[bench]``) is optional and only decodes what it supports: protocol 1
inserts and updates.

    .venv/bin/python bench/decoder.py [--messages N] [--repeat R]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "unit"))  # the shared test-side encoder
sys.path.insert(0, str(ROOT))

import pgoutput_builder as pg  # noqa: E402

from applier.protocol.decoder import ACCELERATED, decode, decode_pure  # noqa: E402

try:
    import pypgoutput
except ImportError:
    pypgoutput = None

RELATION_ID = 16_385  # a typical user-table OID
T0 = 767_356_496_123_456  # 2024-04-25 10:34:56.123456 UTC in wire microseconds


@dataclass(frozen=True)
class Workload:
    name: str
    messages: list[bytes]
    in_stream: bool
    pypgoutput_class: str | None  # the pypgoutput decoder class for it, if it supports it


def row(i: int) -> list[pg.Column]:
    """5 columns in text format: int, text, timestamptz, numeric, bool (as the server sends)."""
    micros = T0 + i * 1_337
    seconds, frac = divmod(micros, 1_000_000)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(946_684_800 + seconds))
    return [
        str(1_000_000 + i).encode(),
        f"customer {i} ordered {i % 97} items".encode(),
        f"{stamp}.{frac:06d}+00".encode(),
        f"{(i * 7919) % 1_000_000 / 100:.2f}".encode(),
        b"t" if i % 3 else b"f",
    ]


def build_workloads(count: int) -> list[Workload]:
    inserts = [pg.insert(RELATION_ID, row(i)) for i in range(count)]
    # UPDATE ... SET id = id + 1: the key changed, so the server sends the old key (K part).
    updates = [pg.update(RELATION_ID, row(i + 1), old=[str(1_000_000 + i).encode()] + [None] * 4)
               for i in range(count)]
    xid = 74_211
    streamed = [pg.stream_start(xid, True)]
    streamed += [pg.insert(RELATION_ID, row(i), xid=xid) for i in range(count)]
    streamed.append(pg.stream_stop())
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
    args = parser.parse_args(argv)

    print(f"building {args.messages:,} messages per workload ...", flush=True)
    workloads = build_workloads(args.messages)
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
