"""``applier verify``: is the replica equal to the source, and if not, exactly where not?

Owns: choosing the tables to compare (every table of the publications, their published columns
and row filters, or a chosen list: :mod:`.publications`), reading both sides at consistent points
(while the replica's worker runs, both at one source position it holds at: :mod:`.held`;
otherwise the source in one REPEATABLE READ snapshot, the target in one snapshot together with
the position it had applied: :mod:`.snapshots`), comparing row counts and per-key-range hashes,
then the rows of the ranges that differ (in the databases, :mod:`.sql`, or with ``--engine
spark``, :mod:`.spark`), and reporting equal or exactly which keys are missing, extra or changed,
and what ``--repair`` would do, as a table or JSON (:mod:`.report`), in one round at a held
position or in rounds until equal or out of time (:mod:`.command`). Must never write to either
database but the hold request (``--repair`` is :mod:`applier.repair`'s); the SQL engine must
never need PySpark (:mod:`.spark` is imported only when asked for).
"""

from __future__ import annotations

from .command import run_verify, verify
from .publications import published_tables
from .report import TableResult, TableSpec, VerifyError, VerifyReport, format_table
from .snapshots import snapshots
from .sql import compare_sql, count_sql

__all__ = ["TableResult", "TableSpec", "VerifyError", "VerifyReport", "compare_sql", "count_sql",
           "format_table", "published_tables", "run_verify", "snapshots", "verify"]
