"""Moving one COPY's rows from a source session to a target session.

Owns the data loop between a source ``COPY ... TO STDOUT`` and a target ``COPY ... FROM STDIN``
that the caller started (and finishes) with psycopg: the C relay (``_relay``: no GIL, no Python per
row, so parallel sessions really run in parallel) when it is built and bound to the libpq psycopg
loaded, else a pure-Python loop that gathers rows into blocks. Must never start, commit or roll
back anything; on failure it raises a ``psycopg.Error`` and leaves the clean-up to the ``Copy``
objects and the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import psycopg
from psycopg import pq
from psycopg.errors import error_from_result

from ..libpq import Binding, pointer

__all__ = ["accelerated", "relay"]

#: Rows gathered per write on the Python path; psycopg copies writes over 128 kB into pieces.
BLOCK_SIZE = 64 * 1024
#: How often (in bytes) the C relay comes back to report progress.
REPORT_BYTES = 8 * 1024**2

# relay() states of the C side (see _relay.c).
_MORE, _SOURCE_END, _SOURCE_LOST, _TARGET_FAILED = range(4)

#: The libpq functions the C relay calls, in its bind()'s order.
_FUNCTIONS = ("PQgetCopyData", "PQputCopyData", "PQfreemem", "PQsocket", "PQconsumeInput",
              "PQisBusy", "PQisnonblocking", "PQsetnonblocking", "PQflush")


def relay(out: psycopg.Copy, into: psycopg.Copy, on_bytes: Callable[[int], None]) -> int:
    """Move every row of ``out`` (COPY TO) into ``into`` (COPY FROM); the source's row count."""
    first = out.read()
    if not first:
        return out.cursor.rowcount  # no rows (a binary COPY always sends at least its header)
    # The first block goes through psycopg so it knows raw COPY data is being written: in binary
    # format that data carries its own header and trailer, and psycopg must add neither.
    into.write(first)
    on_bytes(len(first))
    c_relay = _binding.get(out.connection.pgconn)
    if c_relay is None:
        return _relay_python(out, into, on_bytes)
    return _relay_c(c_relay, out.connection, into.connection, on_bytes)


def accelerated(conn: psycopg.Connection) -> bool:
    """Whether ``relay`` runs in C for connections like ``conn``."""
    return _binding.get(conn.pgconn) is not None


def _relay_python(out: psycopg.Copy, into: psycopg.Copy, on_bytes: Callable[[int], None]) -> int:
    # libpq hands over one CopyData message per row; gathering them saves a psycopg write (and
    # a CopyData message to the target) per row.
    block = bytearray()
    for chunk in out:
        block += chunk
        if len(block) >= BLOCK_SIZE:
            into.write(block)  # psycopg hands it to libpq at once, so the block can be reused
            on_bytes(len(block))
            block.clear()
    if block:
        into.write(block)
        on_bytes(len(block))
    return out.cursor.rowcount


def _relay_c(c_relay: ModuleType, source: psycopg.Connection, target: psycopg.Connection,
             on_bytes: Callable[[int], None]) -> int:
    source_pq, target_pq = source.pgconn, target.pgconn
    while True:
        state, moved = c_relay.relay(pointer(source_pq), pointer(target_pq), REPORT_BYTES)
        on_bytes(moved)
        if state == _MORE:
            continue
        if state == _SOURCE_END:
            return _copy_out_rows(c_relay, source)
        failed = source if state == _SOURCE_LOST else target
        raise psycopg.OperationalError(f"COPY relay: {_error_message(failed)}")


def _copy_out_rows(c_relay: ModuleType, source: psycopg.Connection) -> int:
    """Take the source COPY's final result (the C relay waited for it); its row count."""
    pgconn = source.pgconn
    result = pgconn.get_result()
    while True:  # to ReadyForQuery, which leaves the session idle in its transaction
        if not c_relay.wait_result(pointer(pgconn)):
            raise psycopg.OperationalError(f"COPY relay: {_error_message(source)}")
        if pgconn.get_result() is None:
            break
    if result is None:
        raise psycopg.OperationalError(f"COPY relay: no result: {_error_message(source)}")
    if result.status != pq.ExecStatus.COMMAND_OK:
        raise error_from_result(result, encoding=source.info.encoding)
    return result.command_tuples or 0


def _error_message(conn: psycopg.Connection) -> str:
    return conn.pgconn.get_error_message(conn.info.encoding).strip() or "connection lost"


_binding = Binding("COPY relay", "sync._relay", _FUNCTIONS)
