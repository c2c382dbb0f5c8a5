"""Assembler stage: decoded messages -> whole source transactions for the apply stage.

Owns transaction structure: plain transactions pass straight through, streamed ones are buffered
per top-level xid (as raw bytes, spilling to local files beyond a memory budget) until they commit
or prepare, and impossible sequences raise ``ProtocolSequenceError``. Must never apply anything or
touch a database or the network; its only I/O is its own spill files.

Public API: ``Assembler``, the ``TransactionSink`` protocol the apply stage implements (and
``EarlyApply``, for a streamed transaction applied as it streams), ``deliver`` (buffered records
to a sink), ``TransactionStart``/``TransactionEnd`` and ``ProtocolSequenceError``.
"""

from .assembler import Assembler
from .errors import ProtocolSequenceError
from .replay import deliver
from .sink import Change, EarlyApply, TransactionEnd, TransactionSink, TransactionStart

__all__ = ["Assembler", "Change", "EarlyApply", "ProtocolSequenceError", "TransactionEnd",
           "TransactionSink", "TransactionStart", "deliver"]
