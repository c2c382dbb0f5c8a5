"""The Parquet directories a pipeline writes: written with their rows counted, read back once
per Spark session.

Owns one bounded map from a directory to the DataFrame that reads it. A pipeline never changes a
directory once written (every round writes new ones, see :mod:`.pipeline`), so a DataFrame read
from one stays right for as long as the directory is there, and later rounds of the same session
(``applier pipeline --every``) reuse it: no new listing of its files and no new reading of its
schema from their footers, which cost about 0.05 s a directory a round. A directory this session
wrote is read with the schema it was written with, so even its first reading runs no Spark job
to infer it (one each, 0.06-0.2 s here). Must never be used for a directory that can change in
place, and never hand a DataFrame to another Spark session.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["forget", "read_written", "write_counted"]

#: Directories kept: a round reads its result, the index's base and at most a few layers.
_KEPT = 32
_frames: OrderedDict[tuple[int, str], DataFrame] = OrderedDict()


def read_written(spark: SparkSession, directory: Path) -> DataFrame:
    """``spark.read.parquet(directory)``, or the DataFrame an earlier call of this session made."""
    key = (id(spark), str(directory.resolve()))
    frame = _frames.get(key)
    if frame is None or frame.sparkSession is not spark:
        frame = _keep(key, spark.read.parquet(str(directory)))
    _frames.move_to_end(key)
    return frame


def _keep(key: tuple[int, str], frame: DataFrame) -> DataFrame:
    _frames[key] = frame
    _frames.move_to_end(key)
    while len(_frames) > _KEPT:
        _frames.popitem(last=False)
    return frame


def forget(directory: Path) -> None:
    """``directory`` is being removed: drop what was read from it."""
    path = str(directory.resolve())
    for key in [k for k in _frames if k[1] == path]:
        del _frames[key]


def write_counted(frame: DataFrame, path: Path, coalesce: bool = False) -> int:
    """Write ``frame`` to ``path`` (Parquet; in one file if ``coalesce``) and return its rows,
    counted by the write itself (an observation): counting them afterwards would be one more
    Spark job, 0.06-0.2 s of a round here, even from the Parquet footers."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructField, StructType

    written = Observation()
    observed = frame.observe(written, F.count(F.lit(1)).alias("rows"))
    (observed.coalesce(1) if coalesce else observed).write.mode("overwrite").parquet(str(path))
    # Read back as Parquet gives it: the same columns and types, every column nullable.
    schema = StructType([StructField(f.name, f.dataType, True, f.metadata) for f in frame.schema])
    spark = frame.sparkSession
    _keep((id(spark), str(path.resolve())), spark.read.schema(schema).parquet(str(path)))
    return int(written.get["rows"])
