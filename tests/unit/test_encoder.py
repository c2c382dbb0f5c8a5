"""The encoder is the exact inverse of the decoder for transaction-body messages."""

from __future__ import annotations

import dataclasses

import pgoutput_builder as pg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from applier.protocol import decode
from applier.protocol.encoder import encode

columns = st.lists(st.one_of(st.binary(max_size=12), st.none(), st.just(pg.UNCHANGED_TOAST),
                             st.binary(max_size=12).map(pg.Binary)), max_size=6)
names = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=8)
ids = st.integers(1, 2**32 - 1)


@st.composite
def body_message(draw: st.DrawFn) -> tuple[bytes, bool]:
    """Bytes of one transaction-body message as the server sends them, and whether in a stream."""
    xid = draw(st.one_of(st.none(), ids))
    kind = draw(st.sampled_from("IUDTMRY"))
    if kind == "I":
        data = pg.insert(draw(ids), draw(columns), xid=xid)
    elif kind == "U":
        data = pg.update(draw(ids), draw(columns), old=draw(st.none() | columns),
                         old_kind=draw(st.sampled_from("KO")), xid=xid)
    elif kind == "D":
        data = pg.delete(draw(ids), draw(columns), old_kind=draw(st.sampled_from("KO")), xid=xid)
    elif kind == "T":
        data = pg.truncate(draw(st.lists(ids, max_size=4)), draw(st.integers(0, 3)), xid=xid)
    elif kind == "M":
        data = pg.message(draw(st.integers(0, 1)), draw(st.integers(0, 2**64 - 1)), draw(names),
                          draw(st.binary(max_size=20)), xid=xid)
    elif kind == "R":
        cols = draw(st.lists(st.tuples(st.integers(0, 1), names, ids, st.integers(-1, 2**31 - 1)),
                             max_size=4))
        data = pg.relation(draw(ids), draw(names), draw(names), draw(st.sampled_from("dnfi")), cols,
                           xid=xid)
    else:
        data = pg.type_(draw(ids), draw(names), draw(names), xid=xid)
    return data, xid is not None


@settings(max_examples=400, deadline=None)
@given(body_message())
def test_encode_reproduces_the_server_bytes(case: tuple[bytes, bool]) -> None:
    data, in_stream = case
    msg = decode(data, in_stream)
    assert encode(msg, in_stream) == data
    assert decode(encode(msg), False) == dataclasses.replace(msg, xid=None)


def test_origin_round_trips() -> None:
    data = pg.origin(0x16B374D848, "applier_s_db")
    assert encode(decode(data)) == data


def test_stream_encoding_needs_an_xid() -> None:
    msg = decode(pg.insert(5, [b"1"]))
    with pytest.raises(ValueError, match="needs a transaction id"):
        encode(msg, in_stream=True)


def test_control_messages_are_refused() -> None:
    with pytest.raises(TypeError, match="Begin"):
        encode(decode(pg.begin(1, 2, 3)))
