"""Every kind of latency source becomes the core ``CostTable``: ``build_table(space, spec)``.

``spec`` maps device names of the space's topology to one source each; devices it does not name get the
roofline of their own ``DeviceProfile`` (``jmsnas.cost.tables.analytic_table``). Sources (all latencies in ms):

    {"kind": "roofline"}                                 roofline of the device's own profile
    {"kind": "roofline", "preset": "eyeriss"}            roofline of a device preset (jmsnas.topology.presets)
    {"kind": "measured", "path": "ue.yaml"}              a ``jmsnas profile`` table measured for this space
    {"kind": "regression", "path": "model.json"}         a fitted jmsnas.cost.regression model (model_to_json)
    {"kind": "regression", "fit": "other.yaml"}          a model fitted now on a measured table of any space
    {"kind": "lut", "path": "mobile_trim.yaml"}          a ProxylessNAS / OFA lookup table; a missing key is an
                                                         error listing every missing key ...
    {"kind": "lut", "path": ..., "fill": "regression"}   ... or is estimated by a model fitted on the table
    {"kind": "scaled", "of": "sbs", "factor": 2.0}       another device's row times ``factor``

A row holds every slot of the space (a searched split may place any layer on any device), the stem and the head.
Identity costs 0 everywhere (nothing executes). A measured row's stem term carries the call overhead and the
network offset of its file: a network run as one call on that device pays them once. A measured file with
``deployed`` terms (``jmsnas profile``; ``jmsnas.cost.measured``) models the network deployed as parts instead:
its row's stem is the stem alone, every device pays its file's ``part_call`` (``CostTable.call_ms``), its ops,
stem and head cost ``part_scale`` x their entries (what an op costs in a part of its own rather than inside the
whole-network call; the row's compute, stem and head are scaled here, once, so every reader of the CostTable,
eq. (1)/(2), the split DP, limits, compose, the deployed prediction, charges the same U), or, where the file has
part entries (``deployed.parts``: every op timed in a part of its own), those entries and their stem and head, and a
link pays the
hand-off fitted by its two ends' files (the mean of the ends that have one; 0 when neither has: the paper's eps).
A scaled row scales the call cost with the rest and keeps the hand-off of its source.

Lookup-table keys of a slot (``slot_key``): ``expanded_conv-input:HxWxCin-output:H'xW'xCout-expand:E-kernel:K-
stride:S-idskip:I`` with E the expansion ratio (ProxylessNAS) or the middle channels plus ``-se:0-hs:0`` (OFA),
I = 1 for a shortcut op; the stem is ``Conv-input:..-output:..``; the head is ``Conv_1`` (1x1 conv) followed by
``Logits`` (ProxylessNAS, pooling included) or by ``AvgPool2D`` and ``Logits`` (OFA).
"""
from __future__ import annotations

import math
import os
from typing import Mapping, NamedTuple

import numpy as np

from jmsnas.cost import lut as L
from jmsnas.cost import profile as P
from jmsnas.cost import regression as RG
from jmsnas.cost.tables import CostTable, from_compute, head_flops, roofline_ms, stem_flops
from jmsnas.space import IDENTITY, OP_NAMES, OPS, LayerSlot, SearchSpace, op_flops, op_memory_bytes
from jmsnas.topology import DeviceProfile, presets

KINDS = ("roofline", "measured", "regression", "lut", "scaled")
_FIELDS = {"roofline": ((), ("preset",)), "measured": (("path",), ()), "regression": ((), ("path", "fit")),
           "lut": (("path",), ("fill",)), "scaled": (("of", "factor"), ())}


class TableSpecError(ValueError):
    """A bad table spec entry; the message names the device and the field."""


class Row(NamedTuple):
    """One device's latencies: compute_ms float64[N, R] (0 for identity/masked), stem_ms, head_ms (ms).

    ``source`` describes where they come from; ``estimated`` names the entries a model filled in.
    """

    compute_ms: np.ndarray
    stem_ms: float
    head_ms: float
    source: str
    estimated: tuple = ()
    call_ms: float = 0.0  # the deployed part's call cost (ms), 0 without one
    handoff: tuple | None = None  # (fixed ms, ms per byte) of a hand-off, None without one
    part_scale: float = 1.0  # an op's time in a deployed part / in the whole network; already in compute/stem/head


# ------------------------------------------------------------------------------------------ spec checking


def _plain(obj):
    """ml_collections ConfigDicts (and nested ones) as plain dicts."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def check_spec(space: SearchSpace, spec) -> dict:
    """Validates ``spec`` against the space's devices; returns {device name: source dict} for every device."""
    names = list(space.topology.device_names)
    spec = {} if spec is None else _plain(spec)
    if not isinstance(spec, Mapping):
        raise TableSpecError(f"table spec must be a mapping of device name -> source, got {type(spec).__name__}")
    unknown = [d for d in spec if d not in names]
    if unknown:
        raise TableSpecError(f"table spec names unknown device(s) {unknown}; the topology's devices are {names}")
    out = {}
    for dev in names:
        src = spec.get(dev, {"kind": "roofline"})
        where = f"table spec for device {dev!r}"
        if not isinstance(src, Mapping) or "kind" not in src:
            raise TableSpecError(f"{where}: expected a mapping with a 'kind' ({', '.join(KINDS)}), got {src!r}")
        kind = src["kind"]
        if kind not in KINDS:
            raise TableSpecError(f"{where}: unknown kind {kind!r}; expected one of {list(KINDS)}")
        required, optional = _FIELDS[kind]
        extra = sorted(set(src) - {"kind", *required, *optional})
        missing = [f for f in required if f not in src]
        if extra or missing:
            raise TableSpecError(f"{where} (kind {kind!r}): " + (f"unknown field(s) {extra}" if extra else "")
                                 + ("; " if extra and missing else "") + (f"missing field(s) {missing}" if missing
                                                                          else "")
                                 + f"; fields are {list(required)} required, {list(optional)} optional")
        _check_fields(where, kind, src, names, spec)
        out[dev] = dict(src)
    return out


def _check_fields(where: str, kind: str, src: Mapping, names: list, spec: Mapping) -> None:
    for f in ("path", "fit"):
        if f in src and (not isinstance(src[f], (str, os.PathLike)) or not os.fspath(src[f])):
            raise TableSpecError(f"{where}: {f} must be a file path, got {src[f]!r}")
    if kind == "regression" and ("path" in src) == ("fit" in src):
        raise TableSpecError(f"{where}: a regression source needs exactly one of 'path' (model JSON) or 'fit' "
                             f"(measured table to fit on), got {sorted(k for k in src if k != 'kind')}")
    if kind == "roofline" and "preset" in src and src["preset"] not in presets.DEVICES:
        raise TableSpecError(f"{where}: unknown device preset {src['preset']!r}; expected one of "
                             f"{list(presets.DEVICES)}")
    if kind == "lut" and src.get("fill", "error") not in ("error", "regression"):
        raise TableSpecError(f"{where}: fill must be 'error' or 'regression', got {src['fill']!r}")
    if kind == "scaled":
        f = src["factor"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise TableSpecError(f"{where}: factor must be a positive number, got {f!r}")
        of = src["of"]
        if of not in names:
            raise TableSpecError(f"{where}: 'of' names unknown device {of!r}; devices are {names}")
        if spec.get(of, {}).get("kind") == "scaled":
            raise TableSpecError(f"{where}: 'of' device {of!r} is itself scaled; scale a device with its own source")


# ------------------------------------------------------------------------------------------------ rows


def _valid(space: SearchSpace):
    """(slot, op index) of every valid non-identity candidate."""
    mask = space.mask()
    return [(s, int(i)) for s in space.layers for i in np.flatnonzero(mask[s.index]) if i != IDENTITY]


def roofline_row(space: SearchSpace, device: DeviceProfile) -> Row:
    """The roofline row of ``device`` (as ``analytic_table`` computes it)."""
    comp = np.zeros((space.num_layers, len(OPS)))
    for s, i in _valid(space):
        comp[s.index, i] = roofline_ms(op_flops(OPS[i], s), op_memory_bytes(OPS[i], s), device)
    return Row(comp, float(roofline_ms(stem_flops(space), 0.0, device)),
               float(roofline_ms(head_flops(space), 0.0, device)), f"roofline of {device.name}")


def measured_row(space: SearchSpace, path) -> Row:
    """A row from a ``jmsnas profile`` file, which must have been measured for ``space``."""
    t = P.load_table(path, space)
    comp, src = P.op_ms_matrix(t) * space.mask(), f"measured {os.fspath(path)}"
    if t.deployed is not None:  # parts: every device pays the part's call cost, a hand-off every link
        h, s = t.deployed["handoff"], float(t.deployed.get("part_scale", 1.0))
        call, pe = t.deployed["part_call"].median_ms, t.deployed.get("parts")
        if pe is not None:  # every op's time in a part of its own
            return Row(np.asarray(pe["ops"], float) * space.mask(), pe["stem_ms"], pe["head_ms"],
                       src + " (deployed part entries)", (), call, (h["fixed_ms"], h["ms_per_byte"]), 1.0)
        if s != 1.0:
            src += f" (deployed part scale {s:g})"
        return Row(comp * s, t.stem.median_ms * s, t.head.median_ms * s, src, (), call,
                   (h["fixed_ms"], h["ms_per_byte"]), s)
    stem = t.call.median_ms + t.network["offset_ms"] + t.stem.median_ms
    return Row(comp, stem, t.head.median_ms, src)


def _stem_head_keys(space: SearchSpace, flavor: str) -> list:
    """(name, LayerKey) of the stem and the head in lookup-table terms."""
    i, hs = space.image_size, space.stem_out_hw
    hw, ch = space.head_in
    keys = [("stem", L.LayerKey("Conv", (i, i, space.in_channels), (hs, hs, space.stem_channels))),
            ("head/Conv_1", L.LayerKey("Conv_1", (hw, hw, ch), (hw, hw, space.head_channels)))]
    if flavor == "ofa":
        keys.append(("head/AvgPool2D", L.LayerKey("AvgPool2D", (hw, hw, space.head_channels),
                                                  (1, 1, space.head_channels))))
        keys.append(("head/Logits", L.LayerKey("Logits", (1, 1, space.head_channels), (space.num_classes,))))
    else:
        keys.append(("head/Logits", L.LayerKey("Logits", (hw, hw, space.head_channels), (space.num_classes,))))
    return keys


def slot_key(slot: LayerSlot, op, flavor: str = "proxyless") -> str:
    """The lookup-table key of candidate ``op`` (OpSpec, MBConv) at ``slot`` in the ProxylessNAS or OFA grammar."""
    if op.is_identity:
        raise ValueError("identity has no lookup-table key (it executes nothing and costs 0)")
    if flavor not in ("proxyless", "ofa"):
        raise ValueError(f"flavor must be 'proxyless' or 'ofa', got {flavor!r}")
    extra = dict(se=0, hs=0) if flavor == "ofa" else {}
    expand = op.expand * slot.in_ch if flavor == "ofa" else op.expand
    return L.format_key(L.LayerKey("expanded_conv", (slot.in_hw, slot.in_hw, slot.in_ch),
                                   (slot.out_hw, slot.out_hw, slot.out_ch), expand=expand, kernel=op.kernel,
                                   stride=slot.stride, idskip=int(op.residual), **extra))


def lut_keys(space: SearchSpace, flavor: str = "proxyless") -> list:
    """(name, key) of every lookup-table entry the space needs: valid ops of every slot, stem, head parts."""
    out = [(f"slots[{s.index}]/{OP_NAMES[i]}", slot_key(s, OPS[i], flavor)) for s, i in _valid(space)]
    return out + [(n, L.format_key(k)) for n, k in _stem_head_keys(space, flavor)]


def lut_row(space: SearchSpace, path, fill: str = "error") -> Row:
    """A row from a ProxylessNAS/OFA table; missing keys raise MissingKeysError or, with fill="regression", are
    estimated by ``regression.fit_lut`` on the whole table (named in ``Row.estimated``)."""
    table = L.load_lut(path)
    keys = lut_keys(space, table.flavor)
    missing = tuple((n, k) for n, k in keys if k not in table.entries)
    values = {k: table.entries[k] for _, k in keys if k in table.entries}
    if missing and fill == "error":
        lines = "\n".join(f"  {n}: {k}" for n, k in missing)
        raise L.MissingKeysError(f"{len(missing)} key(s) of this search space missing from latency table "
                                 f"{table.source} (pass fill='regression' to estimate them):\n{lines}", missing)
    if missing:
        model, _ = RG.fit_lut(table, holdout_fraction=0.0)
        feats = [RG.features_from_key(L.parse_key(k), table.flavor) for _, k in missing]
        values.update(zip((k for _, k in missing), RG.predict(model, feats).tolist()))
    comp = np.zeros((space.num_layers, len(OPS)))
    for s, i in _valid(space):
        comp[s.index, i] = values[slot_key(s, OPS[i], table.flavor)]
    tail = {n: values[L.format_key(k)] for n, k in _stem_head_keys(space, table.flavor)}
    head = sum(v for n, v in tail.items() if n.startswith("head/"))
    return Row(comp, tail["stem"], head, f"lookup table {table.source}", tuple(n for n, _ in missing))


def _measured_features(table: P.MeasuredTable) -> tuple:
    """(LayerFeatures, ms) of every positive op entry of a measured table (its own slot shapes)."""
    feats, ms = [], []
    for n, slot in enumerate(table.slots):
        sh = slot["shape"]
        ls = LayerSlot(n, 0, -1, sh["in_ch"], sh["out_ch"], sh["in_hw"], sh["out_hw"], sh["stride"])
        for name, t in slot["ops"].items():
            if t.median_ms > 0:
                feats.append(RG.features_from_slot(OPS[OP_NAMES.index(name)], ls))
                ms.append(t.median_ms)
    return feats, ms


def regression_model(src: Mapping) -> RG.LatencyModel:
    """The model of a regression source: read from ``path`` or fitted on the measured table ``fit``."""
    if "path" in src:
        try:
            with open(src["path"], "r", encoding="utf-8") as f:
                return RG.model_from_json(f.read())
        except OSError as e:
            raise TableSpecError(f"cannot read regression model {os.fspath(src['path'])!r}: {e.strerror}") from None
    feats, ms = _measured_features(P.load_table(src["fit"]))
    return RG.fit(feats, ms, holdout_fraction=0.0)[0]


def regression_row(space: SearchSpace, model: RG.LatencyModel, source: str = "regression") -> Row:
    """A row estimated by ``model`` from each slot's features (stem and head from their lookup-table keys)."""
    comp = np.zeros((space.num_layers, len(OPS)))
    cand = _valid(space)
    if cand:
        pred = RG.predict(model, [RG.features_from_slot(OPS[i], s) for s, i in cand])
        for (s, i), v in zip(cand, pred):
            comp[s.index, i] = v
    tail = _stem_head_keys(space, "proxyless")
    pred = RG.predict(model, [RG.features_from_key(k, "proxyless") for _, k in tail])
    return Row(comp, float(pred[0]), float(sum(pred[1:])), source)


def build_rows(space: SearchSpace, spec=None) -> dict:
    """{device name: Row} for every device of the space's topology (see the module docstring for ``spec``)."""
    spec = check_spec(space, spec)
    devices = {d.name: d for d in space.topology.devices}
    rows = {}
    for dev, src in spec.items():
        kind = src["kind"]
        if kind == "roofline":
            rows[dev] = roofline_row(space, presets.device(src["preset"]) if "preset" in src else devices[dev])
        elif kind == "measured":
            rows[dev] = measured_row(space, src["path"])
        elif kind == "regression":
            what = f"regression model {src['path']}" if "path" in src else f"regression fitted on {src['fit']}"
            rows[dev] = regression_row(space, regression_model(src), what)
        elif kind == "lut":
            rows[dev] = lut_row(space, src["path"], src.get("fill", "error"))
    for dev, src in spec.items():
        if src["kind"] == "scaled":
            base, f = rows[src["of"]], float(src["factor"])
            rows[dev] = Row(base.compute_ms * f, base.stem_ms * f, base.head_ms * f,
                            f"{base.source} x {f:g}", base.estimated, base.call_ms * f, base.handoff, base.part_scale)
    return {dev: rows[dev] for dev in spec}


def build_table(space: SearchSpace, spec=None, activation_bits: int = 32) -> CostTable:
    """The CostTable of ``space`` with each device's latencies from its source in ``spec``."""
    if activation_bits not in (4, 8, 16, 32):
        raise TableSpecError(f"activation bits must be one of 4, 8, 16, 32, got {activation_bits!r}")
    rows = build_rows(space, spec)
    names = space.topology.device_names
    compute = np.stack([rows[d].compute_ms for d in names])
    handoff = link_handoffs(space, rows)
    return from_compute(space, compute, [rows[d].stem_ms for d in names], [rows[d].head_ms for d in names],
                        activation_bits, [rows[d].call_ms for d in names], handoff[:, 0], handoff[:, 1])


def link_handoffs(space: SearchSpace, rows: dict) -> np.ndarray:
    """float64[L, 2]: every link's hand-off (fixed ms, ms per byte), the mean over its two ends' rows that have
    one, 0 where neither has."""
    out = np.zeros((len(space.topology.links), 2))
    for i, l in enumerate(space.topology.links):
        ends = [rows[d].handoff for d in (l.src, l.dst) if rows[d].handoff is not None]
        if ends:
            out[i] = np.mean(np.asarray(ends, float), axis=0)
    return out


def describe(rows: dict) -> str:
    """One line per device: its source and how many entries were estimated."""
    return "\n".join(f"{d}: {r.source}" + (f" ({len(r.estimated)} entries estimated)" if r.estimated else "")
                     for d, r in rows.items())
