"""Protocol stage: pgoutput bytes -> typed, immutable messages.

Owns the logical replication wire format (protocol versions 1-4). Must never do I/O, touch a
database, or keep state between messages: the caller tracks whether it is inside a streamed block.

Public entry point: ``decode(data, in_stream=False)``; malformed input raises ``DecodeError``.
"""

from .decoder import MESSAGE_NAMES, decode
from .errors import DecodeError
from .lsn import LSN, pg_timestamp, to_pg_timestamp
from .messages import *  # noqa: F403 - the message types are this package's API
from .messages import __all__ as _message_names

__all__ = ["decode", "DecodeError", "LSN", "MESSAGE_NAMES", "pg_timestamp", "to_pg_timestamp",
           *_message_names]
