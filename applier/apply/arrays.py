"""Array parameters: the values of one column for many rows as one statement parameter.

Owns the two encodings of a one-dimensional array of values that are already in their type's
text or binary form: the text literal (``{"a","b",NULL}``, every element quoted) and the binary
send format (which names its element type's OID). A statement that takes its rows as arrays
(``unnest($1::int[], $2::text[])``) has one shape for any number of rows: one prepared statement,
and few parameters to bind. Must never build SQL.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["binary_array", "text_array"]

_NULL = b"\xff\xff\xff\xff"


def text_array(values: Sequence[bytes | None]) -> bytes:
    """``{...}``: each value (its type's text form) quoted, backslashes and quotes escaped."""
    return b"{" + b",".join(
        b"NULL" if value is None else b'"' + value.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'
        for value in values) + b"}"


def binary_array(element_oid: int, values: Sequence[bytes | None]) -> bytes:
    """The binary form of a one-dimensional array of ``values`` (each in its type's send format)
    of the type ``element_oid``, indexed from 1."""
    has_null = any(value is None for value in values)
    header = b"".join(n.to_bytes(4, "big") for n in (1, int(has_null), element_oid, len(values), 1))
    return header + b"".join(_NULL if value is None else len(value).to_bytes(4, "big") + value
                             for value in values)
