"""Topology files: devices, links, layers per device and shared buses in YAML or JSON (docs/topology.md).

``load(path)`` reads a file, checks it field by field and returns ``topology.make_topology(...)``; ``dump`` writes
any Topology back (every field explicit), so ``load(dump(t)) == t``. ``to_dict`` / ``from_dict`` are the same
format as plain data (``result.json`` records ``to_dict`` under ``space.topology``; ``load`` accepts such a
result.json too, so a run's topology can be reused from its workdir).

Format (units in the field names; memory_mb is MiB, 2**20 bytes)::

    name: phone_edge_cloud              # optional, default: the file name without extension
    devices:
      - {name: phone, preset: raspberry_pi4}     # a preset from jmsnas.topology.DEVICES; fields below override it
      - name: edge
        gflops: 1000                     # peak GFLOP/s                      (required without preset)
        memory_mb: 8192                  # or memory_bytes                   (required without preset)
        mem_bandwidth_gbs: 50            # default 25
        efficiency: 0.1                  # fraction of the peak reached, (0, 1], default 0.3
        layer_overhead_ms: 0.02          # fixed cost per layer, default 0
        quantize: true                   # composed search: quantize this device's weights (default: all but the last)
        description: "an edge server"    # optional
    links:
      - {src: phone, dst: edge, mbps: 10, latency_ms: 40, wireless: true}   # latency_ms 0, wireless false by default
    layers_per_device: [2, 2, 2]         # or {phone: 2, edge: 2, cloud: 2}; optional
    buses:                               # optional: links that share one bandwidth
      - {name: sensor_bus, mbps: 1200, links: [s1->agg, s2->agg]}   # a bus link without mbps gets mbps / #links

Every error is one ``TopologyError`` line naming the file, the field (``devices[1].gflops``) and the bad value.
The text is parsed with PyYAML's pure-Python safe loader (no Python objects, no tags) after a size and nesting
cap, so a hostile file cannot exhaust memory or the stack.
"""
from __future__ import annotations

import json
import math
import os
import re

import yaml

from jmsnas.safeio import load_json, load_yaml, name_problem, short
from jmsnas.topology.presets import DEVICES
from jmsnas.topology.types import (BusGroup, DeviceProfile, LinkProfile, Topology, TopologyError, cluster,
                                   make_topology)

MAX_BYTES = 1 << 20  # a topology file is a few kB; 1 MiB is far beyond any real one
MAX_DEPTH = 32  # nesting of lists/mappings; the format needs 4
MAX_DEVICES = 1024
MAX_LINKS = 8192
MIB = 1 << 20

TOP_FIELDS = ("name", "description", "devices", "links", "layers_per_device", "buses")
DEVICE_FIELDS = ("name", "preset", "gflops", "memory_bytes", "memory_mb", "mem_bandwidth_gbs", "efficiency",
                 "layer_overhead_ms", "description", "active_power_w", "energy_budget_mj", "quantize")
LINK_FIELDS = ("src", "dst", "mbps", "latency_ms", "wireless", "tx_power_w", "rx_power_w")
BUS_FIELDS = ("name", "mbps", "links")
DEFAULT_LAYERS = 2


class _Where:
    """Builds the one-line errors: '<file>: <field>: <what>, got <value>'."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, what: str, value=None, show: bool = True):
        got = f", got {_short(value)}" if show else ""
        raise TopologyError(" ".join(f"{self.source}: {field}: {what}{got}".split()))


def _short(value) -> str:
    return short(value, 80)  # never the whole of an alias-expanded structure


# ----------------------------------------------------------------------------------------------- reading text

def _check_nesting(text: str, where: _Where) -> None:
    """Rejects nesting deeper than MAX_DEPTH before a parser recurses into it (flow brackets and '- - -' runs)."""
    depth = worst = 0
    quote = None
    for ch in text:
        if ch == "\n":
            quote = None  # a quote left open (an apostrophe in a plain scalar) ends with its line
        elif quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            worst = max(worst, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    dashes = max((len(m.group(0)) // 2 for m in re.finditer(r"(?:[-?] +)+", text)), default=0)
    if max(worst, dashes) > MAX_DEPTH:
        where.fail("(file)", f"nested more than {MAX_DEPTH} levels deep; a topology file needs 4",
                   max(worst, dashes))


def parse(text: str, source: str, fmt: str = "yaml") -> dict:
    """The top-level mapping of a topology file's ``text`` (``fmt`` "yaml" or "json"), parsed by the project's
    capped parsers (``safeio.load_yaml`` / ``safeio.load_json``: size, depth, a key defined twice refused)."""
    where = _Where(source)
    if len(text.encode("utf-8", "replace")) > MAX_BYTES:
        where.fail("(file)", f"larger than {MAX_BYTES} bytes; a topology file is a few kB", len(text))
    _check_nesting(text, where)
    try:
        load = load_json if fmt == "json" else load_yaml
        obj = load(text, "(file)", max_bytes=MAX_BYTES, max_depth=MAX_DEPTH)
    except ValueError as e:
        msg = str(e)
        msg = msg[len("(file)"):].lstrip(": ") if msg.startswith("(file)") else msg
        msg = msg[len("is "):] if msg.startswith("is not valid") else msg
        where.fail("(file)", msg, show=False)
    if not isinstance(obj, dict):
        where.fail("(file)", "must be a mapping with devices and links", obj)
    return obj


def read(path: str) -> dict:
    """The parsed top-level mapping of a .yaml/.yml/.json file (JSON by extension, YAML otherwise)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            _Where(path).fail("(file)", f"larger than {MAX_BYTES} bytes; a topology file is a few kB", size)
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise TopologyError(f"{path}: topology file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TopologyError(f"{path}: cannot read topology file: {e}") from None
    return parse(text, path, "json" if path.lower().endswith(".json") else "yaml")


# ----------------------------------------------------------------------------------------------- fields

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _number(where, field, value, *, minimum=0.0, allow_min=False, maximum=None):
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.2 numbers PyYAML (YAML 1.1) reads as strings, e.g. 1e9
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        where.fail(field, "must be a number", value)
    if not math.isfinite(value):
        where.fail(field, "must be finite", value)
    if value < minimum or (value == minimum and not allow_min):
        where.fail(field, f"must be {'>=' if allow_min else '>'} {minimum:g}", value)
    if maximum is not None and value > maximum:
        where.fail(field, f"must be <= {maximum:g}", value)
    return value


def _string(where, field, value):
    if not isinstance(value, str) or not value.strip():
        where.fail(field, "must be a non-empty string", value)
    if "->" in value:
        where.fail(field, "must not contain '->' (it separates link ends)", value)
    return value


def _mapping(where, field, value, allowed):
    if not isinstance(value, dict):
        where.fail(field, f"must be a mapping with fields {list(allowed)}", value)
    unknown = [k for k in value if k not in allowed]
    if unknown:
        where.fail(f"{field}.{unknown[0]}", f"unknown field; expected one of {list(allowed)}", value[unknown[0]])
    return value


def _list(where, field, value, limit, empty_ok=False):
    if not isinstance(value, list) or not (value or empty_ok):
        where.fail(field, "must be a non-empty list" if not empty_ok else "must be a list", value)
    if len(value) > limit:
        where.fail(field, f"has more than {limit} entries", len(value))
    return value


def _device(where, i: int, d) -> DeviceProfile:
    f = f"devices[{i}]"
    d = _mapping(where, f, d, DEVICE_FIELDS)
    base = None
    if "preset" in d:
        if not isinstance(d["preset"], str) or d["preset"] not in DEVICES:
            where.fail(f"{f}.preset", f"unknown device preset; expected one of {sorted(DEVICES)}",
                       d["preset"])
        base = DEVICES[d["preset"]]
    name = _string(where, f"{f}.name", d.get("name", base.name if base else None))
    if name_problem(name):  # it names the device's files (parts/<name>.npz, export/<name>.jaxexport)
        where.fail(f"{f}.name", name_problem(name), name)
    if "memory_bytes" in d and "memory_mb" in d:
        where.fail(f"{f}.memory_mb", "give memory_bytes or memory_mb, not both", d["memory_mb"])
    if base is None:
        for req in ("gflops", "memory_bytes"):
            if req not in d and not (req == "memory_bytes" and "memory_mb" in d):
                where.fail(f"{f}.{req}", "missing (give it, or name a preset: "
                                         f"{', '.join(sorted(DEVICES))})", show=False)
    base = base or DeviceProfile(name, 1.0, 1.0)
    memory = base.memory_bytes
    if "memory_bytes" in d:
        memory = _number(where, f"{f}.memory_bytes", d["memory_bytes"])
    elif "memory_mb" in d:
        memory = _number(where, f"{f}.memory_mb", d["memory_mb"]) * MIB
    note = d.get("description", base.note)
    if not isinstance(note, str):
        where.fail(f"{f}.description", "must be a string", note)
    quantize = d.get("quantize", base.quantize)
    if quantize is not None and not isinstance(quantize, bool):
        where.fail(f"{f}.quantize", "must be true or false", quantize)
    return DeviceProfile(
        name, _number(where, f"{f}.gflops", d.get("gflops", base.peak_gflops)), memory,
        _number(where, f"{f}.mem_bandwidth_gbs", d.get("mem_bandwidth_gbs", base.mem_bandwidth_gbs)),
        _number(where, f"{f}.efficiency", d.get("efficiency", base.efficiency), maximum=1.0),
        _number(where, f"{f}.layer_overhead_ms", d.get("layer_overhead_ms", base.layer_overhead_ms), allow_min=True),
        note, _optional(where, f"{f}.active_power_w", d.get("active_power_w", base.active_power_w), allow_min=True),
        _optional(where, f"{f}.energy_budget_mj", d.get("energy_budget_mj", base.energy_budget_mj)), quantize)


def _optional(where, field, value, allow_min=False):
    """An optional number (None or absent: not given)."""
    return None if value is None else _number(where, field, value, allow_min=allow_min)


def _link_pair(where, field, value, names) -> tuple:
    """(src, dst) from "a->b" or [a, b]."""
    if isinstance(value, str) and value.count("->") == 1:
        pair = tuple(s.strip() for s in value.split("->"))
    elif isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        pair = tuple(value)
    else:
        where.fail(field, "must name a link as 'src->dst' or [src, dst]", value)
    for end in pair:
        if end not in names:
            where.fail(field, f"names unknown device {end!r}; devices: {sorted(names)}", value)
    return pair


def _buses(where, raw, names) -> list:
    """[(name, mbps, [(src, dst), ...])] from the ``buses`` field."""
    out = []
    for i, b in enumerate(_list(where, "buses", raw, MAX_LINKS)):
        f = f"buses[{i}]"
        b = _mapping(where, f, b, BUS_FIELDS)
        for req in BUS_FIELDS:
            if req not in b:
                where.fail(f"{f}.{req}", "missing", show=False)
        name = _string(where, f"{f}.name", b["name"])
        if name in {o[0] for o in out}:
            where.fail(f"{f}.name", "duplicate bus name", name)
        mbps = _number(where, f"{f}.mbps", b["mbps"])
        pairs = [_link_pair(where, f"{f}.links[{j}]", v, names)
                 for j, v in enumerate(_list(where, f"{f}.links", b["links"], MAX_LINKS))]
        out.append((name, mbps, pairs))
    return out


def _links(where, raw, names, buses) -> list:
    on_bus = {p: (name, mbps / len(pairs)) for name, mbps, pairs in buses for p in pairs}
    out = []
    for i, l in enumerate(_list(where, "links", raw, MAX_LINKS, empty_ok=True)):  # [] for a single device
        f = f"links[{i}]"
        l = _mapping(where, f, l, LINK_FIELDS)
        for req in ("src", "dst"):
            if req not in l:
                where.fail(f"{f}.{req}", "missing", show=False)
            if not isinstance(l[req], str) or l[req] not in names:
                where.fail(f"{f}.{req}", f"unknown device; devices: {sorted(names)}", l[req])
        pair = (l["src"], l["dst"])
        if "mbps" in l:
            mbps = _number(where, f"{f}.mbps", l["mbps"])
        elif pair in on_bus:
            mbps = on_bus[pair][1]
        else:
            where.fail(f"{f}.mbps", "missing (a link needs its bandwidth in Mbit/s unless it is on a bus)",
                       show=False)
        wireless = l.get("wireless", False)
        if not isinstance(wireless, bool):
            where.fail(f"{f}.wireless", "must be true or false", wireless)
        out.append(LinkProfile(pair[0], pair[1], mbps,
                               _number(where, f"{f}.latency_ms", l.get("latency_ms", 0.0), allow_min=True), wireless,
                               *(_optional(where, f"{f}.{k}", l.get(k), allow_min=True)
                                 for k in ("tx_power_w", "rx_power_w"))))
    return out


def _layers(where, raw, names, default) -> tuple:
    if raw is None:
        if default is not None and len(default) == len(names):
            return tuple(default)
        each = DEFAULT_LAYERS if not default else max(1, round(sum(default) / len(default)))
        return (each,) * len(names)
    if isinstance(raw, dict):
        missing = [n for n in names if n not in raw]
        extra = [k for k in raw if k not in names]
        if extra:
            where.fail(f"layers_per_device.{extra[0]}", f"unknown device; devices: {names}", raw[extra[0]])
        if missing:
            where.fail(f"layers_per_device.{missing[0]}", "missing (one entry per device)", show=False)
        raw = [raw[n] for n in names]
    if not isinstance(raw, list) or len(raw) != len(names):
        where.fail("layers_per_device", f"must be a list of {len(names)} integers (one per device {names}) or a "
                                        "mapping device -> integer", raw)
    for n, k in zip(names, raw):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            where.fail(f"layers_per_device.{n}", "must be an integer >= 1", k)
    return tuple(raw)


def from_dict(obj: dict, source: str = "<topology>", layers_per_device=None) -> Topology:
    """A validated Topology from the parsed file format (see the module docstring).

    ``layers_per_device``: used when the file has none (if it has one entry per device; otherwise every device
    gets its rounded mean); the file's own value always wins. Default without either: 2 per device.
    """
    where = _Where(source)
    if isinstance(obj, dict) and isinstance(obj.get("space"), dict) and "devices" not in obj:
        obj = obj["space"].get("topology")  # a result.json: its space records the topology (jmsnas.space.to_dict)
    obj = _mapping(where, "(top level)", obj, TOP_FIELDS)
    for req in ("devices", "links"):
        if req not in obj:
            where.fail(req, "missing", show=False)
    name = _string(where, "name", obj.get("name", os.path.splitext(os.path.basename(source))[0] or "topology"))
    devices = [_device(where, i, d) for i, d in enumerate(_list(where, "devices", obj["devices"], MAX_DEVICES))]
    names = [d.name for d in devices]
    for i, n in enumerate(names):
        if n in names[:i]:
            where.fail(f"devices[{i}].name", "duplicate device name", n)
    buses = _buses(where, obj["buses"], set(names)) if obj.get("buses") is not None else []
    links = _links(where, obj["links"], set(names), buses)
    layers = _layers(where, obj.get("layers_per_device"), names, layers_per_device)
    pairs = {(l.src, l.dst) for l in links}
    if len(names) >= 2 and not buses and all((a, b) in pairs for a in names for b in names if a != b):
        try:  # every ordered pair linked: a cluster of peers (separable networks, paper 004), one slot each
            return cluster(name, devices, links)
        except TopologyError as e:
            raise TopologyError(" ".join(f"{source}: links: {e}".split())) from None
    try:
        return make_topology(name, devices, links, layers, [BusGroup(n, m, tuple(p)) for n, m, p in buses])
    except TopologyError as e:
        raise TopologyError(" ".join(f"{source}: links: {e}".split())) from None


def load(path, layers_per_device=None) -> Topology:
    """The Topology of a YAML/JSON topology file (or of a run's result.json); see ``from_dict``."""
    return from_dict(read(path), os.fspath(path), layers_per_device)


# ----------------------------------------------------------------------------------------------- writing

def _plain(x):
    return int(x) if isinstance(x, float) and x.is_integer() and abs(x) < 2 ** 53 else x


def to_dict(topo: Topology) -> dict:
    """The file format of ``topo`` with every field explicit (no presets): ``from_dict(to_dict(t)) == t``."""
    out = {"name": topo.name, "devices": [
        {"name": d.name, "gflops": _plain(d.peak_gflops), "memory_bytes": _plain(d.memory_bytes),
         "mem_bandwidth_gbs": _plain(d.mem_bandwidth_gbs), "efficiency": d.efficiency,
         "layer_overhead_ms": _plain(d.layer_overhead_ms), **({"description": d.note} if d.note else {}),
         **{k: _plain(getattr(d, k)) for k in ("active_power_w", "energy_budget_mj") if getattr(d, k) is not None},
         **({"quantize": bool(d.quantize)} if d.quantize is not None else {})}
        for d in topo.devices],
        "links": [{"src": l.src, "dst": l.dst, "mbps": _plain(l.bandwidth_mbps), "latency_ms": _plain(l.latency_ms),
                   "wireless": bool(l.wireless),
                   **{k: _plain(getattr(l, k)) for k in ("tx_power_w", "rx_power_w") if getattr(l, k) is not None}}
                  for l in topo.links],
        "layers_per_device": [int(k) for k in topo.layers_per_device]}
    if topo.buses:
        out["buses"] = [{"name": b.name, "mbps": _plain(b.bandwidth_mbps), "links": [f"{s}->{t}" for s, t in b.links]}
                        for b in topo.buses]
    return out


def dump(topo: Topology, path) -> None:
    """Writes ``topo`` to ``path``: JSON for a .json file, YAML otherwise. Non-ASCII text is written escaped
    (YAML reads some characters, e.g. U+0085, as line breaks, so raw they would not read back equal)."""
    path = os.fspath(path)
    d = to_dict(topo)
    with open(path, "w", encoding="utf-8") as f:
        if path.lower().endswith(".json"):
            json.dump(d, f, indent=2)
            f.write("\n")
        else:
            f.write(f"# jmsnas topology file ({topo.kind}); format: docs/topology.md\n")
            flow = lambda x: yaml.safe_dump(x, default_flow_style=True, sort_keys=False, width=1 << 16,
                                            allow_unicode=False).strip()
            f.write(f"name: {json.dumps(d['name'])}\n")
            f.write(yaml.safe_dump({"devices": d["devices"]}, sort_keys=False, default_flow_style=False,
                                   width=1 << 16, allow_unicode=False))
            f.write("links:" + "".join(f"\n  - {flow(l)}" for l in d["links"]) + ("\n" if d["links"] else " []\n"))
            f.write(f"layers_per_device: {flow(d['layers_per_device'])}\n")
            if "buses" in d:
                f.write("buses:\n" + "".join(f"  - {flow(b)}\n" for b in d["buses"]))


def is_file_name(value) -> bool:
    """True if ``value`` names a topology file (a .yaml/.yml/.json path or an existing file), not a preset."""
    return isinstance(value, (str, os.PathLike)) and (
        os.fspath(value).lower().endswith((".yaml", ".yml", ".json")) or os.path.isfile(os.fspath(value)))
