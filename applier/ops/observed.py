"""What the metrics server reads of a running worker: the shapes shared by ``metrics`` (which
fills them) and ``exposition`` (which serves them), so that neither imports the other's module
for them. Pure declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..progress.repairs import RepairTotals
from ..protocol.lsn import LSN
from .lag import Lag

__all__ = ["Observed", "Probe", "ROW_KINDS"]

#: Row-change kinds ``Applier.counts`` counts (besides "transactions").
ROW_KINDS = ("insert", "update", "delete", "truncate")


@dataclass
class Probe:
    """The latest probe results; replaced whole, so readers never see half an update."""

    at: float                       # time.monotonic() of the probe
    source_rtt: float | None
    target_rtt: float | None
    source_lsn: LSN | None
    lag: Lag | None
    error: str | None
    #: Resyncs and repairs recorded for the slot (None before the bookkeeping has them).
    repairs: RepairTotals | None = None


class Observed(Protocol):
    """A worker's telemetry as the HTTP side sees it (``metrics.Telemetry``)."""

    slot: str

    def snapshot(self) -> dict[str, Any]: ...

    def readiness(self) -> tuple[bool, str]: ...
