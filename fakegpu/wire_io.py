"""The byte-level pieces the wire codecs are written with: the protocol error, a bounds-checked
reader, the u16-length string and a struct pack that names what it was packing.

fakegpu/wire_bodies.py (generated from spec/wire.py) encodes and decodes the message bodies
with these; fakegpu/protocol.py adds the messages, frames and the stream parser around them.
"""
from __future__ import annotations

import array
import struct
import sys

from fakegpu.wire_spec import OPDESC_FIELDS

MAX_STR_BYTES = 0xFFFF
_U16 = struct.Struct("<H")


class ProtocolError(Exception):
    """The peer sent bytes that violate the protocol; the connection must be closed."""


def pack(st: struct.Struct, what: str, *values) -> bytes:
    try:
        return st.pack(*values)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode {what}: {exc} (values {values!r})") from None


def pack_array(code: str, values, what: str) -> bytes:
    """Values of one struct code, little-endian, through ``array`` (a 200k-result GROUP_DONE
    packs an order of magnitude faster than through struct); out-of-range values are refused."""
    try:
        packed = array.array(code, values)
    except (OverflowError, TypeError) as exc:
        raise ProtocolError(f"cannot encode {what}: {exc}") from None
    if packed.itemsize != struct.calcsize("<" + code):   # a C type of another width: never wrong bytes
        return pack(struct.Struct(f"<{len(packed)}{code}"), what, *packed)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def pack_exact(st: struct.Struct, what: str, values, count: int, count_name: str) -> bytes:
    """An array that must hold exactly ``count`` values (the body's ``count_name``)."""
    values = sized(values)
    if len(values) != count:
        raise ProtocolError(f"{what} has {len(values)} values, {count_name} is {count}")
    return pack(st, what, *values)


def sized(values):
    """``values`` when it has a length, else its values as a tuple (an encoder counts them)."""
    return values if hasattr(values, "__len__") else tuple(values)


def fixed_bytes(value, size: int, what: str) -> bytes:
    raw = bytes(value)
    if len(raw) != size:
        raise ProtocolError(f"{what} must be {size} bytes, got {len(raw)}")
    return raw


def opdesc_values(desc) -> tuple:
    """An OpDesc's values in wire order: the tuple itself, or any object with the fields."""
    if isinstance(desc, tuple):
        return desc
    return tuple(getattr(desc, name) for name in OPDESC_FIELDS)


def encode_str(text: str, *, truncate: bool = False) -> bytes:
    """u16 length + UTF-8. ``truncate`` cuts long diagnostics at a character boundary."""
    raw = text.encode("utf-8")
    if len(raw) > MAX_STR_BYTES:
        if not truncate:
            raise ProtocolError(f"string of {len(raw)} bytes exceeds the {MAX_STR_BYTES}-byte limit")
        raw = raw[:MAX_STR_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _U16.pack(len(raw)) + raw


class Reader:
    """Reads one body front to back; every shortfall is a ProtocolError naming the field."""
    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf, what: str):
        self.buf = memoryview(buf)
        self.pos = 0
        self.what = what

    def need(self, n: int, field_name: str) -> None:
        if self.pos + n > len(self.buf):
            raise ProtocolError(
                f"{self.what} body truncated: {field_name} needs {n} bytes at offset {self.pos}, "
                f"body has {len(self.buf)}")

    def unpack(self, st: struct.Struct, field_name: str):
        self.need(st.size, field_name)
        values = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return values

    def raw(self, n: int, field_name: str) -> bytes:
        self.need(n, field_name)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def str(self, field_name: str) -> str:
        (n,) = self.unpack(_U16, field_name + " length")
        raw = self.raw(n, field_name)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self.what} {field_name} is not valid UTF-8: {exc}") from None

    def array(self, code: str, size: int, count: int, field_name: str) -> tuple:
        """``count`` values of struct ``code`` (``size`` bytes each), checked against the body
        before anything is built (a hostile count fails at once)."""
        if count < 0:
            raise ProtocolError(f"{self.what} {field_name}: negative count {count}")
        self.need(count * size, field_name)
        return self.unpack(struct.Struct(f"<{count}{code}"), field_name) if count else ()

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def rest(self) -> bytes:
        out = bytes(self.buf[self.pos:])
        self.pos = len(self.buf)
        return out

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(
                f"{self.what} body has {len(self.buf) - self.pos} unexpected trailing bytes "
                f"(body_len {len(self.buf)}, decoded {self.pos})")
