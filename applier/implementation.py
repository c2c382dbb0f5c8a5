"""The one switch between the C accelerators and their pure-Python twins.

applier has four optional C modules, each with a Python path that does the same: the decoder's
(``protocol._speedups``, also COPY text), the lane's core (``apply._lane``), the replication
stream's frame reader (``source._frames``) and the initial copy's relay (``sync._relay``). They
are built at install time when a C compiler is there. Owns the rule deciding which runs: the C
module when it is built, unless ``APPLIER_PURE_PYTHON=1``. Must never build or bind anything.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["accelerator", "pure_python"]


def pure_python() -> bool:
    """``APPLIER_PURE_PYTHON=1``: every stage runs its Python path (tests compare the two)."""
    return os.environ.get("APPLIER_PURE_PYTHON") == "1"


def accelerator(name: str) -> ModuleType | None:
    """The C module ``applier.<name>`` (e.g. ``"protocol._speedups"``), or None when it is not
    built (no C compiler at install) or ``APPLIER_PURE_PYTHON=1`` asks for the Python path."""
    if pure_python():
        return None
    try:
        return importlib.import_module(f"applier.{name}")
    except ImportError:
        return None
