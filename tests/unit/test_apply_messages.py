"""Logical decoding messages in the apply stage (``apply.messages``) without a server."""

from __future__ import annotations

from applier.apply.messages import MessageSink
from applier.progress.memory import MemoryStore
from applier.protocol import LSN
from applier.protocol.messages import Message


def test_message_prefix_filter() -> None:
    def msg(prefix: str) -> Message:
        return Message(None, 1, LSN(1), prefix, b"")

    sink = MessageSink(MemoryStore("s"), "log", ["app.*", "ops"])
    assert [sink.wants(msg(p)) for p in ("app.audit", "app", "ops", "opsx")] == [
        True, False, True, False]
    assert MessageSink(MemoryStore("s"), "log").wants(msg("anything"))
