"""Reading the replica with Apache Spark (PySpark over JDBC): consistent partitioned reads.

Owns: the quiet SparkSession factory (:mod:`.session`), consistent snapshot reads of replicated
tables (:mod:`.reader`) in one exported snapshot with the source position it reflects
(:mod:`.snapshot`) and lossless type handling (:mod:`.columns`), the change feed read by LSN
range (:mod:`.changes`) or as a Structured Streaming source (:mod:`.stream`), and the example
pipeline job (:mod:`.pipeline`). Must never write to the replica, and must never be imported by the
applier's data path; PySpark is imported only when a function here is called.
"""

from __future__ import annotations

from .session import JDBC_DRIVER, SparkUnavailable, find_jdbc_jar, spark_session

__all__ = ["JDBC_DRIVER", "SparkUnavailable", "find_jdbc_jar", "spark_session"]
