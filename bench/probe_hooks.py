"""Counters inside our worker for bench/apply_probe.py: ``python bench/probe_hooks.py run ...``.

Owns nothing the product uses; it only measures. It runs ``applier run`` as ``python -m
applier`` would, with the same order of start-up (the stream first, then the worker), except that
once the worker package is loaded it wraps a few functions to count and time them:

* ``FastPath.commit``: each commit of a fast-path batch, its source transactions and rows, and
  its duration (the commit's round trips);
* ``TargetTransaction.make_durable``: each durable rewrite of the progress row after
  asynchronous commits;
* ``FastPath.send_part``: parts of a batch sent ahead of its commit;
* ``ReplicationStream.read_batch``: reads, empty ones (a pause in the stream), payloads, and the
  time spent in them (waiting for the socket included);
* ``IngestGate.feed``: the time the lane and the assembler take over the payloads.

At exit it writes them as JSON to the file named by ``APPLIER_PROBE_OUT``. ``python
bench/probe_hooks.py --summary FILE...`` prints what such files hold.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STARTED = time.monotonic()
COUNTS: dict[str, Any] = {
    "flushes": [],          # (seconds since start, durable, transactions, rows, seconds taken)
    "flush_wal": [],        # (seconds since start, seconds taken)
    "sent_ahead": 0,
    "reads": 0, "empty_reads": 0, "payloads": 0, "read_seconds": 0.0,
    # empty reads by what the worker held then: "open batch, mid-transaction" and so on
    "empty_by_state": {},
    "feed_seconds": 0.0, "loop_started": None, "loop_seconds": None,
}


def _timed(key: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return func(*args, **kwargs)
        finally:
            COUNTS[key] += time.monotonic() - started
    return wrapper


def _install() -> None:
    """Wrap the worker's functions (the worker package has just been imported)."""
    from applier.apply.fast.path import FastPath
    from applier.apply.transaction import TargetTransaction
    from applier.ingest.gate import IngestGate
    from applier.source.stream import ReplicationStream
    from applier.worker.loop import StreamLoop

    commit = FastPath.commit

    def counted_commit(self: FastPath) -> None:
        if not self.open:
            return commit(self)
        pending = self.tx.pending
        transactions = pending.get("transactions", 0)
        rows = pending["insert"] + pending["update"] + pending["delete"]
        started = time.monotonic()
        try:
            return commit(self)
        finally:
            now = time.monotonic()
            # No batch commit is durable itself any more (2026-11-27): the field stays, so that
            # the summary still reads the files of earlier runs.
            COUNTS["flushes"].append((started - STARTED, False, transactions, rows, now - started))

    make_durable = TargetTransaction.make_durable

    def counted_make_durable(self: TargetTransaction) -> bool:
        started = time.monotonic()
        try:
            return make_durable(self)
        finally:
            COUNTS["flush_wal"].append((started - STARTED, time.monotonic() - started))

    send_part = FastPath.send_part

    def counted_send_part(self: FastPath) -> None:
        if self.batch:
            COUNTS["sent_ahead"] += 1
        return send_part(self)

    read_batch = ReplicationStream.read_batch

    def counted_read_batch(self: ReplicationStream, timeout: float, *args: Any, **kwargs: Any) -> list[bytes]:
        started = time.monotonic()
        batch = read_batch(self, timeout, *args, **kwargs)
        COUNTS["read_seconds"] += time.monotonic() - started
        COUNTS["reads"] += 1
        COUNTS["payloads"] += len(batch)
        if not batch:
            COUNTS["empty_reads"] += 1
            state = _state(sys._getframe(1).f_locals, timeout)
            COUNTS["empty_by_state"][state] = COUNTS["empty_by_state"].get(state, 0) + 1
        return batch

    loop = StreamLoop.run

    def timed_loop(self: StreamLoop) -> None:
        started = time.monotonic()
        if COUNTS["loop_started"] is None:
            COUNTS["loop_started"] = started - STARTED
        try:
            return loop(self)
        finally:
            COUNTS["loop_seconds"] = (COUNTS["loop_seconds"] or 0) + time.monotonic() - started

    FastPath.commit = counted_commit  # type: ignore[method-assign]
    TargetTransaction.make_durable = counted_make_durable  # type: ignore[method-assign]
    FastPath.send_part = counted_send_part  # type: ignore[method-assign]
    ReplicationStream.read_batch = counted_read_batch  # type: ignore[method-assign]
    StreamLoop.run = timed_loop  # type: ignore[method-assign]
    IngestGate.feed = _timed("feed_seconds", IngestGate.feed)  # type: ignore[method-assign]


def _state(loop: dict[str, Any], timeout: float) -> str:
    """What the stream loop (the caller of an empty read) held: an open batch or not, inside a
    source transaction (received in part) or between transactions; and the read's timeout."""
    applier, assembler = loop.get("applier"), loop.get("assembler")
    if applier is None or assembler is None:
        return f"outside the stream loop, timeout {timeout:g}"
    batch = "batch open" if applier.holds_uncommitted else "no batch open"
    where = "between transactions" if assembler.between_transactions else "inside a transaction"
    # Rounded: the batch's wait and the quiet before a durable rewrite are whatever is left of
    # them, a different float at nearly every read.
    return f"{batch}, {where}, timeout {round(timeout, 2):g}"


def _write() -> None:
    out = os.environ.get("APPLIER_PROBE_OUT")
    if out:
        COUNTS["exit"] = time.monotonic() - STARTED
        Path(out).write_text(json.dumps(COUNTS))


def summary(counts: dict[str, Any], since: float = 0.0) -> list[str]:
    """What one run's counters say, in a few lines (commits and reads from ``since`` seconds
    after the start on)."""
    flushes = [f for f in counts["flushes"] if f[0] >= since]
    durable = [f for f in flushes if f[1]]
    rewrites = [f for f in counts["flush_wal"] if f[0] >= since]
    lines = [f"stream loop from {counts['loop_started'] or 0:.3f} s for {counts['loop_seconds'] or 0:.3f} s; "
             f"exit at {counts.get('exit', 0):.3f} s",
             f"batch commits {len(flushes)}"
             + (f" ({len(durable)} durable, at a pause in the stream)" if durable else "")
             + f", {sum(f[4] for f in flushes):.3f} s in them"
             + (f" ({sum(f[4] for f in durable):.3f} s in the durable ones)" if durable else "")
             + f"; parts sent ahead {counts['sent_ahead']}",
             f"durable progress rewrites (flush_wal) {len(rewrites)}, "
             f"{sum(f[1] for f in rewrites):.3f} s in them"]
    if flushes:
        txs = sorted(f[2] for f in flushes)
        took = sorted(f[4] for f in flushes)
        lines.append(f"source transactions per batch: median {txs[len(txs) // 2]}, mean "
                     f"{sum(txs) / len(txs):.1f}, min {txs[0]}, max {txs[-1]}; commit time per batch: "
                     f"median {took[len(took) // 2] * 1000:.2f} ms, max {took[-1] * 1000:.2f} ms")
    lines.append(f"reads {counts['reads']} ({counts['empty_reads']} empty), {counts['payloads']} "
                 f"payloads, {counts['read_seconds']:.3f} s in reads; lane and assembler "
                 f"{counts['feed_seconds']:.3f} s")
    for state, n in sorted(counts.get("empty_by_state", {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"  empty reads with {state}: {n}")
    return lines


def main() -> int:
    if sys.argv[1:2] == ["--summary"]:
        for name in sys.argv[2:]:
            print(name)
            for line in summary(json.loads(Path(name).read_text())):
                print(f"  {line}")
        return 0
    from applier import cli

    def run(settings: Any) -> int:
        with cli._start_up():
            from applier.headstart import start_early
        head_start = start_early(settings)
        with cli._start_up():
            from applier.worker import run as worker_run
            _install()
        return worker_run(settings, head_start)

    cli._run = run  # type: ignore[assignment]
    atexit.register(_write)
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
