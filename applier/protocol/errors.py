"""The one error type the decoder raises."""

from __future__ import annotations

__all__ = ["DecodeError"]


class DecodeError(ValueError):
    """Malformed pgoutput bytes.

    ``message_type`` is the snake_case name of the message being decoded (or the raw type byte
    when it is unknown), ``offset`` the byte offset within the message where decoding failed,
    and ``reason`` what was wrong there. No other exception type escapes ``decode``.
    """

    def __init__(self, message_type: str, offset: int, reason: str) -> None:
        self.message_type = message_type
        self.offset = offset
        self.reason = reason
        super().__init__(f"malformed {message_type} message at byte {offset}: {reason}")
