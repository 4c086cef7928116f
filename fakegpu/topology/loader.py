"""Read a cluster YAML into a Topology, with errors that name file, field path and line.

PyYAML's plain loader forgets where values came from, so we compose the node graph
ourselves and record the line of every value under its field path (``nodes[1].ranks[0]``).
Schema errors (jsonschema) and semantic errors are both reported against those paths.

The YAML is bounded before any of that (docs/reports.md, "Limits"): a file larger than
MAX_CONFIG_BYTES, nesting deeper than MAX_DEPTH, more than MAX_ALIASES aliases, or a document
that would grow past MAX_NODES nodes once its aliases are expanded is rejected while it is
being read, so a hostile file (a "billion laughs", 50k nested brackets, 10 MB of anything)
costs milliseconds and a clear error instead of gigabytes or a RecursionError.
"""
from __future__ import annotations

import dataclasses

import os
from dataclasses import dataclass
from typing import Any, Union

from fakegpu._deps import check

check(("yaml", "jsonschema"), "reading a cluster YAML")  # one line naming both when they are missing
import yaml  # noqa: E402
from jsonschema import Draft202012Validator  # noqa: E402

from .model import Fabric, Node, Topology  # noqa: E402
from .profiles import PROFILES, canonical_profile_name, get_profile  # noqa: E402
from .schema import CLUSTER_CONFIG_SCHEMA  # noqa: E402

SUPPORTED_VERSION = 1

# Limits on the YAML itself. Real configs are a few KiB, about 6 levels deep and use a handful
# of aliases; a generated 4096-node x 8-GPU config (32768 ranks) is 1 MiB and 0.2 M nodes.
MAX_CONFIG_BYTES = 4 << 20
MAX_DEPTH = 64
MAX_ALIASES = 10_000    # parsing 100k of them took 19 s; a cluster config uses a few per node
MAX_NODES = 1_000_000   # scalars, sequences and mappings, each alias counted as what it expands to

PathT = tuple[Union[str, int], ...]


def format_path(path: PathT) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<document>"


@dataclass(frozen=True)
class ConfigIssue:
    file: str
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class ClusterConfigError(ValueError):
    """A cluster YAML that cannot be used; ``issues`` lists every problem found."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        head = f"invalid cluster config {issues[0].file}" if issues else "invalid cluster config"
        super().__init__(head + ":\n" + "\n".join(f"  {i}" for i in issues))


class _LimitExceeded(Exception):
    def __init__(self, message: str, mark):
        super().__init__(message)
        self.line = mark.line + 1 if mark is not None else 0


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe composer, counting as it goes.

    YAML aliases share one node, so composing a billion laughs is cheap and the blow-up comes
    later, when the graph is walked. Every node composed here therefore records how many nodes
    it stands for once its aliases are expanded; the running total of those is what a walk of
    the document will visit, and it is checked at every node.
    """

    def __init__(self, text: str):
        super().__init__(text)
        self._depth = 0
        self._aliases = 0
        self._expanded = 0
        self._anchored_sizes: dict[int, int] = {}   # id(anchored node) -> its expanded size

    def _count(self, nodes: int, mark) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            raise _LimitExceeded(
                f"the document expands to more than {MAX_NODES:,} YAML nodes once its aliases are expanded "
                f"(the limit for a cluster config; nested aliases, as in a \"billion laughs\" file, grow "
                f"exponentially)", mark)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _LimitExceeded(f"more than {MAX_ALIASES:,} aliases (the limit for a cluster config)",
                                     event.start_mark)
            node = super().compose_node(parent, index)
            size = self._anchored_sizes.get(id(node))
            if size is None:  # the anchor's node is still being composed: it contains this alias
                raise _LimitExceeded(f"alias *{event.anchor} is inside the node it refers to "
                                     "(recursive aliases are not allowed)", event.start_mark)
            self._count(size, event.start_mark)
            return node
        if self._depth >= MAX_DEPTH:
            raise _LimitExceeded(f"nesting deeper than {MAX_DEPTH} levels (the limit for a cluster config)",
                                 event.start_mark)
        self._depth += 1
        before = self._expanded
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(1, event.start_mark)
        if event.anchor is not None:
            self._anchored_sizes[id(node)] = self._expanded - before
        return node


def _compose(text: str):
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


class _Document:
    """Plain Python data composed from YAML plus the line of every field path."""

    def __init__(self, source: str):
        self.source = source
        self.lines: dict[PathT, int] = {}
        self.issues: list[ConfigIssue] = []
        self._scalars = yaml.SafeLoader("")

    def line_of(self, path: PathT) -> int:
        # A missing field has no line of its own: use the nearest enclosing one.
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path, 1)

    def issue(self, path: PathT, message: str) -> None:
        self.issues.append(ConfigIssue(self.source, format_path(path), self.line_of(path), message))

    def build(self, node: yaml.Node, path: PathT) -> Any:
        self.lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            merged: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    # `<<: *defaults` (or a list of them): their keys apply unless set here.
                    sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                    for src in sources:
                        value = self.build(src, path)
                        if not isinstance(value, dict):
                            self.issue(path, "a `<<` merge key needs a mapping (or a list of mappings)")
                            continue
                        for k, v in value.items():
                            merged.setdefault(k, v)
                    continue
                key = self._scalars.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    key = str(key)
                if key in out:
                    self.lines[path + (key,)] = key_node.start_mark.line + 1
                    self.issue(path + (key,), f"duplicate key {key!r}")
                    continue
                out[key] = self.build(value_node, path + (key,))
                # Point at the key's line: for block values the value starts on the next one.
                self.lines[path + (key,)] = key_node.start_mark.line + 1
            for k, v in merged.items():
                out.setdefault(k, v)
            self.lines[path] = node.start_mark.line + 1
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._scalars.construct_object(node, deep=True)


def load_cluster_config(path: Union[str, os.PathLike]) -> Topology:
    """Parse and validate the cluster YAML at ``path`` (or the bundled config of that bare name,
    fakegpu.topology.bundled); raises ClusterConfigError."""
    from fakegpu.topology.bundled import bundled_names, resolve_cluster_config

    source = resolve_cluster_config(os.fspath(path))
    try:
        with open(source, "rb") as fh:
            # Read one byte past the limit (not os.stat: /dev/zero and pipes have no size).
            raw = fh.read(MAX_CONFIG_BYTES + 1)
            size = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        hint = ""
        if isinstance(exc, FileNotFoundError) and bundled_names():
            hint = f" (fakegpu ships these cluster configs, usable by name: {', '.join(bundled_names())})"
        raise ClusterConfigError([ConfigIssue(source, "<document>", 0,
                                              f"cannot read file: {exc.strerror or exc}{hint}")]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ClusterConfigError([ConfigIssue(source, "<document>", 0, _too_large(size))])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ClusterConfigError([ConfigIssue(source, "<document>", line,
                                              f"not UTF-8 text (byte {exc.start}: {exc.reason})")]) from None
    return parse_cluster_config(text, source)


def _too_large(size: int = 0) -> str:
    what = f"the file ({size:,} bytes)" if size > MAX_CONFIG_BYTES else "the file"
    return f"{what} is larger than {MAX_CONFIG_BYTES >> 20} MiB (the limit for a cluster config)"


def parse_cluster_config(text: str, source: str = "<string>") -> Topology:
    doc = _Document(source)
    if len(text) > MAX_CONFIG_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ClusterConfigError([ConfigIssue(source, "<document>", 0, _too_large())])
    try:
        root = _compose(text)
    except _LimitExceeded as exc:
        raise ClusterConfigError([ConfigIssue(source, "<document>", exc.line, str(exc))]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise ClusterConfigError([ConfigIssue(source, "<document>", line, f"YAML syntax error: {exc.problem}")]) from None
    except yaml.YAMLError as exc:  # ReaderError: a control character or other unreadable text
        raise ClusterConfigError([ConfigIssue(source, "<document>", 0, f"YAML error: {exc}")]) from None
    if root is None:
        raise ClusterConfigError([ConfigIssue(source, "<document>", 1, "the file is empty")])
    try:
        data = doc.build(root, ())
    except yaml.MarkedYAMLError as exc:  # e.g. a value of an unknown !tag
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise ClusterConfigError([ConfigIssue(source, "<document>", line, f"YAML error: {exc.problem}")]) from None
    if doc.issues:
        raise ClusterConfigError(doc.issues)

    _check_schema(doc, data)
    if doc.issues:
        raise ClusterConfigError(doc.issues)
    _check_semantics(doc, data)
    if doc.issues:
        raise ClusterConfigError(doc.issues)
    topology = _to_topology(data, source)
    topology.warnings.extend(_plausibility_warnings(doc, data))
    if data.get("faults"):
        topology.faults = _faults(doc, data["faults"], topology)
    return topology


def _faults(doc: _Document, items: list, topology: Topology) -> list:
    """The `faults:` section, validated like FAKEGPU_FAULTS (docs/faults.md)."""
    from fakegpu.coordinator.faults import FaultPlan, FaultSpecError, parse_fault_yaml

    faults = []
    for i, item in enumerate(items):
        try:
            faults.extend(parse_fault_yaml([item], source=f"faults[{i}]"))
        except FaultSpecError as exc:
            doc.issue(("faults", i), str(exc).split(": ", 1)[-1])
    if not doc.issues:
        try:
            FaultPlan(faults).apply_slow_links(topology)
        except FaultSpecError as exc:
            doc.issue(("faults",), str(exc))
    if doc.issues:
        raise ClusterConfigError(doc.issues)
    return faults


# NVLink's slowest generation in the catalogue moves 300 GB/s = 2400 Gb/s per GPU.
_NVLINK_FLOOR_GBPS = 400


def _plausibility_warnings(doc: _Document, data: dict) -> list[str]:
    """Valid but probably unintended values; reported, never fatal."""
    out = []
    intra = data["fabric"]["intra_node"]
    if intra["type"] in ("nvlink", "nvswitch") and intra["bandwidth_gbps"] < _NVLINK_FLOOR_GBPS:
        path = ("fabric", "intra_node", "bandwidth_gbps")
        out.append(
            f"{doc.source}:{doc.line_of(path)}: {format_path(path)}: {intra['bandwidth_gbps']:g} Gb/s "
            f"({intra['bandwidth_gbps'] / 8:g} GB/s) is far below any NVLink generation; bandwidth_gbps is in "
            f"gigabits per second (NVLink4 is 3600)"
        )
    return out


def _check_schema(doc: _Document, data: Any) -> None:
    validator = Draft202012Validator(CLUSTER_CONFIG_SCHEMA)
    for error in sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]):
        path = tuple(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            allowed = set(error.schema.get("properties", {}))
            for key in error.instance:
                if key not in allowed:
                    doc.issue(path + (key,), f"unknown field {key!r} (allowed: {', '.join(sorted(allowed))})")
            continue
        if error.validator == "required":
            doc.issue(path, error.message.replace("is a required property", "is required"))
            continue
        doc.issue(path, _friendly(error))


def _friendly(error) -> str:
    """jsonschema's wording, rephrased for the common cases a person writes by hand."""
    v = error.validator
    if v == "exclusiveMinimum":
        return f"must be greater than {error.validator_value}, got {error.instance!r}"
    if v == "minimum":
        return f"must be at least {error.validator_value}, got {error.instance!r}"
    if v == "type":
        return f"must be of type {error.validator_value}, got {error.instance!r}"
    if v == "enum":
        return f"must be one of {', '.join(map(str, error.validator_value))}, got {error.instance!r}"
    if v == "minItems":
        return f"must list at least {error.validator_value} item(s)"
    return error.message


def _check_semantics(doc: _Document, data: dict) -> None:
    if data["version"] != SUPPORTED_VERSION:
        doc.issue(("version",), f"unsupported version {data['version']}; this fakegpu reads version {SUPPORTED_VERSION}")

    seen_ids: dict[str, int] = {}
    owner: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(data["nodes"]):
        if node["id"] in seen_ids:
            doc.issue(("nodes", i, "id"), f"node id {node['id']!r} is already used by nodes[{seen_ids[node['id']]}]")
        else:
            seen_ids[node["id"]] = i
        if len(node["gpus"]) != len(node["ranks"]):
            doc.issue(
                ("nodes", i, "gpus"),
                f"node {node['id']!r} lists {len(node['ranks'])} ranks but {len(node['gpus'])} gpus; "
                "each rank needs exactly one gpu entry",
            )
        for j, gpu in enumerate(node["gpus"]):
            if canonical_profile_name(gpu["profile"]) is None:
                doc.issue(
                    ("nodes", i, "gpus", j, "profile"),
                    f"unknown GPU profile {gpu['profile']!r}; known profiles: {', '.join(sorted(PROFILES))}",
                )
        bridged: dict[int, int] = {}
        for j, pair in enumerate(node.get("nvlink_bridges", [])):
            where = ("nodes", i, "nvlink_bridges", j)
            if pair[0] == pair[1]:
                doc.issue(where, f"an NVLink bridge joins two different GPUs, got [{pair[0]}, {pair[1]}]")
                continue
            for slot in pair:
                if slot >= len(node["gpus"]):
                    doc.issue(where, f"GPU slot {slot} does not exist (node {node['id']!r} has "
                                     f"{len(node['gpus'])} gpus, slots 0-{len(node['gpus']) - 1})")
                elif slot in bridged:
                    doc.issue(where, f"GPU slot {slot} is already bridged by nvlink_bridges[{bridged[slot]}]")
                else:
                    bridged[slot] = j
                    name = canonical_profile_name(node["gpus"][slot]["profile"])
                    if name is not None and not PROFILES[name].nvlink_bridge_gbs:
                        bridgeable = sorted(p.name for p in PROFILES.values() if p.nvlink_bridge_gbs)
                        doc.issue(where, f"GPU slot {slot} ({name}) takes no NVLink bridge "
                                         f"(profiles that do: {', '.join(bridgeable)})")
        for j, rank in enumerate(node["ranks"]):
            if rank in owner:
                oi, oj = owner[rank]
                doc.issue(("nodes", i, "ranks", j), f"rank {rank} is already assigned at nodes[{oi}].ranks[{oj}]")
            else:
                owner[rank] = (i, j)

    if owner:
        world = len(owner)
        missing = sorted(set(range(world)) - set(owner))
        if missing:
            beyond = sorted(r for r in owner if r >= world)
            doc.issue(
                ("nodes",),
                f"ranks must be contiguous from 0 to {world - 1}: missing {_short(missing)}"
                f" (found {_short(beyond)} instead)",
            )

    if len(data["nodes"]) > 1 and "inter_node" not in data["fabric"]:
        doc.issue(("fabric",), "fabric.inter_node is required when the cluster has more than one node")


def _short(values: list[int]) -> str:
    return ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")


def _fabric(spec: dict) -> Fabric:
    return Fabric(
        type=spec["type"],
        bandwidth_gbps=float(spec["bandwidth_gbps"]),
        latency_us=float(spec["latency_us"]),
        oversubscription=float(spec.get("oversubscription", 1.0)),
        per_message_us=float(spec.get("per_message_us", 0.0)),
        efficiency=float(spec["efficiency"]) if "efficiency" in spec else None,
        gpudirect_rdma=bool(spec.get("gpudirect_rdma", True)),
        collnet=bool(spec.get("collnet", False)),
    )


def _gpu(entry: dict):
    profile = get_profile(entry["profile"])
    if "power_limit_w" in entry:
        profile = dataclasses.replace(profile, power_limit_w=float(entry["power_limit_w"]))
    return profile


def _to_topology(data: dict, source: str) -> Topology:
    nodes = tuple(
        Node(
            id=n["id"],
            host=n.get("host", n["id"]),
            ranks=tuple(n["ranks"]),
            gpus=tuple(_gpu(g) for g in n["gpus"]),
            nics=int(n.get("nics", 1)),
            nic_bandwidth_gbps=float(n["nic_bandwidth_gbps"]) if "nic_bandwidth_gbps" in n else None,
            nvlink_bridges=tuple(tuple(sorted(p)) for p in n.get("nvlink_bridges", [])),
            pcie_host_gbs=float(n["pcie_host_gbs"]) if "pcie_host_gbs" in n else None,
        )
        for n in data["nodes"]
    )
    fabric = data["fabric"]
    inter = _fabric(fabric["inter_node"]) if "inter_node" in fabric else Fabric("infiniband", 400.0, 5.0, 1.0)
    cluster = data.get("cluster", {})
    return Topology(
        name=cluster.get("name", os.path.splitext(os.path.basename(source))[0]),
        nodes=nodes,
        intra_node=_fabric(fabric["intra_node"]),
        inter_node=inter,
        default_backend=cluster.get("default_backend", "nccl"),
        source=os.path.abspath(source) if source != "<string>" else None,
    )
