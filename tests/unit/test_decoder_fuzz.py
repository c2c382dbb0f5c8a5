"""Property tests: whatever the bytes, the decoder returns a message or raises DecodeError.

Both implementations (C accelerator and pure Python) are run on every example and must agree:
the same object, or DecodeErrors with the same message type, offset and reason.
"""

from __future__ import annotations

import pgoutput_builder as pg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from applier.protocol import UNCHANGED_TOAST, DecodeError
from applier.protocol.decoder import ACCELERATED, decode, decode_pure

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

columns = st.lists(st.one_of(st.binary(max_size=12), st.none(), st.just(UNCHANGED_TOAST),
                             st.binary(max_size=12).map(pg.Binary)), max_size=6)
xids = st.one_of(st.none(), st.integers(0, 2**32 - 1))
relation_ids = st.integers(0, 2**32 - 1)



@st.composite
def dml_with_context(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A valid Insert/Update/Delete and whether it belongs inside a streamed block."""
    xid = draw(xids)
    kind = draw(st.sampled_from("IUD"))
    if kind == "I":
        data = pg.insert(draw(relation_ids), draw(columns), xid=xid)
    elif kind == "U":
        data = pg.update(draw(relation_ids), draw(columns), old=draw(st.none() | columns),
                         old_kind=draw(st.sampled_from("KO")), xid=xid)
    else:
        data = pg.delete(draw(relation_ids), draw(columns), old_kind=draw(st.sampled_from("KO")),
                         xid=xid)
    return data, xid is not None


dml = dml_with_context().map(lambda pair: pair[0])
other = st.sampled_from([
    pg.begin(1, 2, 3), pg.commit(0, 1, 2, 3), pg.origin(5, "origin"),
    pg.relation(1, "public", "t", "f", [(1, "id", 23, -1), (0, "v", 25, -1)]),
    pg.type_(9, "public", "mood"), pg.truncate([1, 2, 3], 3), pg.message(1, 7, "p", b"xyz"),
    pg.stream_start(4, True), pg.stream_stop(), pg.stream_commit(4, 0, 1, 2, 3),
    pg.stream_abort(4, 5), pg.stream_abort(4, 5, 6, 7), pg.begin_prepare(1, 2, 3, 4, "g"),
    pg.prepare(0, 1, 2, 3, 4, "g"), pg.commit_prepared(0, 1, 2, 3, 4, "g"),
    pg.rollback_prepared(0, 1, 2, 3, 4, 5, "g"), pg.stream_prepare(0, 1, 2, 3, 4, "g"),
])


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid message with one corruption: flip, truncate, insert, or a broken length field."""
    data = bytearray(draw(st.one_of(dml, other)))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
    at = draw(st.integers(0, len(data) - 1))
    if how == "flip":
        data[at] ^= draw(st.integers(1, 255))
    elif how == "truncate":
        del data[at:]
    elif how == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=4))
    else:  # overwrite 2 or 4 bytes with an extreme or random length
        size = draw(st.sampled_from([2, 4]))
        value = draw(st.sampled_from([b"\xff" * size, b"\x7f" + b"\xff" * (size - 1),
                                      b"\x80" + bytes(size - 1), bytes(size)]))
        data[at:at + size] = value
    return bytes(data)


def outcome(fn: object, data: bytes, in_stream: bool) -> object:
    """The decoded message, or the identifying triple of the DecodeError; anything else fails."""
    try:
        return fn(data, in_stream)  # type: ignore[operator]
    except DecodeError as exc:
        return ("error", exc.message_type, exc.offset, exc.reason)


def check(data: bytes, in_stream: bool) -> None:
    pure = outcome(decode_pure, data, in_stream)
    if ACCELERATED:
        accelerated = outcome(decode, data, in_stream)
        assert accelerated == pure
        assert _sizes(accelerated) == _sizes(pure)  # not part of equality


def _sizes(message: object) -> list[int]:
    rows = (getattr(message, name, None) for name in ("new_tuple", "old_tuple"))
    return [row.size for row in rows if row is not None]


@FUZZ
@given(st.binary(max_size=64), st.booleans())
def test_random_bytes(data: bytes, in_stream: bool) -> None:
    check(data, in_stream)


@FUZZ
@given(st.sampled_from(b"IUDBC"), st.binary(max_size=48), st.booleans())
def test_random_dml_bodies(type_byte: int, body: bytes, in_stream: bool) -> None:
    check(bytes([type_byte]) + body, in_stream)


@FUZZ
@given(mutated(), st.booleans())
def test_mutated_messages(data: bytes, in_stream: bool) -> None:
    check(data, in_stream)


@FUZZ
@given(dml_with_context())
def test_valid_dml_decodes_identically(pair: tuple[bytes, bool]) -> None:
    data, in_stream = pair
    assert not isinstance(outcome(decode_pure, data, in_stream), tuple)
    check(data, in_stream)


@pytest.mark.accelerated
@pytest.mark.skipif(not ACCELERATED, reason="C accelerator not built (or APPLIER_PURE_PYTHON=1)")
def test_c_path_takes_only_bytes_and_falls_back_for_others() -> None:
    from applier.protocol import _speedups  # type: ignore[attr-defined]

    data = pg.insert(1, [b"a"])
    assert _speedups.decode_insert(bytearray(data), 0) == decode_pure(data)
    with pytest.raises(TypeError):
        _speedups.decode_insert(data)


@pytest.mark.accelerated
@pytest.mark.skipif(not ACCELERATED, reason="C accelerator not built (or APPLIER_PURE_PYTHON=1)")
def test_c_dispatch_takes_every_argument_form_and_hands_the_rest_to_python() -> None:
    data = pg.insert(1, [b"a"], xid=7)
    assert decode(data, True) == decode(data, in_stream=True) == decode_pure(data, True)
    assert decode(bytearray(data), True) == decode_pure(data, True)          # not bytes: Python
    assert decode(pg.begin(1, 0, 2)) == decode_pure(pg.begin(1, 0, 2))       # in_stream defaults
    assert decode(pg.origin(5, "o")) == decode_pure(pg.origin(5, "o"))       # not a C type
    assert outcome(decode, b"", False) == outcome(decode_pure, b"", False)   # empty
    with pytest.raises(TypeError):
        decode(data, in_stream=True, extra=1)
    with pytest.raises(TypeError):
        decode()
