"""A latency table measured on one device: its type, its file format, its validation and its latency model.

Model of a sub-network executed as one jitted call on the profiled device (all in ms):

    T(arch) = call + stem + head + network.offset_ms + sum_n ops[n][arch[n]]        (identity: 0)

``ops[n][op]`` is the op's cost inside a network (see ``jmsnas.cost.profile`` for how it is measured), ``call``
the cost of a near-empty jitted call, ``stem``/``head`` their in-network costs, ``network.offset_ms`` what a
whole network costs beyond those terms (measured, see ``network.method``).

File format (YAML; ``write_table`` writes it, ``load_table`` validates it)::

    format: jmsnas-latency-table
    version: 1
    units: ms
    device: {backend: cpu, device_kind: cpu, jax: 0.10.2, cpu: ..., cpu_count: 2, ...}
    settings: {method: in-network, batch: 1, reps: 100, warmup: 3, quantile: 0.5, seed: 0, dw_impl: auto, ...}
    space: {fingerprint: 1f0c..., image_size: 8, in_channels: 1, num_classes: 10, stem_channels: 16,
            stem_stride: 1, head_channels: 128, num_layers: 8}
    call: {median_ms: 0.03, spread_ms: 0.004, reps: 100}
    arg_ms: 0.0011                     # extra cost per array passed to a call
    stem: {median_ms: ..., spread_ms: ..., reps: ...}
    head: {...}
    network: {method: in-network, networks: 65, offset_ms: 0.21}
    deployed:                          # optional (jmsnas.deploy.partcost): what a deployed part pays
      part_call: {median_ms: 0.25, spread_ms: 0.05, reps: 50}   # per part, beyond part_scale x its entries
      part_scale: 1.2                  # optional (absent: 1): an op's time in a part of its own / in the network
      idle_ms: 30.0                    # optional: the wait for its input before every part and frame was timed
      host_cores: 2                    # optional: the cores of the host measured
      cores_busy: 1.3                  # optional: how many of them a part keeps busy (CPU time / wall time)
      waits:                           # optional: parts and hand-offs after shorter waits than idle_ms
        wait_ms: [0.0, 3.0, 10.0, 30.0]        # increasing, the last idle_ms
        part_ratio: [0.8, 0.85, 0.95, 1.0]     # a part's time after that wait / after idle_ms (the last 1)
        handoff_fixed_ms: [0.15, 0.18, 0.23, 0.39]   # the hand-off's fixed ms after that wait (the last fixed_ms)
      parts:                           # optional: every op's time in a part of its own (then part_scale is 1)
        stem_ms: 0.33
        head_ms: 0.04
        parts: 173                     # parts fitted
        rms_error_pct: 4.6             # the fit's RMS relative error over them
        shrink: 1.0                    # optional: the pull toward the one-scale model, chosen on held-out networks
        cv_rms_error_pct: 8.5          # optional: RMS relative error over networks held out in turn, at shrink
        cv_rms_error_pct_unshrunk: 10.9   # optional: the same at shrink 0 (the plain fit)
        slots: [{mbconv_k3_e3: 0.21, ...}, ...]   # per slot: ms of every op the slot's ops have (identity: none)
      handoff: {fixed_ms: 0.08, ms_per_byte: 2.0e-06, bytes: [0, 4096, ...], median_ms: [...]}
    validation: {n: 50, within_10pct: 92.0, mape_pct: ..., against: ...}   # optional: jmsnas.cost.accuracy.report
    slots:
      - index: 0
        shape: {in_hw: 8, in_ch: 16, out_hw: 8, out_ch: 24, stride: 1}
        ops: {mbconv_k3_e3: {median_ms: ..., spread_ms: ..., reps: ...}, ...}

``median_ms`` is the statistic named by ``settings.quantile`` (0.5: the median) and ``spread_ms`` the
interquartile range of the underlying calls. Latencies are finite and >= 0; ``network.offset_ms`` may be
negative as long as call + stem + head + offset is not.

``deployed`` (absent in a table made without it) models the same network deployed as parts, one program per
device between a receive and a send: a part costs ``part_scale`` x its entries (ops; the stem and head where it
has them) plus ``part_call``, instead of the whole network's call + offset (a file without ``part_scale``: 1), or,
where ``parts`` is present, its ops', stem's and head's entries in ``parts`` plus ``part_call``; every hand-off
of n bytes between two parts costs ``fixed_ms + ms_per_byte * n`` (fitted on the measured ``bytes`` / ``median_ms``). ``jmsnas.cost.build``
turns them into ``CostTable.call_ms`` / ``handoff_ms`` / ``handoff_ms_per_byte`` and a device's
``compute_ms`` / ``stem_ms`` / ``head_ms`` times ``part_scale``. ``validation`` (optional) is
the report of ``jmsnas.cost.accuracy.report`` (what ``jmsnas validate`` reports) of the table against networks
measured end to end, with ``against`` saying which (``benchmarks/predict_vs_measured.py`` stores it).
``deployed.waits`` (optional) says how a part's time and a hand-off's fixed cost grow with the wait before them
(``jmsnas.deploy.partcost``); ``jmsnas.deploy.predict`` uses it for a chain's parts on one host.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Mapping, NamedTuple

import numpy as np
import yaml

from jmsnas import safeio
from jmsnas.space import IDENTITY, OP_NAMES, OPS, SearchSpace

FORMAT, VERSION = "jmsnas-latency-table", 1
METHODS = ("in-network", "standalone")
_SHAPE_FIELDS = ("in_hw", "in_ch", "out_hw", "out_ch", "stride")


class ProfileError(ValueError):
    """A malformed latency table file or an unusable profiling request; the message names the entry."""


class Timing(NamedTuple):
    """A latency statistic in ms: ``median_ms`` (the configured quantile), ``spread_ms`` (IQR), ``reps``."""

    median_ms: float
    spread_ms: float
    reps: int


class MeasuredTable(NamedTuple):
    """A latency table of one device (fields as in the module docstring; latencies in ms)."""

    device: dict
    settings: dict
    space: dict
    slots: tuple  # per slot: {"index": n, "shape": {...}, "ops": {op name: Timing}}
    call: Timing
    arg_ms: float
    stem: Timing
    head: Timing
    network: dict  # {"method": str, "networks": int, "offset_ms": float}
    deployed: dict | None = None  # {"part_call": Timing, "part_scale": float, "handoff": {"fixed_ms", "ms_per_byte",
    #                                "bytes", "median_ms"}, optional "idle_ms", "host_cores" and "cores_busy", "waits",
    #                                optional "parts": {"stem_ms",
    #                                "head_ms", "ops": num_slots rows of len(OP_NAMES) ms, "parts", "rms_error_pct"}}
    validation: dict | None = None  # jmsnas.cost.accuracy.report + "against"

    @property
    def fingerprint(self) -> str:
        return self.space["fingerprint"]

    @property
    def fixed_ms(self) -> float:
        """The once-per-network terms: call + stem + head + network offset."""
        return self.call.median_ms + self.stem.median_ms + self.head.median_ms + self.network["offset_ms"]


def slot_shape(s) -> dict:
    """The shape fields of a LayerSlot as plain ints."""
    return {k: int(getattr(s, k)) for k in _SHAPE_FIELDS}


def space_summary(space: SearchSpace) -> dict:
    """The shape-defining fields of a space and their fingerprint (16 hex digits of a SHA-256)."""
    d = {"image_size": space.image_size, "in_channels": space.in_channels, "num_classes": space.num_classes,
         "stem_channels": space.stem_channels, "stem_stride": space.stem_stride,
         "head_channels": space.head_channels, "num_layers": space.num_layers}
    canon = dict(d, slots=[slot_shape(s) for s in space.layers], ops=list(OP_NAMES))
    fp = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:16]
    return {"fingerprint": fp, **{k: int(v) for k, v in d.items()}}


def space_fingerprint(space: SearchSpace) -> str:
    return space_summary(space)["fingerprint"]


# ------------------------------------------------------------------------------------------ prediction


def op_ms_matrix(table: MeasuredTable) -> np.ndarray:
    """float64[N, R]: in-network ms of every op at every slot (0 for identity and for ops the table lacks)."""
    out = np.zeros((len(table.slots), len(OPS)))
    for n, slot in enumerate(table.slots):
        for name, t in slot["ops"].items():
            out[n, OP_NAMES.index(name)] = t.median_ms
    return out


def predict_arch_ms(table: MeasuredTable, ops) -> float:
    """Modelled end-to-end ms of architecture ``ops`` (op index per slot) run as one call on the device."""
    ops = [int(i) for i in np.asarray(ops).reshape(-1)]
    if len(ops) != len(table.slots):
        raise ProfileError(f"architecture has {len(ops)} ops, the table has {len(table.slots)} slots")
    total = table.fixed_ms
    for n, i in enumerate(ops):
        if i == IDENTITY:
            continue
        if not 0 <= i < len(OPS) or OP_NAMES[i] not in table.slots[n]["ops"]:
            raise ProfileError(f"the table has no entry for op index {i} at slot {n}")
        total += table.slots[n]["ops"][OP_NAMES[i]].median_ms
    return total


# ------------------------------------------------------------------------------------------ writing


def _timing_dict(t: Timing) -> dict:
    return {"median_ms": float(t.median_ms), "spread_ms": float(t.spread_ms), "reps": int(t.reps)}


def table_to_dict(table: MeasuredTable) -> dict:
    return {"format": FORMAT, "version": VERSION, "units": "ms", "device": dict(table.device),
            "settings": dict(table.settings), "space": dict(table.space), "call": _timing_dict(table.call),
            "arg_ms": float(table.arg_ms), "stem": _timing_dict(table.stem), "head": _timing_dict(table.head),
            "network": dict(table.network), **_deployed_dict(table.deployed, table.slots),
            **({} if table.validation is None else {"validation": dict(table.validation)}),
            "slots": [{"index": s["index"], "shape": dict(s["shape"]),
                       "ops": {k: _timing_dict(v) for k, v in s["ops"].items()}} for s in table.slots]}


def _deployed_dict(dep, slots) -> dict:
    if dep is None:
        return {}
    h = dep["handoff"]
    out = {"part_call": _timing_dict(dep["part_call"]), "part_scale": float(dep.get("part_scale", 1.0))}
    if dep.get("idle_ms") is not None:
        out["idle_ms"] = float(dep["idle_ms"])
    if dep.get("cores_busy") is not None:
        out["host_cores"], out["cores_busy"] = int(dep["host_cores"]), float(dep["cores_busy"])
    if dep.get("waits") is not None:
        out["waits"] = {k: [float(x) for x in dep["waits"][k]] for k in ("wait_ms", "part_ratio", "handoff_fixed_ms")}
    if dep.get("parts") is not None:
        pe = dep["parts"]
        ops = np.asarray(pe["ops"], float)
        out["parts"] = {"stem_ms": float(pe["stem_ms"]), "head_ms": float(pe["head_ms"]), "parts": int(pe["parts"]),
                        "rms_error_pct": float(pe["rms_error_pct"]),
                        **{k: float(pe[k]) for k in PART_FIT_EXTRAS if pe.get(k) is not None},
                        "slots": [{k: float(ops[s["index"], OP_NAMES.index(k)]) for k in s["ops"]
                                   if OP_NAMES.index(k) != IDENTITY} for s in slots]}
    out["handoff"] = {"fixed_ms": float(h["fixed_ms"]), "ms_per_byte": float(h["ms_per_byte"]),
                      "bytes": [int(b) for b in h["bytes"]], "median_ms": [float(v) for v in h["median_ms"]]}
    return {"deployed": out}


def write_table(table: MeasuredTable, path) -> None:
    """Writes the table as YAML (format in the module docstring), after validating it."""
    d = table_to_dict(table)
    table_from_dict(d, source=repr(os.fspath(path)))  # never write a file the loader would reject
    header = ("# jmsnas latency table (ms), format: see jmsnas/cost/measured.py. Modelled latency of a sub-network\n"
              "# run as one call = call + stem + head + network.offset_ms + its ops' entries (identity = 0).\n")
    with safeio.atomic_write(path, encoding="utf-8") as f:
        f.write(header)
        yaml.safe_dump(d, f, sort_keys=False, default_flow_style=None, width=120)


# ------------------------------------------------------------------------------------------ reading


def _number(where: str, v, *, minimum=0.0, integer=False):
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (isinstance(v, int) or not integer)
    if not ok or not math.isfinite(v) or (minimum is not None and v < minimum):
        want = (f"an integer >= {minimum}" if integer else
                f"a finite number >= {minimum}" if minimum is not None else "a finite number")
        raise ProfileError(f"latency table entry {where}: {safeio.short(v)} is not {want}")
    return v


def _field(d, name: str, where: str):
    if not isinstance(d, Mapping):
        raise ProfileError(f"latency table entry {where}: expected a mapping, got {type(d).__name__}")
    if name not in d:
        raise ProfileError(f"latency table entry {where}: missing field {name!r}")
    return d[name]


def _read_timing(d, where: str) -> Timing:
    return Timing(float(_number(f"{where}.median_ms", _field(d, "median_ms", where))),
                  float(_number(f"{where}.spread_ms", _field(d, "spread_ms", where))),
                  int(_number(f"{where}.reps", _field(d, "reps", where), minimum=1, integer=True)))


def _read_network(d) -> dict:
    net = _field(d, "network", "network")
    method = _field(net, "method", "network")
    if method not in METHODS:
        raise ProfileError(f"latency table entry network.method: {safeio.short(method)}, "
                           f"expected one of {list(METHODS)}")
    return {"method": method,
            "networks": int(_number("network.networks", _field(net, "networks", "network"), integer=True)),
            "offset_ms": float(_number("network.offset_ms", _field(net, "offset_ms", "network"), minimum=None))}


def _read_deployed(d, slots):
    """The optional ``deployed`` entry (module docstring; ``slots`` the table's slots, read), or None."""
    if "deployed" not in d:
        return None
    dep = _field(d, "deployed", "deployed")
    part_call = _read_timing(_field(dep, "part_call", "deployed"), "deployed.part_call")
    scale = float(_number("deployed.part_scale", dep.get("part_scale", 1.0)))
    if scale <= 0:
        raise ProfileError(f"latency table entry deployed.part_scale: {scale!r} is not a finite number > 0")
    h = _field(dep, "handoff", "deployed")
    out = {"fixed_ms": float(_number("deployed.handoff.fixed_ms", _field(h, "fixed_ms", "deployed.handoff"))),
           "ms_per_byte": float(_number("deployed.handoff.ms_per_byte",
                                        _field(h, "ms_per_byte", "deployed.handoff")))}
    for k in ("bytes", "median_ms"):
        v = _field(h, k, "deployed.handoff")
        if not isinstance(v, list):
            raise ProfileError(f"latency table entry deployed.handoff.{k}: expected a list, got {safeio.short(v)}")
        out[k] = [(int if k == "bytes" else float)(_number(f"deployed.handoff.{k}[{i}]", x, integer=k == "bytes"))
                  for i, x in enumerate(v)]
    if len(out["bytes"]) != len(out["median_ms"]):
        raise ProfileError(f"latency table entry deployed.handoff: {len(out['bytes'])} sizes in bytes, "
                           f"{len(out['median_ms'])} in median_ms; expected one median per size")
    res = {"part_call": part_call, "part_scale": scale, "handoff": out}
    if "idle_ms" in dep:
        res["idle_ms"] = float(_number("deployed.idle_ms", dep["idle_ms"]))
    if "cores_busy" in dep or "host_cores" in dep:
        res["host_cores"] = int(_number("deployed.host_cores", _field(dep, "host_cores", "deployed"), minimum=1,
                                        integer=True))
        res["cores_busy"] = float(_number("deployed.cores_busy", _field(dep, "cores_busy", "deployed")))
        if not 0 < res["cores_busy"] <= res["host_cores"]:
            raise ProfileError(f"latency table entry deployed.cores_busy: {res['cores_busy']!r}; expected a number in "
                               f"(0, host_cores = {res['host_cores']}]")
    if "waits" in dep:
        res["waits"] = _read_waits(_field(dep, "waits", "deployed"), res.get("idle_ms"))
    if "parts" in dep:
        res["parts"] = _read_part_entries(_field(dep, "parts", "deployed"), slots)
        if scale != 1.0:
            raise ProfileError(f"latency table entry deployed.part_scale: {scale!r} with deployed.parts; expected 1 "
                               "(the part entries are already the ops' times in a part)")
    return res


def _read_waits(w, idle_ms) -> dict:
    """``deployed.waits`` (module docstring): three lists of one length >= 2, ``wait_ms`` increasing from 0 and
    ending at ``idle_ms``, ``part_ratio`` > 0 ending at 1, ``handoff_fixed_ms`` >= 0."""
    where = "deployed.waits"
    if idle_ms is None:
        raise ProfileError(f"latency table entry {where}: needs deployed.idle_ms (the wait its last entry is at)")
    out = {}
    for k in ("wait_ms", "part_ratio", "handoff_fixed_ms"):
        v = _field(w, k, where)
        if not isinstance(v, (list, tuple)) or len(v) < 2:
            raise ProfileError(f"latency table entry {where}.{k}: expected a list of at least 2 numbers, got "
                               f"{safeio.short(v)}")
        out[k] = tuple(float(_number(f"{where}.{k}[{i}]", x)) for i, x in enumerate(v))
    if len({len(v) for v in out.values()}) != 1:
        raise ProfileError(f"latency table entry {where}: wait_ms, part_ratio and handoff_fixed_ms have "
                           f"{[len(v) for v in out.values()]} entries; expected one per wait")
    t = out["wait_ms"]
    if t[0] != 0 or any(b <= a for a, b in zip(t, t[1:])) or t[-1] != idle_ms:
        raise ProfileError(f"latency table entry {where}.wait_ms: {list(t)}; expected increasing waits from 0 to "
                           f"deployed.idle_ms = {idle_ms!r}")
    if any(r <= 0 for r in out["part_ratio"]) or out["part_ratio"][-1] != 1.0:
        raise ProfileError(f"latency table entry {where}.part_ratio: {list(out['part_ratio'])}; expected ratios "
                           "> 0 ending at 1 (the time after idle_ms over itself)")
    return out


PART_FIT_EXTRAS = ("shrink", "cv_rms_error_pct", "cv_rms_error_pct_unshrunk")  # optional in deployed.parts


def _read_part_entries(pe, slots) -> dict:
    """``deployed.parts`` (module docstring) as {"stem_ms", "head_ms", "ops": len(slots) rows of len(OP_NAMES) ms,
    "parts", "rms_error_pct"}; every slot's ops must be among the table's own for that slot."""
    if not isinstance(pe, Mapping):
        raise ProfileError(f"latency table entry deployed.parts: expected a mapping, got {safeio.short(pe)}")
    out = {k: float(_number(f"deployed.parts.{k}", _field(pe, k, "deployed.parts")))
           for k in ("stem_ms", "head_ms", "rms_error_pct")}
    out["parts"] = int(_number("deployed.parts.parts", _field(pe, "parts", "deployed.parts"), minimum=1,
                               integer=True))
    for k in PART_FIT_EXTRAS:  # optional (tables made before the shrunk fit have none)
        if pe.get(k) is not None:
            out[k] = float(_number(f"deployed.parts.{k}", pe[k]))
    rows = _field(pe, "slots", "deployed.parts")
    if not isinstance(rows, list) or len(rows) != len(slots):
        raise ProfileError(f"latency table entry deployed.parts.slots: expected a list of {len(slots)} mappings (one "
                           f"per slot), got {safeio.short(rows)}")
    ops = np.zeros((len(slots), len(OP_NAMES)))
    for n, (row, s) in enumerate(zip(rows, slots)):
        if not isinstance(row, Mapping):
            raise ProfileError(f"latency table entry deployed.parts.slots[{n}]: expected a mapping of op name -> ms")
        for k, v in row.items():
            if k not in s["ops"] or OP_NAMES.index(k) == IDENTITY:
                raise ProfileError(f"latency table entry deployed.parts.slots[{n}].{k}: not an op the table has for "
                                   f"slot {n}; expected one of {[o for o in s['ops'] if o != OP_NAMES[IDENTITY]]}")
            ops[n, OP_NAMES.index(k)] = float(_number(f"deployed.parts.slots[{n}].{k}", v))
    out["ops"] = tuple(tuple(row) for row in ops.tolist())  # a table's fields compare by value
    return out


def _read_validation(d):
    """The optional ``validation`` report (a mapping of names to numbers or text), or None."""
    if "validation" not in d:
        return None
    v = d["validation"]
    if not isinstance(v, Mapping) or not all(isinstance(x, (int, float, str)) for x in v.values()):
        raise ProfileError(f"latency table entry validation: expected a mapping of names to numbers or text, got "
                           f"{safeio.short(v)}")
    return dict(v)


def _read_slot(s, n: int) -> dict:
    where = f"slots[{n}]"
    if _field(s, "index", where) != n:
        raise ProfileError(f"latency table entry {where}.index: {safeio.short(s['index'])}, expected {n}")
    shape = _field(s, "shape", where)
    shape = {k: int(_number(f"{where}.shape.{k}", _field(shape, k, f"{where}.shape"), minimum=1, integer=True))
             for k in _SHAPE_FIELDS}
    ops = _field(s, "ops", where)
    if not isinstance(ops, Mapping):
        raise ProfileError(f"latency table entry {where}.ops: expected a mapping of op name -> timing")
    for name in ops:
        if name not in OP_NAMES:
            raise ProfileError(f"latency table entry {where}.ops.{name}: unknown op; expected one of {list(OP_NAMES)}")
    return {"index": n, "shape": shape, "ops": {k: _read_timing(v, f"{where}.ops.{k}") for k, v in ops.items()}}


def table_from_dict(d, source: str = "<dict>") -> MeasuredTable:
    """Validates a loaded table mapping; raises ProfileError naming the first bad entry."""
    if not isinstance(d, Mapping):
        raise ProfileError(f"latency table {source}: expected a mapping, got {type(d).__name__}")
    if d.get("format") != FORMAT or d.get("version") != VERSION:
        raise ProfileError(f"latency table {source}: format/version {safeio.short(d.get('format'))}/"
                           f"{safeio.short(d.get('version'))}, "
                           f"expected {FORMAT!r}/{VERSION}")
    for name in ("device", "settings", "space"):
        if not isinstance(_field(d, name, name), Mapping):
            raise ProfileError(f"latency table entry {name}: expected a mapping")
    if not isinstance(d["space"].get("fingerprint"), str):
        raise ProfileError("latency table entry space.fingerprint: missing or not a string")
    call, stem, head = (_read_timing(_field(d, k, k), k) for k in ("call", "stem", "head"))
    arg_ms = float(_number("arg_ms", _field(d, "arg_ms", "arg_ms")))
    network = _read_network(d)
    slots = _field(d, "slots", "slots")
    if not isinstance(slots, list) or not slots:
        raise ProfileError("latency table entry slots: expected a non-empty list")
    slots = tuple(_read_slot(s, n) for n, s in enumerate(slots))
    table = MeasuredTable(dict(d["device"]), dict(d["settings"]), dict(d["space"]), slots, call, arg_ms, stem, head,
                          network, _read_deployed(d, slots), _read_validation(d))
    if call.median_ms + stem.median_ms + network["offset_ms"] < 0:
        raise ProfileError(f"latency table entry network.offset_ms: {network['offset_ms']} makes the per-network "
                           f"term call + stem + offset negative "
                           f"({call.median_ms + stem.median_ms + network['offset_ms']:.4f} ms); expected >= 0")
    return table


def check_space(table: MeasuredTable, space: SearchSpace, source: str = "<table>") -> None:
    """Raises ProfileError unless ``table`` was measured for ``space`` and has every valid non-identity op."""
    mine = space_summary(space)
    if table.fingerprint != mine["fingerprint"]:
        diff = [k for k in mine if k != "fingerprint" and table.space.get(k) != mine[k]]
        if not diff:
            diff = [f"slots[{n}]" for n, (a, b) in enumerate(zip(table.slots, space.layers))
                    if a["shape"] != slot_shape(b)][:3]
        raise ProfileError(f"latency table {source} was measured for another search space: fingerprint "
                           f"{table.fingerprint}, this space's is {mine['fingerprint']} (differs in: "
                           f"{', '.join(diff) or 'op set'}); profile this space with `jmsnas profile`")
    mask = space.mask()
    for s in space.layers:
        for i in np.flatnonzero(mask[s.index]):
            if i != IDENTITY and OP_NAMES[i] not in table.slots[s.index]["ops"]:
                raise ProfileError(f"latency table {source}: slots[{s.index}].ops lacks valid op {OP_NAMES[i]!r}")


def load_table(path, space: SearchSpace | None = None) -> MeasuredTable:
    """Reads and validates a table file; with ``space``, also checks that it was measured for that space."""
    path = os.fspath(path)
    try:
        d = safeio.load_yaml(safeio.read_bytes(path, "latency table"), f"latency table {path!r}")
    except ValueError as e:
        raise ProfileError(str(e)) from None
    table = table_from_dict(d, source=repr(path))
    if space is not None:
        check_space(table, space, repr(path))
    return table
