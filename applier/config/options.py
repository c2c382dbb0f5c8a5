"""The option table (``OPTIONS``): every setting of every command, from which the command line,
the ``APPLIER_*`` environment variables, the TOML config file and the generated configuration
reference are all built. Defaults live here only. Must never read a value (``settings`` does).
"""

from __future__ import annotations

from ..ops.lag import parse_lag_limit
from .option import Option

__all__ = ["OPTIONS", "entry", "options_for"]


_REPLICATION = ("run", "sync", "peek")
#: Commands that print their own result: logging only adds warnings unless asked for more.
_REPORTING = ("verify", "pipeline", "demo", "sequences", "cutover", "drop", "resync")
#: The commands of a replica's last steps (applier/lifecycle/).
_LIFECYCLE = ("sequences", "cutover", "drop")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_SPARK = "For verify --engine spark and pipeline: "

OPTIONS: tuple[Option, ...] = (
    Option("source", "libpq connection string or URL of the source (publisher) database. TLS and "
           "other libpq options pass through. Required (optional for skip, which then checks "
           "the slot on the target only).", secret=True,
           commands=_REPLICATION + ("status", "verify", "skip", "resync") + _LIFECYCLE),
    Option("target", "libpq connection string or URL of the target (replica) database. Required.",
           secret=True, commands=("run", "sync", "status", "skip", "verify", "pipeline", "resync")
           + _LIFECYCLE),
    Option("slot", "Logical replication slot on the source: the one run and sync consume, peek "
           "reads without consuming, status and skip report on, cutover waits for, drop removes, "
           "resync asks the worker of. Required.", metavar="NAME",
           commands=_REPLICATION + ("status", "skip", "cutover", "drop", "resync")),
    Option("slot", "Slot of the replica: the report then says how far the target had applied "
           "it when the sequences were set. Default: no such note.", metavar="NAME",
           commands=("sequences",)),
    Option("slot", "The replica's slot: while its worker runs, both sides are compared at one "
           "source position it holds at for a moment (and --repair writes there). Default: the "
           "only slot the target has applied; without a running worker, each side is read as "
           "it is (a change not applied yet shows as a difference).", metavar="NAME",
           commands=("verify",)),
    Option("slot", "Slot whose applied position on the target tags the result. Default: the only "
           "one the target has.", metavar="NAME", commands=("pipeline",)),
    Option("publication", "Publication name(s) on the source, comma separated: what run, sync "
           "and peek receive, whose tables verify and cutover compare, whose sequences sequences "
           "sets, whose tables resync may copy again. Required.", kind="list", default=[],
           commands=_REPLICATION + ("verify", "sequences", "cutover", "resync")),
    Option("create_slot", "Create the slot (pgoutput plugin) when it does not exist and the "
           "target has no records of it (a slot that vanished is never replaced: that would "
           "skip the changes in between).", kind="bool", default=False, commands=("run",)),
    Option("failover_slot", "Create the slot as a failover slot (PostgreSQL 17+): a physical "
           "standby with sync_replication_slots = on keeps a synchronised copy of it, and the "
           "replica goes on from that copy after the standby's promotion (README: Failover of "
           "the source). Default: on where the source supports it (17+; on 17 not for a "
           "two-phase slot); asked for on an older source, an error.", kind="bool",
           commands=("run", "sync")),
    Option("proto_version", "pgoutput protocol version 1-4. Default: the highest the source "
           "supports (15: 3, 16+: 4).", kind="int", commands=_REPLICATION),
    Option("streaming", "Stream large in-progress transactions: off, on, or parallel (protocol 4, "
           "adds abort LSNs). Default: parallel on protocol 4, on for 2-3, off for 1.",
           kind="choice", choices=("off", "on", "parallel"), commands=_REPLICATION),
    Option("two_phase", "Decode prepared transactions at PREPARE time (protocol 3+). Default: "
           "on when the slot was created with two_phase.", kind="bool", commands=_REPLICATION),
    Option("binary", "Column values in binary (PostgreSQL 14+ source), which is cheaper to "
           "produce and to load than text. on: always (source and target types must then match "
           "exactly). auto: text from the start when a published column's type is not built in "
           "(read from the source's catalogs), else binary while every replicated column has the "
           "same built-in type on both sides; the first relation that does not restarts the "
           "session in text, for the rest of the process. off: text. A bare --binary means on. "
           "peek shows text unless on.",
           kind="choice", choices=("auto", "on", "off"), default="auto", commands=_REPLICATION),
    Option("messages", "Receive pg_logical_emit_message messages.", kind="bool", default=False,
           commands=_REPLICATION),
    Option("origin", "Publisher-side origin filter (PostgreSQL 16+): 'none' sends only changes "
           "that originated on the source itself, 'any' sends everything. Default: no filter "
           "(as any).", kind="choice", choices=("any", "none"), commands=_REPLICATION),
    Option("two_phase_mode", "How prepared source transactions are applied when two-phase "
           "decoding is on. prepare: applied and PREPAREd on the target at once, committed or "
           "rolled back when the source does. defer: held durably in the applier schema and "
           "applied only at COMMIT PREPARED. auto: prepare when the target has "
           "max_prepared_transactions > 0, else defer.", kind="choice",
           choices=("auto", "prepare", "defer"), default="auto"),
    Option("skip_origin", "Drop source transactions that came from this replication origin (the "
           "name in their Origin message); repeatable. With two workers replicating in opposite "
           "directions, give each the other's --replication-origin to stop loops on PostgreSQL "
           "15 (16+ can use --origin none instead). Default: drop none.", kind="list",
           default=[], repeatable=True, metavar="NAME"),
    Option("replication_origin", "Replication origin that tags the worker's writes on the target, "
           "so a replication out of the target with origin=none (or --skip-origin) ignores them. "
           "Default: applier_<slot>_<target database>; 'none' leaves the writes untagged. Needs "
           "superuser or EXECUTE on pg_replication_origin_create/_session_setup; without them "
           "the worker logs it once and runs untagged.", metavar="NAME"),
    Option("message_sink", "Where --messages delivers pg_logical_emit_message payloads: 'table' "
           "(applier.messages on the target; transactional ones in their own transaction) or "
           "'log'.", kind="choice", choices=("table", "log"), default="table"),
    Option("message_prefix", "Deliver only logical messages whose prefix matches this pattern "
           "(shell-style: * and ? wildcards); repeatable. Default: every message.", kind="list",
           default=[], repeatable=True, metavar="PATTERN"),
    Option("conflict_policy", "What to do on an apply conflict: apply (the source wins: upsert, "
           "or skip a change whose row is missing), error (stop the worker), keep-local (the "
           "target row wins). POLICY sets the default, SCHEMA.TABLE=POLICY one table; "
           "repeatable. Default: apply.", kind="list", default=[], repeatable=True,
           metavar="[SCHEMA.TABLE=]POLICY"),
    Option("skip_lsn", "Skip the one source transaction that finishes (commits or prepares) at "
           "this LSN, as 'applier skip --lsn' does; recorded in applier.skipped_transactions. "
           "Default: skip nothing.", kind="lsn"),
    Option("lsn", "Finish LSN (commit or prepare LSN) of the source transaction to skip, as the "
           "worker's error message names it. Required.", kind="lsn", commands=("skip",)),
    Option("sql", "Peek over the SQL interface (pg_logical_slot_peek_binary_changes) instead of "
           "the replication protocol.", kind="bool", default=False, commands=("peek",)),
    Option("limit", "Stop after printing this many messages. Default: no limit.", kind="int",
           commands=("peek",)),
    Option("timeout", "Stop after this long without a new message (30s, 5min; a bare number "
           "is seconds).", kind="duration", default=5.0, commands=("peek",)),
    Option("timeout", "How long to wait for the worker to apply and confirm everything the source "
           "had written when cutover started (30s, 5min; a bare number is seconds); then fail, "
           "saying how far behind it is.", kind="duration", default=300.0, commands=("cutover",)),
    Option("timeout", "How long to wait for the worker to reach the comparison's (or the "
           "repair's) source position; the worker lets go of a hold after this long too.",
           kind="duration", default=60.0, commands=("verify",)),
    Option("memory_budget", "Memory for open streamed transactions, over all of them; the rest "
           "spills to --spill-dir. What run receives ahead while it starts (at most a quarter) "
           "counts against it. Units kB, MB, GB.", kind="size", default=64 * 1024**2),
    Option("streamed_apply", "When a streamed (large, still running) source transaction is "
           "applied. early: as it streams, in a second target session, committed at its Stream "
           "Commit (one such transaction at a time; one that holds a logical message or an "
           "Origin, meets a conflict or a lock wait of over 5 s, or ends in a Stream Prepare is "
           "applied at its commit instead, the source sending it again). commit: buffered "
           "(spilled beyond --memory-budget) and applied at its commit.",
           kind="choice", choices=("early", "commit"), default="early"),
    Option("schema_changes", "What a source table's changed columns do to the target. follow: "
           "a column the target lacks is added (a type that is not built in must exist on the "
           "target by the same name) with the source's default, which the rows already there "
           "read as on the source (one the source wrote into its rows by rewriting the table, "
           "a volatile default, stops the worker, saying what to do), a column whose source "
           "type now holds more is widened along a safe list (smallint, integer, bigint; real, double "
           "precision; a longer varchar or text; a wider numeric), a column gone from the source "
           "stays and loses its NOT NULL when it has no default; each change in the target "
           "transaction of the first row change that needs it, recorded in "
           "applier.schema_changes. Any other type change stops the worker. error: the worker "
           "stops at a missing column, as PostgreSQL's subscriber does.",
           kind="choice", choices=("follow", "error"), default="follow"),
    Option("change_feed", "Record every row change applied to these tables, in the same target "
           "transaction, in a change table of each (schema applier_changes, partitioned by "
           "source commit LSN): the row, the operation (insert, update, delete; truncate as a "
           "marker), the source commit LSN, commit time, xid and the change's order in its "
           "transaction. 'all': every published table; else SCHEMA.TABLE names, comma separated. "
           "Spark reads it with applier.spark.read_changes. Default: off.", kind="list",
           default=[], metavar="all|TABLE[,TABLE...]"),
    Option("change_feed_retention", "How long the change feed keeps history: partitions whose "
           "changes are all older than this are dropped in the background (never while a reader "
           "holds a snapshot of the change tables). Units s, min, h, d.", kind="duration",
           default=7 * 86400.0),
    Option("spill_dir", "Directory for spill files of streamed transactions over the memory "
           "budget, and of the change rows (--change-feed) of one applied as it streams, held "
           "until its commit (drop removes the slot's spill files there). Default: a directory "
           "per target database and slot under the system temp directory.", kind="path",
           commands=("run", "sync", "status", "drop")),
    Option("batch_rows", "Fast apply: row changes (of one or more consecutive source transactions) "
           "per target transaction before it commits; also the most rows held in memory. 0 turns "
           "fast apply off: each source transaction is applied in a target transaction of its "
           "own, a statement per row (the careful path, as PostgreSQL's subscriber applies), "
           "and a streamed one at its commit; slower, for ruling fast apply out when chasing a "
           "problem.", kind="int", default=20000),
    Option("batch_bytes", "Fast apply: bytes of row data per target transaction before it commits "
           "(at most half of --memory-budget is used: the batch counts against the budget too). "
           "Units kB, MB, GB.", kind="size", default=8 * 1024**2),
    Option("batch_time", "Fast apply: milliseconds a target transaction may stay open collecting "
           "source transactions (it also commits whenever the stream is idle).", kind="int",
           default=500, metavar="MS"),
    Option("batch_wait", "Fast apply: milliseconds a batch may wait, when the stream pauses, for "
           "more source transactions to join it before it commits. 0 commits at every pause (the "
           "least lag); a few let batches grow with the load, so the target commits "
           "less often: less CPU per transaction for a little more lag.", kind="int", default=2,
           metavar="MS"),
    Option("synchronous_commit", "synchronous_commit of the target session. 'off' is safe here: the "
           "slot is only told positions whose target commits the target has flushed to disk.",
           kind="choice", choices=("on", "off"), default="off"),
    Option("exit_when_caught_up", "Exit 0 once everything the source committed before start-up "
           "is applied and confirmed, instead of running until SIGTERM/SIGINT.", kind="bool",
           default=False),
    Option("status_interval", "Seconds between standby status updates to the source (at most 10).",
           kind="int", default=10, metavar="SECONDS"),
    Option("jobs", "Copy sessions run in parallel by applier sync: several tables at once, and "
           "the block ranges of large tables.", kind="int", default=4, commands=("sync",)),
    Option("range_size", "applier sync cuts plain tables larger than this (on-disk size) into "
           "block ranges of this size, copied in parallel from the same snapshot. A table copied "
           "whole has its indexes built after its data instead. Units kB, MB, GB.",
           kind="size", default=1024**3, commands=("sync",)),
    Option("create_tables", "Create missing target tables with the source's definitions "
           "(published columns with their types, collations, defaults, identity and NOT NULL; "
           "the sequences they use; primary key and replica identity), building other indexes "
           "and unique constraints after each table's data, and CHECK and foreign key "
           "constraints, validated, after every table's: every table applier sync copies, and a "
           "table added to a publication while run runs.", kind="bool",
           default=False, commands=("sync", "run")),
    Option("truncate_target", "applier sync empties target tables that are not empty before "
           "copying into them, instead of refusing to start.", kind="bool", default=False,
           commands=("sync",)),
    Option("progress_interval", "Seconds between progress log lines: what run (and sync once it "
           "streams) applied meanwhile, while it has work; and the copy of applier sync when "
           "stderr is not a terminal (a terminal gets a live display).", kind="int", default=10,
           metavar="SECONDS", commands=("run", "sync")),
    Option("log_level", "Logging level: DEBUG, INFO, WARNING, ERROR.", default="INFO",
           kind="choice", choices=_LOG_LEVELS, commands=("run", "sync", "peek", "status", "skip")),
    Option("log_level", "Logging level: DEBUG, INFO, WARNING, ERROR (this command prints its "
           "result itself; logging adds warnings).", default="WARNING", kind="choice",
           choices=_LOG_LEVELS, commands=_REPORTING),
    # -- operations (applier/ops) -----------------------------------------------------------------
    Option("log_format", "Log line format: text (for people) or json (one object per line with "
           "slot, lsn and xid fields).", default="text", kind="choice", choices=("text", "json"),
           commands=("run", "sync", "peek", "status", "skip") + _REPORTING),
    Option("metrics_port", "Serve Prometheus metrics on this TCP port at /metrics, with /healthz "
           "(live) and /readyz (streaming and within --ready-max-lag). Default: no server.",
           kind="int", metavar="PORT"),
    Option("metrics_address", "Address the metrics server listens on.", default="0.0.0.0",
           metavar="ADDRESS"),
    Option("ready_max_lag", "/readyz fails while the apply lag exceeds this: a size of WAL "
           "(e.g. 64MB) or a duration (e.g. 30s, 5min).", kind="lag",
           default=parse_lag_limit("60s")),
    Option("json", "Print the result as JSON instead of a table.", kind="bool", default=False,
           commands=("status", "verify", "cutover")),
    Option("standby", "A physical standby of the source (libpq connection string or URL); "
           "repeatable. status shows whether it holds a synchronised copy of the slot and how "
           "far behind the slot it is, checks its settings for a failover, and exits with status "
           "3 when it could not take over the replica. Default: none.", kind="dsns", default=[],
           secret=True, repeatable=True, commands=("status",)),
    Option("max_lag", "Exit with status 3 when the apply lag exceeds this: a size of WAL (e.g. "
           "64MB) or a duration (e.g. 30s, 5min). Default: no limit.", kind="lag",
           commands=("status",)),
    # -- verify and pipeline (applier/verify/, applier/spark) -------------------------------------
    Option("table", "Compare only this published table (schema.table or table); repeatable. "
           "Default: every table of the publications.", kind="list", default=[], repeatable=True,
           metavar="TABLE", commands=("verify",)),
    Option("table", "Replicated table to aggregate (schema.table or table).", kind="list",
           default=["orders"], metavar="TABLE", commands=("pipeline",)),
    Option("table", "Published table(s) to copy again (schema.table or table), comma separated; "
           "repeatable. Required.", kind="list", default=[], repeatable=True,
           metavar="TABLE[,TABLE...]", commands=("resync",)),
    Option("keep_target_columns", "Copy a table again even though its target table has columns "
           "the source does not publish: the copy empties the table, so their values are lost "
           "(new rows get their defaults).", kind="bool", default=False, commands=("resync",)),
    Option("repair", "Make the target equal to the source where the tables differ, while the "
           "worker runs: the differing keys' rows are read from a source snapshot and written "
           "while the worker holds at its position; a table without a key (or with over 10000 "
           "differing keys) is copied again whole, as applier resync does. Without it, verify "
           "only says what --repair would do.", kind="bool", default=False, commands=("verify",)),
    Option("engine", "sql: compare inside the databases; spark: with PySpark, for tables too "
           "large for one machine.", kind="choice", choices=("sql", "spark"), default="sql",
           commands=("verify",)),
    Option("settle", "Compare differing tables again for up to this many seconds, so that "
           "changes still in flight to a live replica are not reported; 0: compare once.",
           kind="float", default=10.0, metavar="SECONDS", commands=("verify",)),
    Option("max_keys", "List at most N keys per table and kind of difference (missing, extra, "
           "changed).", kind="int", default=100, commands=("verify",)),
    Option("master", _SPARK + "Spark master URL. Default: local[*] (this machine, every core).",
           metavar="URL", commands=("verify", "pipeline")),
    Option("jdbc_jar", _SPARK + "PostgreSQL JDBC driver jar. Default: Debian's "
           "libpostgresql-jdbc-java, else the newest in the local Maven repository (~/.m2).",
           kind="path", metavar="PATH", commands=("verify", "pipeline")),
    Option("group_by", "Column to group by.", default="customer_id", metavar="COLUMN",
           commands=("pipeline",)),
    Option("measure", "Numeric column to sum per group.", default="total", metavar="COLUMN",
           commands=("pipeline",)),
    Option("output", "Directory of the Parquet result and its state file. Required.", kind="path",
           commands=("pipeline",)),
    Option("full", "Recompute everything even if an incremental run is possible.", kind="bool",
           default=False, commands=("pipeline",)),
    Option("every", "Keep running: one Spark session, a round every DURATION (e.g. 30s, 5min; "
           "a round that takes longer is followed at once by the next), each committed as a "
           "single run is, until SIGINT or SIGTERM, which end the loop between rounds with exit "
           "code 0. Default: one round.", kind="duration", commands=("pipeline",)),
    Option("rounds", "Stop after N rounds (with --every, or back to back without it). Default: "
           "1 without --every, no limit with it.", kind="int", commands=("pipeline",)),
    # -- a replica's last steps (applier/lifecycle/) --------------------------------------------------
    Option("margin", "Set each target sequence this far beyond the source's value (in the "
           "sequence's direction), for writes still landing on the source.", kind="int",
           default=0, commands=("sequences", "sync", "cutover")),
    Option("dry_run", "Show what would be set, and set nothing.", kind="bool", default=False,
           commands=("sequences",)),
    Option("verify", "How cutover compares the tables' rows: full (as applier verify: counts, "
           "per-range hashes, the differing keys), counts (row counts only: quicker, but blind "
           "to a changed row) or off. Only full can give the verdict SAFE; counts and off, with "
           "no check failing, give NOT CONFIRMED.", kind="choice",
           choices=("full", "counts", "off"), default="full", commands=("cutover",)),
    Option("keep_bookkeeping", "Keep the slot's rows in the target's applier tables (progress, "
           "table sync, conflicts, ...) for the record.", kind="bool", default=False,
           commands=("drop",)),
    Option("keep_change_feed", "Keep the slot's change feed (its change tables in schema "
           "applier_changes and their rows in applier.change_tables, change_partitions and "
           "change_commits), for reading its history after the replica is retired. A sync of a "
           "slot of the same name starts its history again.", kind="bool", default=False,
           commands=("drop",)),
    Option("yes", "Do not ask for confirmation on a terminal (without a terminal drop never "
           "asks).", kind="bool", default=False, commands=("drop",)),
    # -- demo (applier/demo.py) ---------------------------------------------------------------------
    Option("pg_version", "PostgreSQL major version of both throwaway servers.", kind="int",
           default=18, choices=("15", "18"), commands=("demo",)),
    Option("seconds", "How long the live workload writes while the worker streams.", kind="float",
           default=15.0, metavar="SECONDS", commands=("demo",)),
    Option("keep", "Leave both servers running at the end and print their connection strings.",
           kind="bool", default=False, commands=("demo",)),
)


def options_for(command: str) -> tuple[Option, ...]:
    """The options ``command`` takes, one entry per name."""
    return tuple(option for option in OPTIONS if command in option.commands)


def entry(command: str, name: str) -> Option:
    """The entry of option ``name`` for ``command``, else its first entry."""
    entries = [option for option in OPTIONS if option.name == name]
    return next((option for option in entries if command in option.commands), entries[0])
