"""The wire tables are declared once (spec/wire.py) and generated for C++, Python and the docs.

A generated file that no longer matches the spec fails here: run `python spec/generate.py`.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import fakegpu.protocol as P
from fakegpu import wire_spec as W
from helpers.paths import REPO_ROOT as ROOT



def test_generated_files_are_up_to_date():
    done = subprocess.run([sys.executable, str(ROOT / "spec" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"stale generated files (run python spec/generate.py):\n{done.stdout}{done.stderr}"


def test_protocol_module_exposes_the_generated_tables():
    # protocol.py is the codec around the generated tables; it must not redefine any of them.
    for name in W.__all__:
        assert getattr(P, name) is getattr(W, name), name
    assert P.OPDESC_STRUCT.size == W.OPDESC_SIZE == 88
    assert P.HEADER.size == 16


def test_lengths_rule_matches_the_documented_table():
    """rank_lengths (generated) against the table of docs/protocol.md, written out by hand here."""
    c, n = 12, 5
    table = {  # kind: (root in, root out, other in, other out)
        "AllReduce": (c, c, c, c), "Broadcast": (c, c, 0, c), "Reduce": (c, c, c, 0),
        "AllGather": (c, n * c, c, n * c), "ReduceScatter": (n * c, c, n * c, c),
        "AlltoAll": (n * c, n * c, n * c, n * c), "Gather": (c, n * c, c, 0), "Scatter": (n * c, c, 0, c),
        "Send": (c, 0, c, 0), "Recv": (0, c, 0, c),
    }
    for kind, name in P.KIND_NAMES.items():
        got = P.rank_lengths(kind, 3, 4, n, True) + P.rank_lengths(kind, 3, 4, n, False)
        assert got == table[name], name
        assert P.per_member_blocks(kind) == (name in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"))


@pytest.mark.parametrize("old, new, error", [
    # a duplicate message code
    ('(2, "HELLO_OK"', '(1, "HELLO_OK"', "MESSAGES has a duplicate code or name"),
    # a record's array sized by a field its body does not have
    ('("arrival_wait_s", "f64[nranks]")', '("arrival_wait_s", "f64[n_members]")', "records sized by n_members"),
])
def test_a_contradictory_spec_is_refused(tmp_path, old, new, error):
    """generate.py checks the spec itself: a contradiction is an error naming what is wrong."""
    source = (ROOT / "spec" / "wire.py").read_text()
    bad = source.replace(old, new, 1)
    assert bad != source
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "wire.py").write_text(bad)
    for name in ("generate.py", "gen_bodies.py"):
        (tmp_path / "spec" / name).write_text((ROOT / "spec" / name).read_text())
    done = subprocess.run([sys.executable, str(tmp_path / "spec" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and error in done.stderr


def _declared_variables() -> set:
    import importlib.util
    spec = importlib.util.spec_from_file_location("fakegpu_env_spec", ROOT / "spec" / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = set()
    for cells in module.VARIABLES:
        names.update(re.findall(r"FAKEGPU_[A-Z0-9_]+", cells[0]))
    return names


def _variables_in_code() -> dict:
    found: dict = {}
    files = [p for p in (ROOT / "native" / "src").rglob("*") if p.suffix in (".cc", ".h")]
    files += [p for p in (ROOT / "fakegpu").rglob("*.py")]
    for path in files:
        for name in re.findall(r"FAKEGPU_[A-Z0-9_]+", path.read_text(errors="replace")):
            found.setdefault(name, path.relative_to(ROOT).as_posix())
    return found


def test_every_environment_variable_the_code_reads_is_declared_once():
    """spec/env.py is the list (docs/usage.md's table is generated from it): a variable the shim or
    the package mentions but the spec lacks is undocumented; one the spec has but nothing reads
    is a stale row."""
    declared, used = _declared_variables(), _variables_in_code()
    undeclared = {n: where for n, where in used.items() if n not in declared}
    assert not undeclared, f"declare these in spec/env.py (and run spec/generate.py): {undeclared}"
    assert not declared - set(used), f"spec/env.py declares variables nothing reads: {sorted(declared - set(used))}"


# -- the message bodies: spec/wire.py's BODIES against the Python codec ---------------------------
# Both codecs are generated from BODIES. These tests encode every body from the spec's field
# list alone (an independent reading of it) and require fakegpu.protocol, dataclasses included,
# to read and write those bytes; tests/integration/test_native_c_api.py holds the C++ codecs to
# tests/vectors/protocol_vectors.json, which test_protocol_codec.py holds the Python codec to.

def _wire_spec():
    import importlib.util
    spec = importlib.util.spec_from_file_location("fakegpu_wire_spec_source", ROOT / "spec" / "wire.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SAMPLES = {"u8": 0xA5, "u16": 0xBEEF, "u32": 0xDEADBEEF, "i32": -123456, "u64": 0x0123456789ABCDEF, "f64": -2.5}
_ARRAYS = {"i32": [7, -1, 2**31 - 1], "u32": [0, 9, 2**32 - 1]}
_CODES = {"u8": "B", "u16": "H", "u32": "I", "i32": "i", "u64": "Q", "f64": "d"}


def _pack_scalar(t, value):
    import struct
    return struct.pack("<" + _CODES[t], value)


def _opdesc_by_spec(spec, seed: int) -> bytes:
    """An OpDesc's bytes from spec.OPDESC's field list alone."""
    out = b""
    for i, (_name, t, _short, _doc) in enumerate(spec.OPDESC):
        m = re.fullmatch(r"u8\[(\d+)\]", t)
        out += bytes((seed + k) % 256 for k in range(int(m.group(1)))) if m else _pack_scalar(t, seed + i)
    return out


def _records_by_spec(spec, record_name, members, seed):
    """Two records of RECORDS' ``record_name``; arrays sized by the body's ``members``."""
    fields = dict(spec.RECORDS)[record_name]
    body, records = b"", []
    for k in range(2):
        values = {}
        for i, (name, t) in enumerate(fields):
            m = re.fullmatch(r"(\w+)\[([a-z_]+)\]", t)
            if t == "OpDesc":
                values[name] = _opdesc_by_spec(spec, seed + 10 * k)
                body += values[name]
            elif m:
                values[name] = [float(seed + k + j) / 4 for j in range(members[m.group(2)])]
                body += b"".join(_pack_scalar(m.group(1), v) for v in values[name])
            else:
                values[name] = float(seed + k + i) if t == "f64" else seed + k + i
                body += _pack_scalar(t, values[name])
        records.append(values)
    return body, records


def _body_by_spec(spec, fields, overrides=None):
    """(body bytes, {member: value}) for sample values, encoded from the spec's field list alone."""
    record_names = {name for name, _ in spec.RECORDS}
    arrays = {}
    for field in fields:
        m = re.fullmatch(r"(\w+)\[([a-z_]+)\]", field[1])
        if m:
            arrays[m.group(2)] = (field[0], m.group(1))
    body, members = b"", {}
    for i, field in enumerate(fields):
        name, t = field[0], field[1]
        if name in arrays:
            array_name, elem = arrays[name]
            body += _pack_scalar(t, 2 if elem in record_names else len(_ARRAYS[elem]))
            continue
        m = re.fullmatch(r"(\w+)\[([a-z_]+)\]", t)
        if t in _CODES:
            value = (overrides or {}).get(name, _SAMPLES[t] + (i if t != "f64" else 0))
            body += _pack_scalar(t, value)
        elif t in ("str", "text", "str?"):
            value = f"{name} é {i}"
            body += _pack_scalar("u16", len(value.encode())) + value.encode()
        elif t.startswith("bytes["):
            value = bytes(k % 256 for k in range(int(t[6:-1])))
            body += value
        elif m.group(1) in record_names:
            raw, value = _records_by_spec(spec, m.group(1), members, seed=i)
            body += raw
        else:
            value = list(_ARRAYS[m.group(1)])
            body += b"".join(_pack_scalar(m.group(1), v) for v in value)
        members[name] = value
    return body, members


def _as_spec_reads(got, value):
    """What the codec decoded, in the form _body_by_spec writes the expected value."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [{k: _as_spec_reads(getattr(rec, k), v) for k, v in want.items()} for rec, want in zip(got, value)]
    if isinstance(got, P.OpDesc):
        return got.pack()
    if isinstance(got, tuple):
        return list(got)
    return bytes(got) if isinstance(value, bytes) else got


def test_python_codec_matches_every_body_the_spec_declares():
    spec = _wire_spec()
    codes = {name: code for code, name, *_ in spec.MESSAGES}
    # Fields that size the arrays of records need small sample values.
    sizes = {re.fullmatch(r"\w+\[([a-z_]+)\]", t).group(1): 3
             for _, fields in spec.RECORDS for _, t in fields if "[" in t}
    checked = []
    for struct_name, messages, fields in spec.BODIES:
        # GROUP / SIMULATE / ACCOUNT: n_ops OpDescs follow the head (none here); Python keeps them as ops.
        group_head = struct_name == "GroupHead"
        body, members = _body_by_spec(spec, fields, {"n_ops": 0, **sizes} if group_head else sizes)
        for message in messages:
            msg = P.decode_body(codes[message], body)
            for name, value in members.items():
                got = len(msg.ops) if group_head and name == "n_ops" else getattr(msg, name)
                got = _as_spec_reads(got, value)
                assert got == value, f"{message}.{name}: the Python codec reads {got!r}, the spec says {value!r}"
            assert P.encode_body(msg) == body, f"{message}: the Python codec writes other bytes than the spec"
            checked.append(message)
    # Every message has its body declared, but OK (an empty body).
    assert sorted(checked) == sorted(set(codes) - {"OK"})


def test_generated_cpp_codecs_cover_every_declared_body():
    text = (ROOT / "native" / "src" / "generated" / "wire_messages.h").read_text()
    for struct_name, _, _ in _wire_spec().BODIES:
        assert f"struct {struct_name} {{" in text
        assert f"inline void encode(Writer& w, const {struct_name}& m)" in text
        assert f"inline bool decode(Reader& r, {struct_name}* m)" in text
