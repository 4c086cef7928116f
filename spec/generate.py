#!/usr/bin/env python3
"""Writes the code and doc tables that spec/wire.py and spec/env.py declare (the way NCCL's
generate.py writes its kernel tables): native/src/generated/wire_spec.h and wire_messages.h
(the message structs and codecs), fakegpu/wire_spec.py and wire_bodies.py (the body codecs),
the marked tables of docs/protocol.md and the environment table of docs/usage.md.

    python spec/generate.py           # rewrite what is stale
    python spec/generate.py --check   # exit 1 and name every stale file (tests/unit/test_wire_spec.py)
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPP_OUT = ROOT / "native" / "src" / "generated" / "wire_spec.h"
CPP_MESSAGES_OUT = ROOT / "native" / "src" / "generated" / "wire_messages.h"
PY_OUT = ROOT / "fakegpu" / "wire_spec.py"
PY_BODIES_OUT = ROOT / "fakegpu" / "wire_bodies.py"
DOC = ROOT / "docs" / "protocol.md"

WIRE_SIZES = {"u8": 1, "u16": 2, "u32": 4, "u64": 8, "i32": 4, "f64": 8}
STRUCT_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i32": "i", "f64": "d"}
PER_MEMBER = 255  # the C++ spelling of "n" blocks


def load_spec(name: str = "wire"):
    spec = importlib.util.spec_from_file_location(f"fakegpu_{name}_spec_source", ROOT / "spec" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


USAGE = ROOT / "docs" / "usage.md"


def env_table(env) -> str:
    rows = ["| Variable | Default | Read by | Meaning |", "|---|---|---|---|"]
    rows += ["| " + " | ".join(cells) + " |" for cells in env.VARIABLES]
    return "\n".join(rows)


def wire_size(t: str) -> int:
    m = re.fullmatch(r"(u8|u16|u32|u64|i32|f64)(?:\[(\d+)\])?", t)
    if not m:
        raise SystemExit(f"spec/wire.py: unknown wire type {t!r}")
    return WIRE_SIZES[m.group(1)] * int(m.group(2) or 1)


def struct_code(t: str) -> str:
    m = re.fullmatch(r"(u8|u16|u32|u64|i32|f64)(?:\[(\d+)\])?", t)
    if m.group(2):
        if m.group(1) != "u8":
            raise SystemExit(f"spec/wire.py: only u8 arrays are supported, not {t!r}")
        return f"{m.group(2)}s"
    return STRUCT_CODES[m.group(1)]


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def offsets(fields):
    out, pos = [], 0
    for f in fields:
        out.append(pos)
        pos += wire_size(f[1])
    return out, pos


def check(spec) -> None:
    """Refuses a spec that contradicts itself (duplicate codes, holes in the OpDesc)."""
    for what, rows in (("MESSAGES", spec.MESSAGES), ("KINDS", spec.KINDS), ("DATATYPES", spec.DATATYPES),
                       ("REDOPS", spec.REDOPS), ("RESULTS", spec.RESULTS)):
        codes = [r[0] for r in rows]
        names = [r[1] for r in rows]
        if len(set(codes)) != len(codes) or len(set(names)) != len(names):
            raise SystemExit(f"spec/wire.py: {what} has a duplicate code or name")
    for what, rows in (("DATATYPES", spec.DATATYPES), ("REDOPS", spec.REDOPS), ("RESULTS", spec.RESULTS)):
        if [r[0] for r in rows] != list(range(len(rows))):
            raise SystemExit(f"spec/wire.py: {what} codes must be 0..{len(rows) - 1} in order")
    if [k[0] for k in spec.KINDS] != list(range(1, len(spec.KINDS) + 1)):
        raise SystemExit("spec/wire.py: KINDS codes must be 1..N in order")
    _, header = offsets(spec.HEADER)
    _, opdesc = offsets(spec.OPDESC)
    if header != 16 or opdesc % 8:
        raise SystemExit(f"spec/wire.py: header is {header} bytes (must be 16), OpDesc {opdesc} (a multiple of 8)")


# ------------------------------------------------------------------------- C++ message codecs

CPP_TYPES = {"u8": "uint8_t", "u16": "uint16_t", "u32": "uint32_t", "i32": "int32_t", "u64": "uint64_t",
             "f64": "double"}


def body_field(field):
    """(name, kind, element type, size or count field, default) of one BODIES field, where kind is
    scalar, str, optional_str, bytes or array."""
    name, t = field[0], field[1]
    default = field[2] if len(field) > 2 else None
    if t in CPP_TYPES:
        return name, "scalar", t, None, default
    if t in ("str", "text", "str?"):
        return name, {"str": "str", "text": "text", "str?": "optional_str"}[t], None, None, default
    m = re.fullmatch(r"bytes\[(\d+)\]", t)
    if m:
        return name, "bytes", None, int(m.group(1)), default
    m = re.fullmatch(r"(u8|u16|u32|i32|u64|f64)\[([a-z_]+)\]", t)
    if m:
        return name, "array", m.group(1), m.group(2), default
    raise SystemExit(f"spec/wire.py: BODIES: unknown field type {t!r} of {name}")


def check_bodies(spec) -> None:
    types = {m[1] for m in spec.MESSAGES}
    for struct_name, messages, fields in spec.BODIES:
        for m in messages:
            if m not in types:
                raise SystemExit(f"spec/wire.py: BODIES {struct_name}: no message {m}")
        seen, counts = [], set()
        for i, f in enumerate(fields):
            name, kind, _, extra, _ = body_field(f)
            if kind == "array":
                if extra not in seen:
                    raise SystemExit(f"spec/wire.py: BODIES {struct_name}.{name}: its count {extra} must come first")
                counts.add(extra)
            if kind == "optional_str" and i != len(fields) - 1:
                raise SystemExit(f"spec/wire.py: BODIES {struct_name}.{name}: an optional str must be last")
            seen.append(name)


def body_members(fields):
    """The fields that are struct members: all but the array counts."""
    counts = {body_field(f)[3] for f in fields if body_field(f)[1] == "array"}
    return [f for f in fields if f[0] not in counts]


def cpp_member(field) -> str:
    name, kind, elem, extra, default = body_field(field)
    if kind == "scalar":
        return f"  {CPP_TYPES[elem]} {name} = {default if default is not None else 0};"
    if kind in ("str", "text", "optional_str"):
        return f"  std::string {name};"
    if kind == "bytes":
        return f"  uint8_t {name}[{extra}] = {{}};"
    return f"  std::vector<{CPP_TYPES[elem]}> {name};"


def cpp_encode(struct_name, fields) -> list:
    arrays = {body_field(f)[3]: f[0] for f in fields if body_field(f)[1] == "array"}
    out = [f"inline void encode(Writer& w, const {struct_name}& m) {{"]
    for f in fields:
        name, kind, elem, extra, _ = body_field(f)
        if name in arrays:
            out.append(f"  w.{elem}(static_cast<{CPP_TYPES[elem]}>(m.{arrays[name]}.size()));")
        elif kind == "scalar":
            out.append(f"  w.{elem}(m.{name});")
        elif kind in ("str", "text"):  # Writer::str cuts any string at the u16 limit
            out.append(f"  w.str(m.{name});")
        elif kind == "optional_str":
            out.append(f"  if (!m.{name}.empty()) w.str(m.{name});")
        elif kind == "bytes":
            out.append(f"  w.raw(m.{name}, {extra});")
        else:
            out.append(f"  for ({CPP_TYPES[elem]} v : m.{name}) w.{elem}(v);")
    out.append("}")
    return out


def cpp_decode(struct_name, fields) -> list:
    arrays = {body_field(f)[3]: f[0] for f in fields if body_field(f)[1] == "array"}
    out = [f"inline bool decode(Reader& r, {struct_name}* m) {{"]
    for f in fields:
        name, kind, elem, extra, _ = body_field(f)
        if name in arrays:
            out.append(f"  {CPP_TYPES[elem]} {name};")
            out.append(f"  if (!r.{elem}(&{name})) return false;")
            if elem == "i32":
                out.append(f"  if ({name} < 0) return false;")
        elif kind == "scalar":
            out.append(f"  if (!r.{elem}(&m->{name})) return false;")
        elif kind in ("str", "text"):
            out.append(f"  if (!r.str(&m->{name})) return false;")
        elif kind == "optional_str":
            out.append(f"  m->{name}.clear();")
            out.append(f"  if (r.remaining() != 0 && !r.str(&m->{name})) return false;")
        elif kind == "bytes":
            out.append(f"  if (!r.raw(m->{name}, {extra})) return false;")
        else:
            size = WIRE_SIZES[elem]
            out.append(f"  // Checked against the body before allocating (a division: a hostile count cannot overflow).")
            out.append(f"  if (static_cast<uint64_t>({extra}) > r.remaining() / {size}) return false;")
            out.append(f"  m->{name}.resize({extra});")
            out.append(f"  for ({CPP_TYPES[elem]}& v : m->{name})")
            out.append(f"    if (!r.{elem}(&v)) return false;")
    out += ["  return true;", "}"]
    return out


def cpp_messages(spec) -> str:
    check_bodies(spec)
    out = [
        "// Generated by spec/generate.py from spec/wire.py (OPDESC, BODIES): do not edit.",
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
    parts = []
    for name, t, _, _ in spec.OPDESC:
        parts.append(f"r.raw(d->{name}, {wire_size(t)})" if "[" in t else f"r.{t}(&d->{name})")
    out.append("      " + " &&\n      ".join(parts) + ";")
    out += ["}", ""]
    for struct_name, messages, fields in spec.BODIES:
        counts = [f[0] for f in fields if f not in body_members(fields)]
        note = f"; {', '.join(counts)} on the wire is the array's length" if counts else ""
        out.append(f"// {' / '.join(messages)}{note}.")
        out.append(f"struct {struct_name} {{")
        out += [cpp_member(f) for f in body_members(fields)]
        out += ["};"]
        out += cpp_encode(struct_name, fields)
        out += cpp_decode(struct_name, fields)
        out.append("")
    out += ["}  // namespace fakegpu::proto", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------- Python message codecs

def snake(struct_name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", struct_name).lower()


def py_layout(fields):
    """The body as runs: ("run", [fields]) of consecutive fixed-size values, or one other field."""
    items, run = [], []
    for f in fields:
        kind = body_field(f)[1]
        if kind == "scalar":
            run.append(f)
            continue
        if run:
            items.append(("run", run))
            run = []
        items.append((kind, f))
    if run:
        items.append(("run", run))
    return items


def py_bodies(spec) -> str:
    check_bodies(spec)
    out = ['"""Generated by spec/generate.py from spec/wire.py (BODIES): do not edit.',
           "",
           "Each message body's encoder and decoder: ``encode_<body>(m)`` reads the members from any object",
           "that has them as attributes (an array's count is its length) and returns the bytes;",
           "``decode_<body>(r)`` reads them from a fakegpu.wire_io.Reader and returns the members in order.",
           "``CODECS`` maps a message type to its (encode, decode); fakegpu/protocol.py wraps them.",
           '"""',
           "from __future__ import annotations",
           "",
           "import struct",
           "",
           "from fakegpu.wire_io import ProtocolError, Reader, encode_str, pack",
           "",
           "",
           "def _fixed(value, size: int, what: str) -> bytes:",
           "    raw = bytes(value)",
           "    if len(raw) != size:",
           '        raise ProtocolError(f"{what} must be {size} bytes, got {len(raw)}")',
           "    return raw",
           ""]
    codecs = []
    for struct_name, messages, fields in spec.BODIES:
        fn = snake(struct_name)
        what = messages[0] if len(messages) == 1 else " / ".join(messages)
        arrays = {body_field(f)[3]: f[0] for f in fields if body_field(f)[1] == "array"}
        layout = py_layout(fields)
        consts = []
        for i, (kind, item) in enumerate(layout):
            if kind == "run":
                code = "".join(STRUCT_CODES[body_field(f)[2]] for f in item)
                consts.append(f"_{fn.upper()}_{i} = struct.Struct(\"<{code}\")")
        out += [""] + consts + ["", ""]
        # encoder
        out.append(f"def encode_{fn}(m) -> bytes:")
        for count, array in arrays.items():
            out.append(f"    {array} = tuple(m.{array})")
        parts = []
        for i, (kind, item) in enumerate(layout):
            if kind == "run":
                values = ", ".join(f"len({arrays[f[0]]})" if f[0] in arrays else f"m.{f[0]}" for f in item)
                parts.append(f"pack(_{fn.upper()}_{i}, \"{what}\", {values})")
            else:
                name, _, elem, extra, _ = body_field(item)
                if kind == "str":
                    parts.append(f"encode_str(m.{name})")
                elif kind == "text":
                    parts.append(f"encode_str(m.{name}, truncate=True)")
                elif kind == "optional_str":
                    parts.append(f"(encode_str(m.{name}) if m.{name} else b\"\")")
                elif kind == "bytes":
                    parts.append(f"_fixed(m.{name}, {extra}, \"{what} {name}\")")
                else:
                    parts.append(f"pack(struct.Struct(f\"<{{len({name})}}{STRUCT_CODES[elem]}\"), "
                                 f"\"{what} {name}\", *{name})")
        if len(parts) > 1:
            out.append("    return (" + "\n            + ".join(parts) + ")")
        else:
            out.append("    return " + (parts[0] if parts else 'b""'))
        out += ["", ""]
        # decoder
        out.append(f"def decode_{fn}(r: Reader) -> tuple:")
        for i, (kind, item) in enumerate(layout):
            if kind == "run":
                names = [f[0] for f in item]
                target = ", ".join(names) + ("," if len(names) == 1 else "")
                out.append(f"    {target} = r.unpack(_{fn.upper()}_{i}, \"{'/'.join(names)}\")")
            else:
                name, _, elem, extra, _ = body_field(item)
                if kind in ("str", "text"):
                    out.append(f"    {name} = r.str(\"{name}\")")
                elif kind == "optional_str":
                    out.append(f"    {name} = r.str(\"{name}\") if r.remaining() else \"\"")
                elif kind == "bytes":
                    out.append(f"    {name} = r.raw({extra}, \"{name}\")")
                else:
                    out.append(f"    {name} = r.array(\"{STRUCT_CODES[elem]}\", {WIRE_SIZES[elem]}, {extra}, \"{name}\")")
        members = [f[0] for f in body_members(fields)]
        out.append("    return (" + ", ".join(members) + ("," if len(members) == 1 else "") + ")")
        out += [""]
        codecs += [(code, name, fn) for code, name, *_ in spec.MESSAGES for m in messages if name == m]
    out += ["", "# message type -> (encode, decode)", "CODECS = {"]
    out += [f"    {code}: (encode_{fn}, decode_{fn}),  # {name}" for code, name, fn in sorted(codecs)]
    out += ["}", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------- C++

def cpp(spec) -> str:
    opdesc_offsets, opdesc_size = offsets(spec.OPDESC)
    _, header_size = offsets(spec.HEADER)
    out = [
        "// Generated by spec/generate.py from spec/wire.py: do not edit (docs/protocol.md explains the tables).",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace fakegpu::proto {",
        "",
        f"constexpr uint16_t kVersion = {spec.VERSION};",
        f"constexpr size_t kHeaderSize = {header_size};",
        f"constexpr size_t kOpDescSize = {opdesc_size};",
        "",
        "enum MsgType : uint16_t {",
    ]
    out += [f"  k{camel(name)} = {code}," for code, name, *_ in spec.MESSAGES]
    out += ["};", "",
            "struct MessageInfo {",
            "  uint16_t type;",
            "  const char* name;",
            "  bool client_to_server;",
            "  bool large;       // the body may exceed the small-frame limit",
            "  bool unanswered;  // the coordinator never replies",
            "};",
            "inline constexpr MessageInfo kMessages[] = {"]
    for code, name, direction, _body, props in spec.MESSAGES:
        out.append(f"    {{{code}, \"{name}\", {str(direction == 'c2s').lower()}, "
                   f"{str(bool(props.get('large'))).lower()}, {str(bool(props.get('unanswered'))).lower()}}},")
    out += ["};",
            "inline const MessageInfo* message_info(uint16_t type) {",
            "  for (const MessageInfo& m : kMessages)",
            "    if (m.type == type) return &m;",
            "  return nullptr;",
            "}",
            "",
            "enum OpKind : uint8_t {"]
    out += [f"  k{name} = {code}," for code, name, *_ in spec.KINDS]
    out += ["};",
            f"constexpr int kNumKinds = {len(spec.KINDS) + 1};  // codes 1..{len(spec.KINDS)}; 0 is no kind",
            f"constexpr uint8_t kPerMember = {PER_MEMBER};  // KindInfo blocks: one count-sized block per member",
            "",
            "// What a call of each kind moves on one rank: count-sized blocks of input and output (0, 1 or",
            "// kPerMember), and whether only the root has them.",
            "struct KindInfo {",
            "  const char* name;",
            "  uint8_t in_blocks;",
            "  bool in_root_only;",
            "  uint8_t out_blocks;",
            "  bool out_root_only;",
            "  bool reduces, rooted, p2p, local;",
            "};",
            "inline constexpr KindInfo kKindInfo[kNumKinds] = {",
            "    {\"invalid\", 0, false, 0, false, false, false, false, false},"]

    def blocks(b):
        return str(PER_MEMBER if b == "n" else b)
    for code, name, (ib, iroot), (ob, oroot), props in spec.KINDS:
        flags = ", ".join(str(bool(props.get(k))).lower() for k in ("reduces", "rooted", "p2p", "local"))
        out.append(f"    {{\"{name}\", {blocks(ib)}, {str(iroot == 'root').lower()}, {blocks(ob)}, "
                   f"{str(oroot == 'root').lower()}, {flags}}},")
    out += ["};",
            "inline const KindInfo& kind_info(uint8_t kind) { return kKindInfo[kind < kNumKinds ? kind : 0]; }",
            "// One rank's input and output bytes for a call (or step) of `count` elements of `elem_bytes`",
            "// each (docs/protocol.md's in_len / out_len table).",
            "inline void rank_lengths(uint8_t kind, uint64_t count, uint64_t elem_bytes, uint64_t nranks, bool is_root,",
            "                         uint64_t* in_len, uint64_t* out_len) {",
            "  const KindInfo& k = kind_info(kind);",
            "  auto bytes = [&](uint8_t blocks, bool root_only) -> uint64_t {",
            "    if (root_only && !is_root) return 0;",
            "    return count * elem_bytes * (blocks == kPerMember ? nranks : blocks);",
            "  };",
            "  *in_len = bytes(k.in_blocks, k.in_root_only);",
            "  *out_len = bytes(k.out_blocks, k.out_root_only);",
            "}",
            "// True for the kinds whose buffers hold one count-sized block per member (nccl-tests' S = n·c·s).",
            "inline bool per_member_blocks(uint8_t kind) {",
            "  const KindInfo& k = kind_info(kind);",
            "  return k.in_blocks == kPerMember || k.out_blocks == kPerMember;",
            "}",
            "",
            "// OpDesc.flags bits."]
    out += [f"constexpr uint8_t kOp{camel(n)} = 1u << {bit};  // {doc}" for n, bit, doc in spec.OP_FLAGS]
    out.append(f"// OpDesc.flags bits {spec.OP_ORDER_SHIFT}..: the reduction order (docs/numerics.md).")
    out.append(f"constexpr uint8_t kOpOrderShift = {spec.OP_ORDER_SHIFT};")
    out.append(f"constexpr uint8_t kOpOrderMask = 0x{spec.OP_ORDER_MASK:02x};")
    out += [f"constexpr uint8_t kOrder{camel(n)} = {code};  // {doc}" for code, n, doc in spec.OP_ORDERS]
    out.append("// GROUP.flags bits.")
    out += [f"constexpr uint32_t kGroup{camel(n)} = 1u << {bit};  // {doc}" for n, bit, doc in spec.GROUP_FLAGS]
    out.append(f"constexpr uint32_t kGroupIdShift = {spec.GROUP_ID_SHIFT};  // bits 16..31: the id of a group in several frames")
    out.append("// HELLO.flags / HELLO_OK.flags bits.")
    out += [f"constexpr uint32_t kHello{camel(n)} = 1u << {bit};  // {doc}" for n, bit, doc in spec.HELLO_FLAGS]
    out += ["", "// COMM_FREE.how", "enum FreeHow : uint32_t {"]
    out += [f"  kFree{camel(n)} = {code}," for code, n in spec.FREE_HOW]
    out += ["};", "", "// Byte offsets of the OpDesc fields.", "namespace opdesc {"]
    out += [f"constexpr size_t k{camel(f[0])} = {off};" for f, off in zip(spec.OPDESC, opdesc_offsets)]
    out += ["}  // namespace opdesc", "",
            "struct DatatypeInfo {",
            "  const char* name;",
            "  uint8_t size;",
            "  bool is_float;",
            "};",
            f"constexpr int kNumDatatypes = {len(spec.DATATYPES)};",
            "inline constexpr DatatypeInfo kDatatypes[kNumDatatypes] = {"]
    out += [f"    {{\"{name}\", {size}, {str(is_float).lower()}}},  // {code} {nccl}"
            for code, name, nccl, size, is_float in spec.DATATYPES]
    out += ["};",
            "// Bytes of one element; 0 for a code that is no datatype.",
            "inline size_t datatype_size(int dt) { return dt >= 0 && dt < kNumDatatypes ? kDatatypes[dt].size : 0; }",
            "inline const char* datatype_name(int dt) { return dt >= 0 && dt < kNumDatatypes ? kDatatypes[dt].name : \"invalid\"; }",
            "",
            f"constexpr int kNumRedops = {len(spec.REDOPS)};",
            "enum RedOp : uint8_t {"]
    out += [f"  kRedop{nccl} = {code}," for code, _n, nccl in spec.REDOPS]
    out += ["};",
            "inline constexpr const char* kRedopNames[kNumRedops] = {" +
            ", ".join(f"\"{n}\"" for _c, n, _nc in spec.REDOPS) + "};",
            "",
            "}  // namespace fakegpu::proto",
            "",
            "namespace fakegpu::arena_layout {",
            "",
            f"constexpr uint32_t kMagic = 0x{spec.ARENA_MAGIC:08X};",
            f"constexpr uint32_t kVersion = {spec.ARENA_LAYOUT_VERSION};"]
    out += [f"constexpr size_t kOff{camel(name)} = {off};" for name, _t, off in spec.ARENA_HEADER]
    out += [f"constexpr size_t kRecordsAt = {spec.ARENA_RECORDS_AT};",
            f"constexpr size_t kRecordBlock = {spec.ARENA_RECORD_BLOCK};",
            f"constexpr size_t kRecordBytes = {spec.ARENA_RECORD_BYTES};",
            "",
            "}  // namespace fakegpu::arena_layout",
            ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ Python

def python(spec) -> str:
    opdesc_offsets, opdesc_size = offsets(spec.OPDESC)
    header_format = "<" + "".join(struct_code(t) for _n, t in spec.HEADER)
    opdesc_format = "<" + "".join(struct_code(f[1]) for f in spec.OPDESC)
    assert struct.calcsize(opdesc_format) == opdesc_size
    names = []

    def const(name, value):
        names.append(name)
        return f"{name} = {value}"
    out = ['"""Generated by spec/generate.py from spec/wire.py: do not edit (docs/protocol.md explains the tables)."""',
           "",
           const("VERSION", spec.VERSION),
           const("MAGIC", repr(spec.MAGIC.encode())),
           const("HEADER_FORMAT", repr(header_format)),
           const("OPDESC_FORMAT", repr(opdesc_format)),
           const("OPDESC_SIZE", opdesc_size),
           const("OPDESC_FIELDS", repr(tuple(f[0] for f in spec.OPDESC))),
           const("OPDESC_OFFSETS", repr(dict(zip((f[0] for f in spec.OPDESC), opdesc_offsets)))),
           "", "# Indices of the OpDesc fields in a tuple that OPDESC_FORMAT unpacks."]
    out += [const(f"D_{f[2]}", i) for i, f in enumerate(spec.OPDESC)]
    out += ["", "# Message types."]
    out += [const(name, code) for code, name, *_ in spec.MESSAGES]
    out += [const("MESSAGE_NAMES", "{" + ", ".join(f"{name}: {name!r}" for _c, name, *_ in spec.MESSAGES) + "}"),
            const("CLIENT_TO_SERVER", "frozenset({" + ", ".join(n for _c, n, d, *_ in spec.MESSAGES if d == "c2s") + "})"),
            const("SERVER_TO_CLIENT", "frozenset({" + ", ".join(n for _c, n, d, *_ in spec.MESSAGES if d == "s2c") + "})"),
            const("LARGE_TYPES", "frozenset({" + ", ".join(n for _c, n, _d, _b, p in spec.MESSAGES if p.get("large")) + "})"),
            const("UNANSWERED", "frozenset({" + ", ".join(n for _c, n, _d, _b, p in spec.MESSAGES if p.get("unanswered")) + "})"),
            "", "# Flag bits."]
    out += [const(f"OP_FLAG_{n}", 1 << bit) + f"  # {doc}" for n, bit, doc in spec.OP_FLAGS]
    out.append(const("OP_ORDER_SHIFT", spec.OP_ORDER_SHIFT))
    out.append(const("OP_ORDER_MASK", f"0x{spec.OP_ORDER_MASK:02X}"))
    out += [const(f"ORDER_{n}", code) + f"  # {doc}" for code, n, doc in spec.OP_ORDERS]
    out += [const(f"GROUP_FLAG_{n}", 1 << bit) + f"  # {doc}" for n, bit, doc in spec.GROUP_FLAGS]
    out.append(const("GROUP_ID_SHIFT", spec.GROUP_ID_SHIFT))
    out += [const(f"HELLO_FLAG_{n}", 1 << bit) + f"  # {doc}" for n, bit, doc in spec.HELLO_FLAGS]
    out += ["", "# ncclResult_t."]
    out += [const(f"NCCL_{n}", code) for code, n, _nccl in spec.RESULTS]
    out.append(const("RESULT_NAMES", "{" + ", ".join(f"{c}: {nccl!r}" for c, _n, nccl in spec.RESULTS) + "}"))
    out += ["", "# Operation kinds."]
    out += [const(f"KIND_{name.upper()}", code) for code, name, *_ in spec.KINDS]
    out.append(const("KIND_NAMES", "{" + ", ".join(f"{c}: {n!r}" for c, n, *_ in spec.KINDS) + "}"))
    for prop, name in (("rooted", "ROOTED_KINDS"), ("reduces", "REDUCING_KINDS"), ("p2p", "P2P_KINDS"),
                       ("local", "LOCAL_KINDS")):
        out.append(const(name, "frozenset({" + ", ".join(f"KIND_{n.upper()}" for _c, n, _i, _o, p in spec.KINDS
                                                          if p.get(prop)) + "})"))
    out.append("# Per kind: ((input blocks, root only), (output blocks, root only)); blocks 0, 1 or \"n\" (one per member).")
    out.append(const("KIND_BLOCKS", "{" + ", ".join(
        f"{c}: (({i[0]!r}, {i[1] == 'root'}), ({o[0]!r}, {o[1] == 'root'}))" for c, _n, i, o, _p in spec.KINDS) + "}"))
    out += ["", "",
            "def rank_lengths(kind: int, count: int, elem_bytes: int, nranks: int, is_root: bool) -> tuple:",
            "    \"\"\"(in_len, out_len): one rank's bytes for `count` elements (docs/protocol.md's length table).\"\"\"",
            "    (ib, iroot), (ob, oroot) = KIND_BLOCKS[kind]",
            "    c = count * elem_bytes",
            "    return (0 if iroot and not is_root else c * (nranks if ib == \"n\" else ib),",
            "            0 if oroot and not is_root else c * (nranks if ob == \"n\" else ob))",
            "",
            "",
            "def per_member_blocks(kind: int) -> bool:",
            "    \"\"\"True for the kinds whose buffers hold one count-sized block per member (nccl-tests' S = n·c·s).\"\"\"",
            "    (ib, _), (ob, _) = KIND_BLOCKS[kind]",
            "    return ib == \"n\" or ob == \"n\"",
            "",
            ""]
    names += ["rank_lengths", "per_member_blocks"]
    out += ["# Reduction operators."]
    out += [const(f"REDOP_{n.upper()}", code) for code, n, _nccl in spec.REDOPS]
    out.append(const("REDOP_NAMES", "{" + ", ".join(f"{c}: {n!r}" for c, n, _nc in spec.REDOPS) + "}"))
    out += ["", "# ncclDataType_t."]
    out.append(const("DATATYPE_NAMES", "{" + ", ".join(f"{c}: {n!r}" for c, n, *_ in spec.DATATYPES) + "}"))
    out.append(const("DATATYPE_SIZES", "{" + ", ".join(f"{c}: {s}" for c, _n, _nc, s, _f in spec.DATATYPES) + "}"))
    out.append(const("DATATYPE_IS_FLOAT", "{" + ", ".join(f"{c}: {f}" for c, _n, _nc, _s, f in spec.DATATYPES) + "}"))
    out += ["", "# COMM_FREE how."]
    out += [const(f"FREE_{n}", code) for code, n in spec.FREE_HOW]
    out += ["", "# The host-local arena file's header.",
            const("ARENA_MAGIC", f"0x{spec.ARENA_MAGIC:08X}"),
            const("ARENA_LAYOUT_VERSION", spec.ARENA_LAYOUT_VERSION)]
    out += [const(f"ARENA_OFF_{name.upper()}", off) for name, _t, off in spec.ARENA_HEADER]
    contiguous, pos = [], 0
    for name, t, off in spec.ARENA_HEADER:
        if off != pos:
            break
        contiguous.append(struct_code(t))
        pos += wire_size(t)
    out += [const("ARENA_HEADER_FORMAT", repr("<" + "".join(contiguous)) +
                  f"  # the fields at offsets 0..{pos - 1}"),
            const("ARENA_RECORDS_AT", spec.ARENA_RECORDS_AT),
            const("ARENA_RECORD_BLOCK", spec.ARENA_RECORD_BLOCK),
            const("ARENA_RECORD_BYTES", spec.ARENA_RECORD_BYTES)]
    out += ["", "__all__ = [" + ", ".join(repr(n) for n in names) + "]", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ docs

def doc_tables(spec) -> dict:
    kinds = ", ".join(f"{c} {n}" for c, n, *_ in spec.KINDS)
    redops = ", ".join(f"{c} {nccl}" for c, _n, nccl in spec.REDOPS)
    orders = ", ".join(f"{c} {doc}" for c, _n, doc in spec.OP_ORDERS)
    arrow = {"c2s": "c→s", "s2c": "s→c"}
    messages = ["| type | name | direction | body |", "|---|---|---|---|"]
    messages += [f"| {c} | {n} | {arrow[d]} | {body} |" for c, n, d, body, _p in spec.MESSAGES]
    offs, _ = offsets(spec.OPDESC)
    opdesc = ["| offset | type | field |", "|---|---|---|"]
    opdesc += [f"| {off} | {t} | {doc.format(kinds=kinds, redops=redops, orders=orders)} |" for (_n, t, _s, doc), off in zip(spec.OPDESC, offs)]

    def length(blocks, root, note):
        if blocks == 0:
            return "0"
        text = "c·s" if blocks == 1 else "n·c·s"
        if note:
            text += f" ({note})"
        return text + (" at the root, 0 elsewhere" if root == "root" else "")
    lengths = ["| kind | in_len | out_len |", "|---|---|---|"]
    lengths += [f"| {n} | {length(i[0], i[1], p.get('in_note'))} | {length(o[0], o[1], p.get('out_note'))} |"
                for _c, n, i, o, p in spec.KINDS]
    return {"messages": "\n".join(messages), "opdesc": "\n".join(opdesc), "lengths": "\n".join(lengths)}


def render_doc(text: str, tables: dict) -> str:
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- generated by spec/generate.py: {name} -->\n).*?(\n<!-- end of generated {name} -->)",
                             re.S)
        if not pattern.search(text):
            raise SystemExit(f"no generated '{name}' table markers in the document")
        text = pattern.sub(lambda m: m.group(1) + table + m.group(2), text)
    return text


def outputs() -> dict:
    spec = load_spec()
    check(spec)
    env = load_spec("env")
    return {CPP_OUT: cpp(spec), CPP_MESSAGES_OUT: cpp_messages(spec), PY_OUT: python(spec),
            PY_BODIES_OUT: py_bodies(spec), DOC: render_doc(DOC.read_text(), doc_tables(spec)),
            USAGE: render_doc(USAGE.read_text(), {"environment": env_table(env)})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated file is stale")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
