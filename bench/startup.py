"""Start-up of ``applier run``: from process start until the stream loop runs, with nothing to do.

Owns nothing the product uses; it only measures. One source and one target server (throwaway,
``applier.embedded``, bench/apply.py's settings), one table in a publication, a slot per
contender and the bookkeeping schema already created on its target database (as after the first
start). Each run starts ``applier run --exit-when-caught-up`` through ``bench/probe_hooks.py`` of
the contender's checkout, which notes when the stream loop starts and when the process ends; with
nothing to apply, that is the fixed cost every drain of bench/apply.py pays before its first row.
The contenders take turns, so that both meet the same machine; the figures are medians (and the
fastest run) over ``--runs``. The applier package of each checkout is byte-compiled first, as an
installed wheel is.

    .venv/bin/python bench/startup.py [--runs 15] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_drain import bookkeeping  # noqa: E402
from apply_measure import load_average  # noqa: E402
from apply_workloads import SOURCE_SETTINGS, TARGET_SETTINGS  # noqa: E402

from applier.embedded import start_server  # noqa: E402


def _run(tree: Path, source_dsn: str, target_dsn: str, slot: str) -> tuple[float, float, float]:
    """One start: (stream loop started, process exited by its own clock, exited by ours), seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        started = time.monotonic()
        subprocess.run([sys.executable, str(tree / "bench" / "probe_hooks.py"), "run",
                        "--source", source_dsn, "--target", target_dsn, "--slot", slot,
                        "--publication", "bench", "--exit-when-caught-up", "--log-level", "WARNING"],
                       cwd=tree, env={**os.environ, "APPLIER_PROBE_OUT": out.name}, check=True)
        elapsed = time.monotonic() - started
        counts = json.loads(Path(out.name).read_text())
    return counts["loop_started"], counts["exit"], elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="starts per contender (default 15)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also the applier of the checkout in DIR (its C accelerators built in "
                             "place), taking turns with this one")
    args = parser.parse_args()
    trees = {"applier": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    for tree in trees.values():
        compileall.compile_dir(str(tree / "applier"), quiet=1)
    print(f"load average at the start: {load_average()}", flush=True)
    source_server = start_server(18, SOURCE_SETTINGS, name="bench-start-src")
    target_server = start_server(18, TARGET_SETTINGS, name="bench-start-tgt")
    try:
        source = source_server.create_database("bench")
        source.execute("CREATE TABLE items (id int PRIMARY KEY, v int)")
        source.execute("CREATE PUBLICATION bench FOR TABLE items")
        targets = {}
        for name, tree in trees.items():
            target = targets[name] = target_server.create_database(f"bench_{name}")
            target.execute("CREATE TABLE items (id int PRIMARY KEY, v int)")
            bookkeeping(target.dsn, tree)
            source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"start_{name}",))
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():
                results[name].append(_run(tree, source.dsn, targets[name].dsn, f"start_{name}"))
    finally:
        source_server.cleanup()
        target_server.cleanup()
    print(f"medians (fastest) of {args.runs} starts, seconds; load average at the end: {load_average()}")
    print(f"{'contender':<10} {'stream loop':>18} {'exit (own clock)':>18} {'exit (ours)':>18}")
    for name, runs in results.items():
        cells = [f"{statistics.median(column):.3f} ({min(column):.3f})" for column in zip(*runs)]
        print(f"{name:<10} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
