"""Apply throughput: applier against PostgreSQL's own subscriber, draining the same backlog.

Owns nothing the product uses; it only measures. One source and one target server (throwaway,
``applier.embedded``, the same settings for both contenders). For each workload it prepares a
fresh source database and two identical target databases, creates two slots at the same point,
writes the workload on the source (the backlog accumulates in both slots), then drains one slot
with ``applier run --exit-when-caught-up`` and the other with a native ``CREATE SUBSCRIPTION``
(``copy_data = false`` on the pre-made slot), verifies both targets equal the source, and prints
elapsed time, rows/s, transactions/s, ours/native, our worker's peak memory, and two physical
limits: the source's (decoding the same backlog from a third slot with
``pg_logical_slot_get_binary_changes``, sending and applying nothing) and the target's (binary
COPY of the same rows). It also prints the CPU time each contender's drain cost the source's and
the target's server processes (the source's is almost all one walsender, a single process, so it
is a floor for the drain time of any subscriber) and our worker process's own. The applier
package is byte-compiled first, as an installed wheel is.

The multi-client workloads (pgbench TPC-B at scale 10 from 1, 4 and 8 clients, 50,000
transactions in all) also print a detailed table: time until the last row is visible on the
target, until the slot confirms the end of the backlog, the machine's busy cores, our worker's
CPU, and a third drain of the same backlog by ``pg_recvlogical`` into /dev/null (the walsender
alone). ``--sustained`` instead measures replication lag while pgbench writes at fixed rates
(``apply_sustained.py``).

Each contender runs with its defaults: applier asks for binary values (``--binary auto``: every
table here has the same built-in types on both sides), the native subscription for text
(``binary = false``) unless ``--native-binary``. Both reach the source over TCP on 127.0.0.1, or
both through a Unix-domain socket with ``--unix-socket`` (README, "A source on the same host").

``--catchup`` instead runs the catch-up drain of issue 39's independent harness (``apply_catchup.py``):
production settings, the same servers and databases run after run, pgbench with ``-M prepared``
and a keyed history table, each contender a new process (or ENABLE) timed from its start.

``--change-feed`` adds a drain of ours with ``--change-feed all``, printed as ``+feed`` with its
time over our plain drain's: what recording every change in the change feed costs. With
``--baseline`` too, the baseline's worker drains with it as well (``base+feed``).

The modules: ``apply_workloads.py`` (settings, workloads, helpers), ``apply_measure.py`` (CPU and
load from /proc), ``apply_drain.py`` (the drains and their tables), ``apply_sustained.py``.

    .venv/bin/python bench/apply.py [--pg-version 18] [--scale 1.0] [--only oltp,bulk,...] [--repeat 3]
                                    [--native-binary] [--unix-socket] [--change-feed]
    .venv/bin/python bench/apply.py --sustained [--rates 2000,5000,10000] [--duration 60] [--clients 4]
    .venv/bin/python bench/apply.py --catchup [--catchup-scales 10,50] [--catchup-clients 4,8] [--repeat 3]
        [--catchup-without-lane]
"""

from __future__ import annotations

import argparse
import compileall
import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_catchup import run_catchup  # noqa: E402
from apply_drain import Run, medians, print_table, run_workload  # noqa: E402
from apply_measure import load_average  # noqa: E402
from apply_sustained import parse_rates, run_sustained  # noqa: E402
from apply_workloads import SOURCE_SETTINGS, TARGET_SETTINGS, Workload, transport, workloads  # noqa: E402

from applier.embedded import start_server  # noqa: E402


def _commit() -> str:
    """The checked-out commit, for the header (and "+ changes" when the tree is not clean)."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def _experiment(parser: argparse.ArgumentParser, text: str) -> tuple[str, dict[str, str]]:
    """``--experiment LABEL:NAME=VALUE;...`` as (label, environment)."""
    label, _, assignments = text.partition(":")
    try:
        env = dict(part.split("=", 1) for part in assignments.split(";") if part)
    except ValueError:
        parser.error(f"--experiment {text!r}: expected LABEL:NAME=VALUE;...")
    if not label or not env:
        parser.error(f"--experiment {text!r}: expected LABEL:NAME=VALUE;...")
    return label, env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-version", type=int, choices=(15, 18), default=18,
                        help="PostgreSQL major version of both servers (default 18; 15 streams with "
                             "protocol 3, 18 with protocol 4 and parallel streaming)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every workload's size (1.0 = the sizes in the issue; the "
                             "multi-client workloads keep pgbench scale 10)")
    parser.add_argument("--only", default="",
                        help="comma-separated workload name prefixes, e.g. 'oltp,small', or "
                             "'pgbench 4,pgbench 8' for the multi-client drains (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each workload (with --sustained: each contender's rates) this many "
                             "times, on fresh databases each time, and report the median of every "
                             "figure: one run on a shared machine varies")
    parser.add_argument("--native-binary", action="store_true",
                        help="create the native subscription WITH (binary = true); its default is "
                             "false, while applier asks for binary values by default (--binary "
                             "auto) when, as here, every table has the same built-in types")
    parser.add_argument("--unix-socket", action="store_true",
                        help="both contenders stream from the source through its Unix-domain socket "
                             "instead of TCP on 127.0.0.1 (a subscriber on the source's own host); "
                             "needs the binaries backend, not containers")
    parser.add_argument("--sustained", action="store_true",
                        help="instead of the drains: start each contender, let it catch up, then "
                             "have pgbench write TPC-B (scale 10) at each of --rates for --duration "
                             "seconds, and print the replication lag (heartbeat row written every "
                             "50 ms on the source, read every 100 ms on the target), the source's "
                             "achieved tps and CPU seconds per 1,000 transactions")
    parser.add_argument("--rates", default="2000,5000,10000",
                        help="with --sustained: comma-separated transactions per second pgbench is "
                             "held to (pgbench --rate); 'max' for no limit, the most the source "
                             "sustains (default 2000,5000,10000)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="with --sustained: seconds pgbench writes at each rate (default 60)")
    parser.add_argument("--clients", type=int, default=4,
                        help="with --sustained: pgbench clients (and threads) writing at once "
                             "(default 4)")
    parser.add_argument("--worker-hooks", type=Path, metavar="DIR",
                        help="run our worker through bench/probe_hooks.py, which counts and times "
                             "its batch commits, durable flushes and reads, and keep its counters "
                             "in DIR, one JSON file per run (read them with bench/probe_hooks.py "
                             "--summary); adds a little of its own time")
    parser.add_argument("--experiment", action="append", default=[], metavar="LABEL:NAME=VALUE;...",
                        help="with --sustained: one more contender, our worker with these variables "
                             "in its environment, shown as applier[LABEL]; for trying a change to "
                             "the worker that a variable switches on, in the same run as the code "
                             "without it (repeatable)")
    parser.add_argument("--floor", action="store_true",
                        help="with --sustained: one more contender, 'hop floor' (bench/lag_floor.py): "
                             "each source transaction sent as its commit arrives, in a pipeline never "
                             "waited on, with no progress row, row count check or batching; the least lag "
                             "a worker outside the target server can have on this machine")
    parser.add_argument("--change-feed", action="store_true",
                        help="one more contender, printed as '+feed': our worker with --change-feed "
                             "all (every table's changes also recorded in its change table), with its "
                             "time over our plain drain's (and, with --baseline, the baseline's too, "
                             "'base+feed')")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="one more contender, printed as 'baseline': the applier of the checkout "
                             "in DIR (another commit, its C accelerators built in place with "
                             "'python setup.py build_ext --inplace'), run with this interpreter, so "
                             "that a change is measured against the code before it in one run")
    parser.add_argument("--catchup", action="store_true",
                        help="instead of the drains: the catch-up after downtime of issue 39 "
                             "(apply_catchup.py): production settings, the same servers run after "
                             "run, contenders alternating, each timed from its process start (or "
                             "ENABLE) until the last row is visible and the slot confirmed the end")
    parser.add_argument("--catchup-scales", default="10",
                        help="with --catchup: comma-separated pgbench scales (default 10)")
    parser.add_argument("--catchup-clients", default="4",
                        help="with --catchup: comma-separated pgbench client counts (default 4)")
    parser.add_argument("--catchup-without-lane", action="store_true",
                        help="with --catchup: one more contender, 'no lane': our worker with the C "
                             "lane turned off (APPLIER_PURE_PYTHON=apply._lane), the decoder and "
                             "the other accelerators on; what the lane gains on these drains")
    args = parser.parse_args(argv)
    if args.catchup:
        compileall.compile_dir(str(ROOT / "applier"), quiet=1)
        print(f"catch-up drains on PostgreSQL {args.pg_version} ({os.cpu_count()} cores, commit "
              f"{_commit()}; load average {load_average()})", flush=True)
        ok = run_catchup(args.pg_version, [int(s) for s in args.catchup_scales.split(",")],
                         [int(c) for c in args.catchup_clients.split(",")], max(args.repeat, 1),
                         without_lane=args.catchup_without_lane)
        return 0 if ok else 1
    if args.baseline is not None and not (args.baseline / "applier" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no applier checkout there")
    experiments = [_experiment(parser, text) for text in args.experiment]
    if args.worker_hooks is not None:
        args.worker_hooks.mkdir(parents=True, exist_ok=True)
    chosen = [w for w in workloads(args.scale)
              if not args.only or any(w.name.startswith(p.strip()) for p in args.only.split(","))]
    # An installed wheel has its bytecode; a checkout may not (PYTHONDONTWRITEBYTECODE), and
    # compiling at every start would be measured as our start-up.
    compileall.compile_dir(str(ROOT / "applier"), quiet=1)
    print(f"starting PostgreSQL {args.pg_version} source and target ({os.cpu_count()} cores, "
          f"{transport(args.unix_socket)}; commit {_commit()}; load average {load_average()}) ...",
          flush=True)
    source_server = start_server(args.pg_version, SOURCE_SETTINGS, name="bench-apply-src",
                                 unix_socket=args.unix_socket)
    target_server = start_server(args.pg_version, TARGET_SETTINGS, name="bench-apply-tgt")
    rows: list[tuple[Workload, Run]] = []
    try:
        if args.sustained:
            ok = run_sustained(source_server, target_server, parse_rates(args.rates), args.duration,
                               args.clients, args.repeat, args.unix_socket, args.worker_hooks,
                               experiments, args.baseline, args.floor)
            print(f"load average at the end: {load_average()}")
            return 0 if ok else 1
        index = 0
        for workload in chosen:
            print(f"{workload.name}: {workload.rows:,} row changes in {workload.transactions:,} transactions",
                  flush=True)
            runs = []
            for _ in range(args.repeat):
                runs.append(run_workload(workload, source_server, target_server, index, args.pg_version,
                                         args.native_binary, args.unix_socket, args.worker_hooks,
                                         args.baseline, args.change_feed))
                index += 1
            rows.append((workload, medians(runs)))
    finally:
        source_server.cleanup()
        target_server.cleanup()
    ok = print_table(rows, args.repeat, args.native_binary)
    print(f"load average at the end: {load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
