"""COPY text encoding of insert runs: the C accelerator and the pure-Python reference agree."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from applier.apply import copy as copy_module
from applier.apply.copy import copy_text_pure

SPECIAL = [b"", b"\\", b"\t", b"\n", b"\r", b"\\N", b"\\.", b"a\tb\nc\\d\re", "日本 ✓".encode()]


def test_escapes_and_nulls() -> None:
    rows = [(b"1", b"tab\there", None), (b"2", b"back\\slash\nnl\r", b"\\N")]
    assert copy_text_pure(rows) == (b"1\ttab\\there\t\\N\n"
                                    b"2\tback\\\\slash\\nnl\\r\t\\\\N\n")


def _speedups():
    # ./dev test always builds the accelerators (an editable install compiles them): a missing
    # one is a broken build, which must fail here rather than leave the C code untested.
    from applier.protocol import _speedups  # type: ignore[attr-defined]
    return _speedups


def _random_rows(seed: int, count: int) -> Iterator[tuple[random.Random, int, list[tuple[bytes | None, ...]]]]:
    """``count`` times up to 20 rows of 1 to 6 values (NULLs, and bytes made of every sequence
    COPY escapes), with the generator and the width."""
    chance = random.Random(seed)
    for _ in range(count):
        width = chance.randint(1, 6)
        yield chance, width, [tuple(None if chance.random() < 0.1 else
                                    b"".join(chance.choice(SPECIAL + [b"x", b"yz"])
                                             for _ in range(chance.randint(0, 5)))
                                    for _ in range(width))
                              for _ in range(chance.randint(0, 20))]


def test_accelerator_matches_the_reference() -> None:
    speedups = _speedups()
    for _, _, rows in _random_rows(6, 200):
        assert speedups.copy_text(rows) == copy_text_pure(rows)


def test_accelerator_rejects_what_is_not_bytes() -> None:
    speedups = _speedups()
    with pytest.raises(TypeError):
        speedups.copy_text([(b"1", "text")])
    with pytest.raises(TypeError):
        speedups.copy_text([[b"1"]])


def test_copy_fields_in_c_reads_what_the_reference_reads() -> None:
    """Chosen fields of every row, in any order and repeated, from text and binary COPY data."""
    from applier.apply.copy import copy_binary, copy_fields_pure

    speedups = _speedups()
    for chance, width, rows in _random_rows(8, 300):
        order = tuple(chance.randrange(width) for _ in range(chance.randint(0, 2 * width)))
        for binary, data in ((False, copy_text_pure(rows)), (True, copy_binary(rows))):
            expected = [row[i] for row in rows for i in order]
            assert copy_fields_pure(data, binary, order) == expected
            assert speedups.copy_fields(bytearray(data), binary, order) == expected


def test_copy_fields_in_c_rejects_data_copy_text_never_writes() -> None:
    from applier.apply.copy import copy_binary

    speedups = _speedups()
    with pytest.raises(ValueError, match="ends inside a row"):
        speedups.copy_fields(b"1\t2", False, (0,))          # no newline
    with pytest.raises(ValueError, match="ends inside a row"):
        speedups.copy_fields(copy_binary([(b"abc",)])[:-1], True, (0,))
    with pytest.raises(ValueError, match="escape"):
        speedups.copy_fields(b"a\\q\n", False, (0,))  # backslash, q
    with pytest.raises(ValueError, match="no field 2"):
        speedups.copy_fields(b"a\tb\n", False, (2,))


def test_pure_python_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIER_PURE_PYTHON", "1")
    assert copy_module._accelerated() is None


def test_pure_python_switch_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of names turns only those accelerators off: the lane alone, the decoder's kept."""
    from applier.apply.fast.lane import core
    from applier.implementation import accelerator

    _speedups()  # built: the switch, not a missing module, decides below
    monkeypatch.setenv("APPLIER_PURE_PYTHON", "apply._lane")
    assert core() is None
    assert copy_module._accelerated() is not None
    monkeypatch.setenv("APPLIER_PURE_PYTHON", "source._frames, apply._lane")
    assert core() is None and accelerator("source._frames") is None
    monkeypatch.setenv("APPLIER_PURE_PYTHON", "0")
    assert core() is not None
    with pytest.raises(ValueError, match="not one of applier's accelerators"):
        accelerator("apply._nothing")


def test_copy_data_reads_back_into_the_rows_it_was_made_of() -> None:
    """A short run goes back to rows for an INSERT: text and binary data are read back exactly,
    every special byte sequence and NULL included."""
    from applier.apply.copy import copy_binary, copy_binary_rows, copy_text_rows

    rng = random.Random(7)
    for _ in range(200):
        width = rng.randint(1, 5)
        rows = [tuple(None if rng.random() < 0.2 else rng.choice(SPECIAL) + rng.choice(SPECIAL)
                      for _ in range(width)) for _ in range(rng.randint(1, 6))]
        assert copy_text_rows(copy_text_pure(rows)) == rows
        assert copy_binary_rows(copy_binary(rows)) == rows
