"""The one switch between the C accelerators and their pure-Python twins.

applier has four optional C modules, each with a Python path that does the same: the decoder's
(``protocol._speedups``, also COPY text), the lane's core (``apply._lane``), the replication
stream's frame reader (``source._frames``) and the initial copy's relay (``sync._relay``). They
are built at install time when a C compiler is there. Owns the rule deciding which runs: the C
module when it is built, unless ``APPLIER_PURE_PYTHON`` turns it off: ``1`` turns every one off,
a comma-separated list of their names (``apply._lane``) only those, so that one accelerator can be
ruled out alone (the oracle test runs with the lane off and the decoder on). Must never build or
bind anything.

``summary`` says which implementation is active, as psycopg's ``pq.__impl__`` does: ``applier
--version`` and the worker's first log line print it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["ACCELERATORS", "accelerator", "pure_python", "summary"]

#: The C modules, by the name ``accelerator`` and ``APPLIER_PURE_PYTHON`` take.
ACCELERATORS = ("protocol._speedups", "apply._lane", "source._frames", "sync._relay")


def pure_python(name: str | None = None) -> bool:
    """Whether ``APPLIER_PURE_PYTHON`` turns accelerator ``name`` off (``1``: every one); without
    a name, whether it turns every one off (tests compare the two paths)."""
    setting = os.environ.get("APPLIER_PURE_PYTHON", "").strip()
    if setting == "1":
        return True
    return name is not None and name in {part.strip() for part in setting.split(",")}


def accelerator(name: str) -> ModuleType | None:
    """The C module ``applier.<name>`` (e.g. ``"protocol._speedups"``), or None when it is not
    built (no C compiler at install) or ``APPLIER_PURE_PYTHON`` asks for its Python path."""
    if name not in ACCELERATORS:
        raise ValueError(f"{name!r} is not one of applier's accelerators: {', '.join(ACCELERATORS)}")
    if pure_python(name):
        return None
    try:
        return importlib.import_module(f"applier.{name}")
    except ImportError:
        return None


def summary() -> str:
    """Which implementation runs: ``C accelerators: <names>``, ``pure Python (<why>)``, or the C
    accelerators in use and, for each other one, why its Python path runs instead. (A module
    bound to psycopg's libpq may still fall back to Python when that library cannot be found:
    the worker logs it when it happens.)"""
    used = [name for name in ACCELERATORS if accelerator(name) is not None]
    off = {name: "turned off by APPLIER_PURE_PYTHON" if pure_python(name) else "not built"
           for name in ACCELERATORS if name not in used}
    if not off:
        return "C accelerators: " + ", ".join(used)
    if not used and set(off.values()) == {"not built"}:
        return "pure Python (no C accelerator is built)"
    if not used and set(off.values()) == {"turned off by APPLIER_PURE_PYTHON"}:
        return f"pure Python (APPLIER_PURE_PYTHON={os.environ['APPLIER_PURE_PYTHON'].strip()})"
    detail = ", ".join(f"{name} ({why})" for name, why in off.items())
    return ("C accelerators: " + ", ".join(used) + "; pure Python for " + detail if used
            else "pure Python: " + detail)
