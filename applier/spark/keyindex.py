"""The pipeline's key index: each key's group and measure as of the last committed round, kept
beside the result so that a round can take a changed key's old contribution away.

Owns the index's layout under the output directory: a *base* (Parquet, one row per key) and
*layers* written by later rounds (Parquet: the changed keys' new entries, and a tombstone for
each deleted key), newest last. A key's entry is its entry in the newest layer that has it, else
its base row; a tombstone means the key is gone. A round writes one layer of its changed keys
only, never the whole index; when the layers' rows pass ``LAYER_SHARE`` of the base's, or there
are ``MAX_LAYERS`` of them, the round writes a new base instead (the compaction). Must never
change a directory a committed state names: every write is a new directory, and the state file
that names it is the commit (see :mod:`.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .written import read_written, write_counted

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["LAYER_SHARE", "MAX_LAYERS", "KeyIndex", "lookup", "write_base", "write_layer"]

#: A new base is written when the layers hold more rows than this share of the base ...
LAYER_SHARE = 0.2
#: ... or there would be more layers than this (each is one more Parquet read per round).
MAX_LAYERS = 8
#: Layer columns besides the entry: a tombstone flag, and (in lookups) the layer's order.
DELETED = "_applier_deleted"
_ORDER = "_applier_order"


@dataclass(frozen=True)
class Layer:
    directory: str
    rows: int


@dataclass(frozen=True)
class KeyIndex:
    """Where the index of a committed round is: its base and layers (oldest first)."""

    base: Layer
    layers: tuple[Layer, ...] = ()

    @property
    def directories(self) -> list[str]:
        return [self.base.directory, *(layer.directory for layer in self.layers)]

    def to_state(self) -> dict[str, Any]:
        return {"base": self.base.directory, "base_rows": self.base.rows,
                "layers": [{"directory": la.directory, "rows": la.rows} for la in self.layers]}

    @classmethod
    def from_state(cls, data: Any) -> KeyIndex | None:
        """The index a state file names; None for none (or an older layout, without measures)."""
        if not isinstance(data, dict) or "base" not in data:
            return None
        return cls(Layer(data["base"], int(data["base_rows"])),
                   tuple(Layer(la["directory"], int(la["rows"])) for la in data["layers"]))


def write_base(entries: DataFrame, output: Path, stamp: str) -> KeyIndex:
    """A new index of exactly ``entries`` (one row per key, no tombstone column)."""
    directory = f"keys-{stamp}"
    return KeyIndex(Layer(directory, write_counted(entries, output / directory)))


def _layers(spark: SparkSession, output: Path, layers: tuple[Layer, ...], first: int) -> DataFrame:
    """The entries of ``layers`` with their order (``first`` for the oldest)."""
    from functools import reduce

    from pyspark.sql import functions as F

    return reduce(lambda a, b: a.unionByName(b),
                  [read_written(spark, output / la.directory).withColumn(_ORDER, F.lit(n))
                   for n, la in enumerate(layers, first)])


def _newest(entries: DataFrame, key: tuple[str, ...]) -> DataFrame:
    """Each key's newest entry, without the keys whose newest entry is a tombstone."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(*key).orderBy(F.col(_ORDER).desc())
    return entries.withColumn("_applier_newest", F.row_number().over(order)) \
        .where((F.col("_applier_newest") == 1) & ~F.col(DELETED)) \
        .drop("_applier_newest", _ORDER, DELETED)


def lookup(spark: SparkSession, output: Path, index: KeyIndex, keys: DataFrame,
           key: tuple[str, ...]) -> DataFrame:
    """The current entries of the keys in ``keys`` (the changed keys: broadcast to the scan of
    the index) that have one."""
    from pyspark.sql import functions as F

    base = read_written(spark, output / index.base.directory)
    if not index.layers:  # one entry per key, no tombstone: nothing to pick the newest of
        return base.join(F.broadcast(keys), list(key), "inner")
    entries = base.withColumn(DELETED, F.lit(False)).withColumn(_ORDER, F.lit(0)) \
        .unionByName(_layers(spark, output, index.layers, 1))
    return _newest(entries.join(F.broadcast(keys), list(key), "inner"), key)


def write_layer(spark: SparkSession, output: Path, index: KeyIndex, layer: DataFrame,
                key: tuple[str, ...], stamp: str) -> tuple[KeyIndex, int]:
    """``index`` with ``layer`` (the changed keys' entries, one per key, tombstones flagged in
    ``DELETED``) on top, and how many keys it holds: one more layer, or, once the layers would
    pass their share of the base, a new base of every key's newest entry. The layer is written
    first (one file, counted as it is written); with no key in it, or when a new base replaces
    the layers, no state names it and the round's clean-up removes it. Columns are cast to the
    base's types, so that every layer reads back as the base does."""
    from pyspark.sql import functions as F

    schema = read_written(spark, output / index.base.directory).schema
    layer = layer.select(*[F.col(f"`{f.name}`").cast(f.dataType).alias(f.name) for f in schema],
                         F.col(DELETED))
    directory = f"layer-{stamp}"
    rows = write_counted(layer, output / directory, coalesce=True)
    if not rows:
        return index, 0
    layers = (*index.layers, Layer(directory, rows))
    if len(layers) <= MAX_LAYERS and sum(la.rows for la in layers) <= LAYER_SHARE * index.base.rows:
        return KeyIndex(index.base, layers), rows
    # Compaction: the base's keys no layer has, and the newest live entry of those it has.
    newer = _layers(spark, output, layers, 1)
    base = read_written(spark, output / index.base.directory)
    kept = base.join(newer.select(*key).distinct(), list(key), "left_anti")
    return write_base(kept.unionByName(_newest(newer, key)), output, stamp), rows
