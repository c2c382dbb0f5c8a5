"""Source stage: the replication connection to the publisher.

Owns START_REPLICATION and its options, the CopyBoth stream (XLogData and keepalives), standby
status updates, and slot administration. Must never decide what is durable: the flush position it
reports is always the one the worker hands it, never its own guess.
"""

from ..errors import SourceError
from .options import (
    StreamOptions,
    UnsupportedOption,
    max_protocol_version,
    options_for,
    resolve_stream_options,
)
from .stream import ReplicationStream, XLogData

__all__ = ["ReplicationStream", "SourceError", "XLogData", "StreamOptions", "UnsupportedOption",
           "max_protocol_version", "options_for", "resolve_stream_options"]
