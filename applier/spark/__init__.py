"""Reading the replica with Apache Spark (PySpark over JDBC): consistent partitioned reads.

Owns: the quiet SparkSession factory (:mod:`.session`), consistent snapshot reads of replicated
tables (:mod:`.reader`) in one exported snapshot with the source position it reflects
(:mod:`.snapshot`) and lossless type handling (:mod:`.columns`), the change feed read by LSN
range (:mod:`.changes`) or as a Structured Streaming source (:mod:`.stream`), and the example
pipeline job (:mod:`.pipeline`). Must never write to the replica, and must never be imported by the
applier's data path; PySpark is imported only when a function here is called.

The public readers are exported here, as PySpark exports its own::

    from applier.spark import open_snapshot, read_change_stream, read_changes, read_table

each loaded on first use (``read_change_stream``'s module imports PySpark and pyarrow, which
``applier verify`` must not need).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .session import JDBC_DRIVER, SparkUnavailable, find_jdbc_jar, spark_session

if TYPE_CHECKING:
    from .changes import HistoryNotRetained, read_changes
    from .reader import read_table, read_tables, source_position
    from .snapshot import open_snapshot
    from .stream import read_change_stream

__all__ = ["JDBC_DRIVER", "HistoryNotRetained", "SparkUnavailable", "find_jdbc_jar", "open_snapshot",
           "read_change_stream", "read_changes", "read_table", "read_tables", "source_position",
           "spark_session"]

#: Exported names and the module each comes from, imported when first asked for.
_LAZY = {"open_snapshot": ".snapshot", "read_table": ".reader", "read_tables": ".reader",
         "source_position": ".reader", "read_changes": ".changes",
         "HistoryNotRetained": ".changes", "read_change_stream": ".stream"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
