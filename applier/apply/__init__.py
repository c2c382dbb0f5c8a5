"""Apply stage: whole source transactions -> target transactions.

Owns the mapping of source relations to target tables (by schema-qualified name, columns by name),
the SQL for each row shape (built once, cached, every identifier quoted), the target session
(``session_replication_role = replica``, empty ``search_path``), conflict counting, and writing the
progress row inside the same target transaction as the data. Must never read the network stream
or decide transaction boundaries: it is driven by the assembler through ``TransactionSink``.

Beyond rows, each in its own module: two-phase transactions (``twophase``), replication origins
(``origins``), logical messages (``messages``), conflict detection and policies (``conflicts``)
and skip requests (``skipping``), assembled per target session by ``extensions``.
"""

from .relations import MissingTargetColumn, MissingTargetTable, TargetTable
from .sink import ApplyError, TargetApplier

__all__ = ["TargetApplier", "ApplyError", "MissingTargetTable", "MissingTargetColumn", "TargetTable"]
