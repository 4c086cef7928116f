"""The message body codecs, C++ and Python, written from spec/wire.py's BODIES and RECORDS
(spec/generate.py calls this; run that, not this).

Every field type of a body is one Kind subclass, which says for both languages how a
field of that kind is declared, encoded and decoded: the four emitters below only walk the
fields and ask the kind. A new field type is one new class.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

WIRE_SIZES = {"u8": 1, "u16": 2, "u32": 4, "u64": 8, "i32": 4, "f64": 8}
STRUCT_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i32": "i", "f64": "d"}
CPP_TYPES = {"u8": "uint8_t", "u16": "uint16_t", "u32": "uint32_t", "i32": "int32_t", "u64": "uint64_t",
             "f64": "double"}
OPDESC_VALUES = 17  # values an OpDesc unpacks to (checked against spec.OPDESC by Bodies)


def wire_size(t: str) -> int:
    """Bytes of a wire type: a scalar, or ``u8[N]``-style arrays of one (generate.py uses it too)."""
    m = re.fullmatch(r"(u8|u16|u32|u64|i32|f64)(?:\[(\d+)\])?", t)
    if not m:
        raise SystemExit(f"spec/wire.py: unknown wire type {t!r}")
    return WIRE_SIZES[m.group(1)] * int(m.group(2) or 1)


@dataclass(frozen=True)
class Field:
    name: str
    kind: "Kind"
    elem: Optional[str]      # scalar type of a scalar or array element; record name of a record array
    extra: object            # bytes: N; array / records: the count field's name
    default: object


@dataclass(frozen=True)
class Ctx:
    """Where a field is read from / written to in the code being emitted."""
    obj: str            # C++: "m." when encoding, "m->" when decoding; Python: "m." or "rec."
    what: str           # the message (or record) name, for error texts
    counted: dict       # count field name -> the array field it counts
    records: dict       # record name -> its fields


def snake(struct_name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", struct_name).lower()


# --------------------------------------------------------------------------- the field kinds

class Kind:
    fixed = False       # a fixed-size value Python packs with its neighbours into one struct

    def cpp_member(self, f: Field) -> str:
        raise NotImplementedError

    def cpp_encode(self, f: Field, c: Ctx) -> list:
        raise NotImplementedError

    def cpp_decode(self, f: Field, c: Ctx) -> list:
        raise NotImplementedError

    def py_encode(self, f: Field, c: Ctx) -> str:
        raise NotImplementedError

    def py_decode(self, f: Field, c: Ctx) -> list:
        raise NotImplementedError


class Scalar(Kind):
    fixed = True

    def cpp_member(self, f):
        return f"  {CPP_TYPES[f.elem]} {f.name} = {f.default if f.default is not None else 0};"

    def cpp_encode(self, f, c):
        if f.name in c.counted:  # a count is the length of the array it counts
            return [f"  w.{f.elem}(static_cast<{CPP_TYPES[f.elem]}>({c.obj}{c.counted[f.name]}.size()));"]
        return [f"  w.{f.elem}({c.obj}{f.name});"]

    def cpp_decode(self, f, c):
        if f.name in c.counted:
            out = [f"  {CPP_TYPES[f.elem]} {f.name};", f"  if (!r.{f.elem}(&{f.name})) return false;"]
            if f.elem == "i32":
                out.append(f"  if ({f.name} < 0) return false;")
            return out
        return [f"  if (!r.{f.elem}(&{c.obj}{f.name})) return false;"]

    def struct_code(self, f):
        return STRUCT_CODES[f.elem]

    def py_values(self, f, c):
        return f"len({c.counted[f.name]})" if f.name in c.counted else f"{c.obj}{f.name}"

    def py_unpacked(self, f, index):
        return f"v[{index}]", 1


class OpDescKind(Kind):
    """An 88-byte OpDesc inside a record (Python: the tuple OPDESC_FORMAT unpacks to)."""
    fixed = True

    def cpp_member(self, f):
        return f"  OpDesc {f.name};"

    def cpp_encode(self, f, c):
        return ["  {", "    uint8_t desc[kOpDescSize];", f"    encode_opdesc(desc, {c.obj}{f.name});",
                "    w.raw(desc, kOpDescSize);", "  }"]

    def cpp_decode(self, f, c):
        return [f"  if (!decode_opdesc(r, &{c.obj}{f.name})) return false;"]

    def struct_code(self, f):
        return "OPDESC"

    def py_values(self, f, c):
        return f"*opdesc_values({c.obj}{f.name})"

    def py_unpacked(self, f, index):
        return f"v[{index}:{index + OPDESC_VALUES}]", OPDESC_VALUES


class Str(Kind):
    def __init__(self, truncate: bool = False, optional: bool = False):
        self.truncate, self.optional = truncate, optional

    def cpp_member(self, f):
        return f"  std::string {f.name};"

    def cpp_encode(self, f, c):  # Writer::str cuts any string at the u16 limit
        if self.optional:
            return [f"  if (!{c.obj}{f.name}.empty()) w.str({c.obj}{f.name});"]
        return [f"  w.str({c.obj}{f.name});"]

    def cpp_decode(self, f, c):
        if self.optional:
            return [f"  {c.obj}{f.name}.clear();",
                    f"  if (r.remaining() != 0 && !r.str(&{c.obj}{f.name})) return false;"]
        return [f"  if (!r.str(&{c.obj}{f.name})) return false;"]

    def py_encode(self, f, c):
        if self.optional:
            return f"(encode_str({c.obj}{f.name}) if {c.obj}{f.name} else b\"\")"
        return f"encode_str({c.obj}{f.name}{', truncate=True' if self.truncate else ''})"

    def py_decode(self, f, c):
        if self.optional:
            return [f"    {f.name} = r.str(\"{f.name}\") if r.remaining() else \"\""]
        return [f"    {f.name} = r.str(\"{f.name}\")"]


class Bytes(Kind):
    def cpp_member(self, f):
        return f"  uint8_t {f.name}[{f.extra}] = {{}};"

    def cpp_encode(self, f, c):
        return [f"  w.raw({c.obj}{f.name}, {f.extra});"]

    def cpp_decode(self, f, c):
        return [f"  if (!r.raw({c.obj}{f.name}, {f.extra})) return false;"]

    def py_encode(self, f, c):
        return f"fixed_bytes({c.obj}{f.name}, {f.extra}, \"{c.what} {f.name}\")"

    def py_decode(self, f, c):
        return [f"    {f.name} = r.raw({f.extra}, \"{f.name}\")"]


class Array(Kind):
    """T[count]: the count is an earlier field of the same body and not a member."""

    def cpp_member(self, f):
        return f"  std::vector<{CPP_TYPES[f.elem]}> {f.name};"

    def cpp_encode(self, f, c):
        return [f"  for ({CPP_TYPES[f.elem]} v : {c.obj}{f.name}) w.{f.elem}(v);"]

    def cpp_decode(self, f, c):
        return ["  // Checked against the body before allocating.",
                f"  if (!r.fits({f.extra}, {WIRE_SIZES[f.elem]})) return false;",
                f"  {c.obj}{f.name}.resize({f.extra});",
                f"  for ({CPP_TYPES[f.elem]}& v : {c.obj}{f.name})",
                f"    if (!r.{f.elem}(&v)) return false;"]

    def py_encode(self, f, c):
        return f"pack_array(\"{STRUCT_CODES[f.elem]}\", {f.name}, \"{c.what} {f.name}\")"

    def py_decode(self, f, c):
        return [f"    {f.name} = r.array(\"{STRUCT_CODES[f.elem]}\", {WIRE_SIZES[f.elem]}, {f.extra}, \"{f.name}\")"]


class OuterArray(Kind):
    """T[field] inside a record: exactly the enclosing body's `field` values in every record
    (C++ writes missing ones as 0 and drops extra ones; Python refuses a wrong length)."""

    def cpp_member(self, f):
        return f"  std::vector<{CPP_TYPES[f.elem]}> {f.name};  // {f.extra} values on the wire"

    def cpp_encode(self, f, c):
        t = CPP_TYPES[f.elem]
        return [f"  for (uint64_t i = 0; i < {f.extra}; i++) w.{f.elem}(i < {c.obj}{f.name}.size() ? "
                f"{c.obj}{f.name}[i] : {t}(0));"]

    def cpp_decode(self, f, c):
        return [f"  {c.obj}{f.name}.resize({f.extra});",
                f"  for ({CPP_TYPES[f.elem]}& v : {c.obj}{f.name})",
                f"    if (!r.{f.elem}(&v)) return false;"]


class Records(Kind):
    """Rec[count]: an array of records that RECORDS declares."""

    def cpp_member(self, f):
        return f"  std::vector<{f.elem}> {f.name};"

    def cpp_encode(self, f, c):
        outer = "".join(f", {c.obj}{o}" for o in outer_counts(c.records[f.elem]))
        return [f"  for (const {f.elem}& v : {c.obj}{f.name}) encode(w, v{outer});"]

    def cpp_decode(self, f, c):
        fields = c.records[f.elem]
        outer = outer_counts(fields)
        per_record = [f"k{f.elem}FixedBytes"] + [f"{WIRE_SIZES[g.elem]}ull * {c.obj}{g.extra}"
                                                 for g in fields if isinstance(g.kind, OuterArray)]
        out = ["  // Checked against the body before allocating (each array of a record fits, then the records).",
               f"  if ({f.extra} != 0) {{"]
        out += [f"    if (!r.fits({c.obj}{g.extra}, {WIRE_SIZES[g.elem]})) return false;"
                for g in fields if isinstance(g.kind, OuterArray)]
        out += [f"    if (!r.fits({f.extra}, {' + '.join(per_record)})) return false;",
                "  }",
                f"  {c.obj}{f.name}.resize({f.extra});",
                f"  for ({f.elem}& v : {c.obj}{f.name})",
                f"    if (!decode(r, &v{''.join(f', {c.obj}{o}' for o in outer)})) return false;"]
        return out

    def py_encode(self, f, c):
        outer = "".join(f", {c.obj}{o}" for o in outer_counts(c.records[f.elem]))
        return f"encode_{snake(f.elem)}s({f.name}{outer})"

    def py_decode(self, f, c):
        outer = "".join(f", {o}" for o in outer_counts(c.records[f.elem]))
        return [f"    {f.name} = decode_{snake(f.elem)}s(r, {f.extra}{outer})"]


SCALAR, OPDESC, STR, TEXT, OPTIONAL_STR = Scalar(), OpDescKind(), Str(), Str(truncate=True), Str(optional=True)
BYTES, ARRAY, OUTER_ARRAY, RECORDS = Bytes(), Array(), OuterArray(), Records()


def parse_field(field, record_names=(), in_record: bool = False) -> Field:
    name, t = field[0], field[1]
    default = field[2] if len(field) > 2 else None
    if t in CPP_TYPES:
        return Field(name, SCALAR, t, None, default)
    if t == "OpDesc" and in_record:
        return Field(name, OPDESC, None, None, default)
    if t in ("str", "text", "str?") and not in_record:
        return Field(name, {"str": STR, "text": TEXT, "str?": OPTIONAL_STR}[t], None, None, default)
    m = re.fullmatch(r"bytes\[(\d+)\]", t)
    if m and not in_record:
        return Field(name, BYTES, None, int(m.group(1)), default)
    m = re.fullmatch(r"(u8|u16|u32|i32|u64|f64)\[([a-z_]+)\]", t)
    if m:
        return Field(name, OUTER_ARRAY if in_record else ARRAY, m.group(1), m.group(2), default)
    m = re.fullmatch(r"([A-Z]\w*)\[([a-z_]+)\]", t)
    if m and m.group(1) in record_names and not in_record:
        return Field(name, RECORDS, m.group(1), m.group(2), default)
    where = "RECORDS" if in_record else "BODIES"
    raise SystemExit(f"spec/wire.py: {where}: field type {t!r} of {name} is unknown or not allowed there")


def outer_counts(record_fields) -> list:
    """The enclosing body's fields that size a record's arrays, in first-use order."""
    return list(dict.fromkeys(f.extra for f in record_fields if isinstance(f.kind, OuterArray)))


class Bodies:
    """spec.BODIES and spec.RECORDS parsed and checked."""

    def __init__(self, spec):
        if len(spec.OPDESC) != OPDESC_VALUES:
            raise SystemExit(f"spec/wire.py: OPDESC has {len(spec.OPDESC)} fields; gen_bodies expects {OPDESC_VALUES}")
        self.opdesc_bytes = sum(wire_size(t) for _name, t, _short, _doc in spec.OPDESC)
        names = [r[0] for r in spec.RECORDS]
        self.records = {rec: [parse_field(f, in_record=True) for f in fields] for rec, fields in spec.RECORDS}
        for rec, fields in self.records.items():
            if not any(f.kind.fixed for f in fields):
                raise SystemExit(f"spec/wire.py: RECORDS {rec}: a record needs at least one fixed-size field")
        types = {m[1] for m in spec.MESSAGES}
        self.bodies = []
        for struct_name, messages, raw in spec.BODIES:
            for m in messages:
                if m not in types:
                    raise SystemExit(f"spec/wire.py: BODIES {struct_name}: no message {m}")
            fields = [parse_field(f, names) for f in raw]
            self._check(struct_name, fields)
            if struct_name in spec.WRITTEN_IN_PLACE and not all(f.kind is SCALAR for f in fields):
                raise SystemExit(f"spec/wire.py: WRITTEN_IN_PLACE {struct_name}: only bodies of scalars")
            self.bodies.append((struct_name, messages, fields))

    def _check(self, struct_name, fields):
        seen = []
        counts = set(self.counted(fields))
        for i, f in enumerate(fields):
            if f.kind in (ARRAY, RECORDS) and f.extra not in seen:
                raise SystemExit(f"spec/wire.py: BODIES {struct_name}.{f.name}: its count {f.extra} must come first")
            if f.kind is RECORDS:
                for o in outer_counts(self.records[f.elem]):
                    if o not in seen or o in counts:
                        raise SystemExit(f"spec/wire.py: BODIES {struct_name}.{f.name}: records sized by {o}, "
                                         f"which must be an earlier member of the body")
            if f.kind is OPTIONAL_STR and i != len(fields) - 1:
                raise SystemExit(f"spec/wire.py: BODIES {struct_name}.{f.name}: an optional str must be last")
            seen.append(f.name)

    @staticmethod
    def counted(fields) -> dict:
        return {f.extra: f.name for f in fields if f.kind in (ARRAY, RECORDS)}

    @classmethod
    def members(cls, fields) -> list:
        """The fields that are struct members: all but the array counts."""
        counted = cls.counted(fields)
        return [f for f in fields if f.name not in counted]


def record_fixed_bytes(fields, opdesc_bytes: int) -> int:
    return sum(opdesc_bytes if f.kind is OPDESC else WIRE_SIZES[f.elem] for f in fields if f.kind.fixed)


# --------------------------------------------------------------------------------------- C++

def cpp_messages(spec) -> str:
    b = Bodies(spec)
    out = [
        "// Generated by spec/generate.py from spec/wire.py (OPDESC, RECORDS, BODIES): do not edit.",
        "// The message structs and their codecs; included by wire/protocol.h after Writer and Reader.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <cstring>",
        "#include <string>",
        "#include <vector>",
        "",
        "namespace fakegpu::proto {",
        "",
        "// The 88-byte operation descriptor.",
        "struct OpDesc {",
    ]
    for name, t, _, _ in spec.OPDESC:
        default = spec.OPDESC_DEFAULTS.get(name, 0)
        m = re.fullmatch(r"u8\[(\d+)\]", t)
        out.append(f"  uint8_t {name}[{m.group(1)}] = {{}};" if m else f"  {CPP_TYPES[t]} {name} = {default};")
    out += ["};", "", "// Writes exactly kOpDescSize bytes at `o` (hot path: no vector growth).",
            "inline void encode_opdesc(uint8_t* o, const OpDesc& d) {"]
    pos = 0
    for name, t, _, _ in spec.OPDESC:
        size = wire_size(t)
        out.append(f"  memcpy(o + {pos}, {'' if '[' in t else '&'}d.{name}, {size});")
        pos += size
    out += ["}", "", "inline bool decode_opdesc(Reader& r, OpDesc* d) {", "  return"]
    parts = [f"r.raw(d->{name}, {wire_size(t)})" if "[" in t else f"r.{t}(&d->{name})"
             for name, t, _, _ in spec.OPDESC]
    out.append("      " + " &&\n      ".join(parts) + ";")
    out += ["}", ""]
    for rec, fields in b.records.items():
        outer = outer_counts(fields)
        params = "".join(f", uint64_t {o}" for o in outer)
        c_enc = Ctx("m.", rec, {}, b.records)
        c_dec = Ctx("m->", rec, {}, b.records)
        out.append(f"// A record of RECORDS; its arrays hold {', '.join(outer) or 'no'} values of the enclosing body.")
        out.append(f"struct {rec} {{")
        out += [f.kind.cpp_member(f) for f in fields]
        out += ["};", f"constexpr size_t k{rec}FixedBytes = {record_fixed_bytes(fields, b.opdesc_bytes)};  // before its arrays",
                f"inline void encode(Writer& w, const {rec}& m{params}) {{"]
        for f in fields:
            out += f.kind.cpp_encode(f, c_enc)
        out += ["}", f"inline bool decode(Reader& r, {rec}* m{params}) {{"]
        for f in fields:
            out += f.kind.cpp_decode(f, c_dec)
        out += ["  return true;", "}", ""]
    for struct_name, messages, fields in b.bodies:
        counted = b.counted(fields)
        note = f"; {', '.join(counted)} on the wire is the array's length" if counted else ""
        out.append(f"// {' / '.join(messages)}{note}.")
        out.append(f"struct {struct_name} {{")
        out += [f.kind.cpp_member(f) for f in b.members(fields)]
        out += ["};"]
        c_enc = Ctx("m.", struct_name, counted, b.records)
        c_dec = Ctx("m->", struct_name, counted, b.records)
        out.append(f"inline void encode(Writer& w, const {struct_name}& m) {{")
        for f in fields:
            out += f.kind.cpp_encode(f, c_enc)
        out += ["}", f"inline bool decode(Reader& r, {struct_name}* m) {{"]
        for f in fields:
            out += f.kind.cpp_decode(f, c_dec)
        out += ["  return true;", "}"]
        if struct_name in spec.WRITTEN_IN_PLACE:
            out += cpp_fixed_writer(struct_name, fields)
        out.append("")
    out += ["}  // namespace fakegpu::proto", ""]
    return "\n".join(out)


def cpp_fixed_writer(struct_name, fields) -> list:
    """A body of scalars only also gets its size and a writer into a caller's buffer (hot paths
    that assemble a frame in place)."""
    size = sum(WIRE_SIZES[f.elem] for f in fields)
    out = [f"constexpr size_t k{struct_name}Bytes = {size};",
           f"inline void encode_into(uint8_t* o, const {struct_name}& m) {{"]
    pos = 0
    for f in fields:
        out.append(f"  memcpy(o + {pos}, &m.{f.name}, {WIRE_SIZES[f.elem]});")
        pos += WIRE_SIZES[f.elem]
    return out + ["}"]


# ------------------------------------------------------------------------------------ Python

def py_runs(fields):
    """The fields as runs: ("run", [fields]) of consecutive fixed-size values, or ("one", field)."""
    items, run = [], []
    for f in fields:
        if f.kind.fixed:
            run.append(f)
            continue
        if run:
            items.append(("run", run))
            run = []
        items.append(("one", f))
    if run:
        items.append(("run", run))
    return items


def py_struct(run) -> str:
    return "\"<" + "".join(f.kind.struct_code(f) for f in run).replace("OPDESC", "\" + OPDESC_FORMAT[1:] + \"") + "\""


def py_record(rec, fields, records) -> list:
    """encode_<rec>s(records, outer...) and decode_<rec>s(r, count, outer...)."""
    fn, upper = snake(rec), snake(rec).upper()
    outer = outer_counts(fields)
    runs = py_runs(fields)
    arrays = [f for f in fields if isinstance(f.kind, OuterArray)]
    out = [""]
    out += [f"{upper}_{i} = struct.Struct({py_struct(item)})" for i, (kind, item) in enumerate(runs) if kind == "run"]
    out += ["", ""]
    c = Ctx("rec.", rec, {}, records)
    out.append(f"def encode_{fn}s(records, {', '.join(outer)}) -> bytes:")
    for a in arrays:
        out.append(f"    {a.name}_st = struct.Struct(f\"<{{{a.extra}}}{STRUCT_CODES[a.elem]}\")")
    out += ["    parts = []", "    for rec in records:"]
    for i, (kind, item) in enumerate(runs):
        if kind == "run":
            values = ", ".join(f.kind.py_values(f, c) for f in item)
            out.append(f"        parts.append(pack({upper}_{i}, \"{rec}\", {values}))")
        else:
            out.append(f"        parts.append(pack_exact({item.name}_st, \"{rec} {item.name}\", rec.{item.name}, "
                       f"{item.extra}, \"{item.extra}\"))")
    out += ["    return b\"\".join(parts)", "", ""]
    out.append(f"def decode_{fn}s(r: Reader, count: int, {', '.join(outer)}) -> tuple:")
    out.append(f"    \"\"\"`count` {rec} records, their size checked against the body before anything is built.\"\"\"")
    for a in arrays:
        out.append(f"    {a.name}_st = struct.Struct(f\"<{{{a.extra}}}{STRUCT_CODES[a.elem]}\")")
    sizes = [f"{upper}_{i}.size" for i, (kind, _) in enumerate(runs) if kind == "run"] + [f"{a.name}_st.size" for a in arrays]
    out += [f"    size = {' + '.join(sizes)}", f"    r.need(count * size, f\"{{count}} {rec} records\")",
            "    buf, pos, out = r.buf, r.pos, []", "    for _ in range(count):"]
    names = []
    for i, (kind, item) in enumerate(runs):
        if kind == "run":
            out.append(f"        v = {upper}_{i}.unpack_from(buf, pos)")
            out.append(f"        pos += {upper}_{i}.size")
            index = 0
            for f in item:
                expr, width = f.kind.py_unpacked(f, index)
                out.append(f"        {f.name} = {expr}")
                names.append(f.name)
                index += width
        else:
            out.append(f"        {item.name} = {item.name}_st.unpack_from(buf, pos)")
            out.append(f"        pos += {item.name}_st.size")
            names.append(item.name)
    out += [f"        out.append(({', '.join(names)}))", "    r.pos = pos", "    return tuple(out)", ""]
    return out


def py_bodies(spec) -> str:
    b = Bodies(spec)
    out = ['"""Generated by spec/generate.py from spec/wire.py (RECORDS, BODIES): do not edit.',
           "",
           "Each message body's encoder and decoder: ``encode_<body>(m)`` reads the members from any object",
           "that has them as attributes (an array's count is its length) and returns the bytes;",
           "``decode_<body>(r)`` reads them from a fakegpu.wire_io.Reader and returns the members in order",
           "(a record as a tuple of its fields, an OpDesc as the tuple OPDESC_FORMAT unpacks to).",
           "``CODECS`` maps a message type to its (encode, decode); fakegpu/protocol.py wraps them.",
           '"""',
           "from __future__ import annotations",
           "",
           "import struct",
           "",
           "from fakegpu.wire_io import (Reader, encode_str, fixed_bytes, opdesc_values, pack, pack_array,",
           "                             pack_exact, sized)",
           "from fakegpu.wire_spec import OPDESC_FORMAT",
           ""]
    for rec, fields in b.records.items():
        out += py_record(rec, fields, b.records)
    codecs = []
    for struct_name, messages, fields in b.bodies:
        fn = snake(struct_name)
        what = messages[0] if len(messages) == 1 else " / ".join(messages)
        counted = b.counted(fields)
        c = Ctx("m.", what, counted, b.records)
        runs = py_runs(fields)
        out += [""] + [f"{fn.upper()}_{i} = struct.Struct({py_struct(item)})"
                       for i, (kind, item) in enumerate(runs) if kind == "run"] + ["", ""]
        out.append(f"def encode_{fn}(m) -> bytes:")
        for array in counted.values():
            out.append(f"    {array} = sized(m.{array})")
        parts = []
        for i, (kind, item) in enumerate(runs):
            if kind == "run":
                parts.append(f"pack({fn.upper()}_{i}, \"{what}\", {', '.join(f.kind.py_values(f, c) for f in item)})")
            else:
                parts.append(item.kind.py_encode(item, c))
        if len(parts) > 1:
            out.append("    return (" + "\n            + ".join(parts) + ")")
        else:
            out.append("    return " + (parts[0] if parts else 'b""'))
        out += ["", ""]
        out.append(f"def decode_{fn}(r: Reader) -> tuple:")
        for i, (kind, item) in enumerate(runs):
            if kind == "run":
                names = [f.name for f in item]
                target = ", ".join(names) + ("," if len(names) == 1 else "")
                out.append(f"    {target} = r.unpack({fn.upper()}_{i}, \"{'/'.join(names)}\")")
            else:
                out += item.kind.py_decode(item, c)
        members = [f.name for f in b.members(fields)]
        out.append("    return (" + ", ".join(members) + ("," if len(members) == 1 else "") + ")")
        out += [""]
        codecs += [(code, name, fn) for code, name, *_ in spec.MESSAGES for m in messages if name == m]
    out += ["", "# message type -> (encode, decode)", "CODECS = {"]
    out += [f"    {code}: (encode_{fn}, decode_{fn}),  # {name}" for code, name, fn in sorted(codecs)]
    out += ["}", ""]
    return "\n".join(out)
