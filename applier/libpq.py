"""The libpq psycopg loaded, for the C helpers that call it directly.

The initial copy's relay (``sync/_relay``) and the replication stream's frame reader
(``source/_frames``) link against no libpq: they receive psycopg's own ``PGconn`` pointers, and the
addresses of the functions of the very libpq psycopg runs on (its own copy with the binary
package, the system's otherwise). Owns finding and checking those addresses and binding a C
helper to them once per process. Must never load a libpq of its own: calling another libpq's
functions on psycopg's connections would crash.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from psycopg import pq

from .implementation import accelerator

__all__ = ["Binding", "functions", "pointer"]

log = logging.getLogger(__name__)


def pointer(pgconn: pq.abc.PGconn) -> int:
    """The address of the libpq ``PGconn`` behind ``pgconn``, for a C helper. psycopg's PGconn
    ABC does not declare ``pgconn_ptr``; both its implementations (C and ctypes) have it."""
    return int(pgconn.pgconn_ptr)  # type: ignore[attr-defined]


def functions(pgconn: pq.abc.PGconn, names: Sequence[str]) -> list[int] | None:
    """Addresses of ``names`` in the libpq ``pgconn`` runs on, or None when it cannot be found
    for certain. Only libraries already loaded are considered, and one is taken only when it
    reports psycopg's libpq version and reads this connection's backend pid and socket right."""
    for path in _loaded_libpqs():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            lib.PQlibVersion.restype = ctypes.c_int
            lib.PQbackendPID.argtypes = lib.PQsocket.argtypes = [ctypes.c_void_p]
            if (lib.PQlibVersion() != pq.version()
                    or lib.PQbackendPID(pointer(pgconn)) != pgconn.backend_pid
                    or lib.PQsocket(pointer(pgconn)) != pgconn.socket):
                continue
            return [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0 for name in names]
        except (OSError, AttributeError):
            continue
    return None


def _loaded_libpqs() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []  # not Linux: the Python paths are used
    paths = {fields[5] for fields in (line.split(None, 5) for line in maps.splitlines())
             if len(fields) == 6}
    return sorted(p for p in paths if re.match(r"libpq[-.].*\.so", Path(p).name))


class Binding:
    """A C helper module (``module``, as ``implementation.accelerator`` names it), bound on first
    use to the libpq a connection runs on (finding it needs one): its ``bind(*addresses)``
    receives the addresses of ``names``, in that order."""

    def __init__(self, what: str, module: str, names: Sequence[str]) -> None:
        self._what = what
        self._module_name = module
        self._names = tuple(names)
        self._lock = threading.Lock()
        self._decided = False
        self._module: ModuleType | None = None

    def get(self, pgconn: pq.abc.PGconn) -> ModuleType | None:
        """The bound module; None when it is not built, disabled (APPLIER_PURE_PYTHON=1), or
        psycopg's libpq cannot be found for certain."""
        with self._lock:
            if not self._decided:
                self._module = self._bind(pgconn)
                self._decided = True
            return self._module

    def _bind(self, pgconn: pq.abc.PGconn) -> ModuleType | None:
        module = accelerator(self._module_name)
        if module is None:
            return None
        addresses = functions(pgconn, self._names)
        if addresses is None:
            log.info("%s: psycopg's libpq not found among the loaded libraries; using the Python "
                     "path", self._what)
            return None
        module.bind(*addresses)
        return module
