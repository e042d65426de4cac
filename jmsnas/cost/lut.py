"""Published latency lookup tables (ProxylessNAS / Once-for-All YAML) and network latency from them.

A table maps a layer key to measured statistics in ms::

    expanded_conv-input:112x112x16-output:56x56x24-expand:3-kernel:5-stride:2-idskip:0:   # ProxylessNAS
      {count: 159, mean: 7.519, var: 0.093}
    expanded_conv-input:56x56x32-output:28x28x48-expand:128-kernel:3-stride:2-idskip:0-se:1-hs:0:  # OFA
      {count: 54, mean: 4.81, std: 0.09}

Key grammar: ``<kind>-input:<shape>-output:<shape>[-<field>:<int>...]`` where ``<shape>`` is ``HxWxC`` or ``C``.
``kind`` is one of ``Conv`` (the first 3x3 convolution), ``Conv_1`` (final 1x1 expansion), ``Conv_2`` (OFA's
feature-mix 1x1 convolution on the pooled vector), ``AvgPool2D``, ``Logits`` (classifier; in ProxylessNAS it
includes the global pooling) and ``expanded_conv`` (an inverted-residual block) which carries ``expand``,
``kernel``, ``stride``, ``idskip`` and, in OFA tables, ``se`` and ``hs``. ``expand`` is the expansion *ratio* in
ProxylessNAS tables and the absolute number of middle channels in OFA tables.

Networks are described as a ProxylessNAS or OFA ``net.config`` JSON or as an OFA MobileNetV3 arch dict
(``ks``, ``e``, ``d``, ``r``); each is turned into (layer name, key) pairs the same way the reference
implementations (proxylessnas ``LatencyEstimator``, once-for-all ``MBv3LatencyTable``) build their keys, and the
latency is the sum of the table means. A key the table lacks is an error listing every missing key.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, NamedTuple

import yaml

from jmsnas import safeio

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

KINDS = ("Conv", "Conv_1", "Conv_2", "AvgPool2D", "Logits", "expanded_conv")
_BLOCK_FIELDS = ("expand", "kernel", "stride", "idskip")
_OFA_FIELDS = ("se", "hs")
_BLOCK_NAMES = ("MobileInvertedResidualBlock", "ResidualBlock")
_CONV_NAMES = ("MBInvertedConvLayer", "MBConvLayer", "ZeroLayer")
_MAX_INT = 2**20  # channels, kernel sizes, strides, resolutions
_MAX_EXPAND = 1e6  # expansion ratios are single digits; this bound keeps round(channels * e) finite


class LUTError(ValueError):
    """A malformed latency table or an unusable architecture description."""


class MissingKeysError(LUTError):
    """Layer keys the table lacks; ``missing`` holds (layer name, key) pairs in network order."""

    def __init__(self, message: str, missing: tuple):
        super().__init__(message)
        self.missing = missing

    @property
    def keys(self) -> tuple:
        return tuple(dict.fromkeys(k for _, k in self.missing))


class LayerKey(NamedTuple):
    """The parsed fields of one table key. Shapes are (H, W, C) or (C,); absent fields are None."""

    kind: str
    input: tuple
    output: tuple
    expand: int | None = None
    kernel: int | None = None
    stride: int | None = None
    idskip: int | None = None
    se: int | None = None
    hs: int | None = None


class LatencyLUT(NamedTuple):
    """A validated lookup table.

    Attributes:
      source: file name or description.
      flavor: "proxyless" (expand = ratio, no se/hs) or "ofa" (expand = middle channels, se/hs fields).
      entries: key string -> mean latency in ms.
      keys: key string -> LayerKey.
      counts: key string -> number of measurements (None when the table gives none).
    """

    source: str
    flavor: str
    entries: dict
    keys: dict
    counts: dict


class NetLatency(NamedTuple):
    """Latency of a network from a table: total in ms, per layer name -> ms, per layer name -> key."""

    total_ms: float
    per_layer: dict
    keys: dict


# ----------------------------------------------------------------------------------------------- parsing


def _shape(text: str) -> tuple:
    parts = text.split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or len(parts) not in (1, 3):
        raise ValueError(f"shape {safeio.short(text)} is not HxWxC or C with positive integers")
    return tuple(int(p) for p in parts)


def parse_key(key: str) -> LayerKey:
    """Parses one table key; raises LUTError naming the key and the offending part."""
    if not isinstance(key, str) or not key:
        raise LUTError(f"table key {safeio.short(key)} is not a non-empty string")
    kind, *tokens = key.split("-")
    if kind not in KINDS:
        raise LUTError(f"table key {safeio.short(key)}: unknown layer kind {safeio.short(kind)}, "
                       f"expected one of {list(KINDS)}")
    fields = {}
    for tok in tokens:
        name, sep, value = tok.partition(":")
        if not sep or not name or name in fields:
            raise LUTError(f"table key {safeio.short(key)}: part {safeio.short(tok)} is not a unique "
                           "'name:value' field")
        fields[name] = value
    names = tuple(fields)
    wanted = ("input", "output") + (_BLOCK_FIELDS if kind == "expanded_conv" else ())
    if names not in (wanted, wanted + _OFA_FIELDS) or (kind != "expanded_conv" and names != wanted):
        raise LUTError(f"table key {safeio.short(key)}: fields {list(names)}, expected {list(wanted)}"
                       + (f" optionally followed by {list(_OFA_FIELDS)}" if kind == "expanded_conv" else ""))
    try:
        shapes = _shape(fields["input"]), _shape(fields["output"])
    except ValueError as e:
        raise LUTError(f"table key {safeio.short(key)}: {e}") from None
    ints = {}
    for name in names[2:]:
        v = fields[name]
        if not v.isdigit():
            raise LUTError(f"table key {safeio.short(key)}: field {name}:{safeio.short(v)} is not a "
                           "non-negative integer")
        ints[name] = int(v)
    for flag in ("idskip", "se", "hs"):
        if ints.get(flag, 0) not in (0, 1):
            raise LUTError(f"table key {safeio.short(key)}: field {flag} must be 0 or 1, got {ints[flag]}")
    for pos in ("expand", "kernel", "stride"):
        if pos in ints and ints[pos] < 1:
            raise LUTError(f"table key {safeio.short(key)}: field {pos} must be >= 1, got {ints[pos]}")
    return LayerKey(kind, *shapes, **ints)


def format_key(k: LayerKey) -> str:
    """The table key string of a LayerKey (inverse of parse_key)."""
    parts = [k.kind, "input:" + "x".join(map(str, k.input)), "output:" + "x".join(map(str, k.output))]
    for name in _BLOCK_FIELDS + _OFA_FIELDS:
        v = getattr(k, name)
        if v is not None:
            parts.append(f"{name}:{v}")
    return "-".join(parts)


def _check_stat(key: str, name: str, value, *, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = isinstance(value, int) and value >= 1
    if not ok or math.isnan(value) or math.isinf(value) or value < 0:
        want = "a positive integer" if integer else "a finite number >= 0 (ms)"
        raise LUTError(f"table entry {safeio.short(key)}: {name} is {safeio.short(value)}, expected {want}")


def lut_from_mapping(table: Mapping, source: str = "<mapping>") -> LatencyLUT:
    """Validates a loaded table {key: {mean, [count], [var|std]}} and returns a LatencyLUT."""
    if not isinstance(table, Mapping) or not table:
        raise LUTError(f"latency table {source}: expected a non-empty mapping of layer keys, "
                       f"got {type(table).__name__}")
    entries, keys, counts = {}, {}, {}
    for key, stats in table.items():
        parsed = parse_key(key)
        if not isinstance(stats, Mapping) or "mean" not in stats:
            raise LUTError(f"table entry {safeio.short(key)}: expected a mapping with a 'mean' latency in ms, "
                           f"got {safeio.short(stats)}")
        _check_stat(key, "mean", stats["mean"])
        for spread in ("var", "std"):
            if spread in stats:
                _check_stat(key, spread, stats[spread])
        if "count" in stats:
            _check_stat(key, "count", stats["count"], integer=True)
        entries[key], keys[key], counts[key] = float(stats["mean"]), parsed, stats.get("count")
    blocks = [k for k in keys.values() if k.kind == "expanded_conv"]
    ofa = {k.se is not None for k in blocks}
    if len(ofa) > 1:
        raise LUTError(f"latency table {source}: some expanded_conv keys have se/hs fields and some do not")
    flavor = "ofa" if ofa == {True} or any(k.kind in ("Conv_2", "AvgPool2D") for k in keys.values()) else "proxyless"
    return LatencyLUT(source, flavor, entries, keys, counts)


def load_lut(path: str | os.PathLike) -> LatencyLUT:
    """Reads a ProxylessNAS/OFA YAML latency table; raises LUTError naming any malformed entry."""
    path = os.fspath(path)
    try:
        table = safeio.load_yaml(safeio.read_bytes(path, "latency table"), f"latency table {path!r}")
    except ValueError as e:
        raise LUTError(str(e)) from None
    return lut_from_mapping(table, os.path.basename(path))


# ------------------------------------------------------------------------------ architectures -> keys

# OFA MobileNetV3 space (once-for-all, width 1.2): 5 stages of up to 4 blocks after a fixed 24->24 block.
OFA_WIDTHS = (32, 48, 96, 136, 192)
OFA_STRIDES = (2, 2, 2, 1, 2)
OFA_SE = (0, 1, 0, 1, 1)
OFA_HS = (0, 0, 1, 1, 1)
OFA_STEM, OFA_FINAL_EXPAND, OFA_FEATURE_MIX = 24, 1152, 1536


def _down(hw: int, stride: int) -> int:
    """Output size of a padded convolution: odd sizes round up when halved."""
    return (hw - 1) // stride + 1


def _int(what: str, value, minimum: int = 1) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= _MAX_INT
            or value != int(value)):
        raise LUTError(f"{what} is {safeio.short(value)}, expected an integer in [{minimum}, {_MAX_INT}]")
    return int(value)


def _field(d, name: str, where: str):
    if not isinstance(d, Mapping) or name not in d:
        raise LUTError(f"architecture: {where} lacks field {name!r}")
    return d[name]


def _block(hw: int, cin: int, cout: int, stride: int, **fields) -> tuple:
    out = _down(hw, stride)
    key = LayerKey("expanded_conv", (hw, hw, cin), (out, out, cout), stride=stride, **fields)
    return format_key(key), out


def net_config_layers(config: Mapping, image_size: int = 224) -> list:
    """(layer name, key) pairs of a ProxylessNAS or OFA MobileNetV3 ``net.config`` at ``image_size``.

    ZeroLayer blocks (skipped in the searched network) contain no computation and give no key.
    """
    size = _int("image size", image_size)
    first = _field(config, "first_conv", "net.config")
    stem_out = _int("first_conv.out_channels", _field(first, "out_channels", "first_conv"))
    hw = _down(size, _int("first_conv.stride", first.get("stride", 2)))
    layers = [("first_conv", format_key(LayerKey("Conv", (size, size, 3), (hw, hw, stem_out))))]
    ofa = "final_expand_layer" in config
    blocks = _field(config, "blocks", "net.config")
    if not isinstance(blocks, list):
        raise LUTError(f"architecture: net.config 'blocks' must be a list, got {type(blocks).__name__}")
    for i, blk in enumerate(blocks):
        where = f"blocks[{i}]"
        conv = blk.get("conv", blk.get("mobile_inverted_conv")) if isinstance(blk, Mapping) else None
        if not isinstance(conv, Mapping):
            raise LUTError(f"architecture: {where} lacks a 'mobile_inverted_conv' or 'conv' layer")
        for what, obj, known in (("block", blk, _BLOCK_NAMES), ("conv", conv, _CONV_NAMES)):
            if "name" in obj and obj["name"] not in known:
                raise LUTError(f"architecture: {where} {what} name {safeio.short(obj['name'])} is not a known "
                               f"layer; expected one of {list(known)}")
        if conv.get("name") == "ZeroLayer":
            continue
        cin = _int(f"{where} in_channels", _field(conv, "in_channels", where))
        cout = _int(f"{where} out_channels", _field(conv, "out_channels", where))
        k = _int(f"{where} kernel_size", _field(conv, "kernel_size", where))
        s = _int(f"{where} stride", _field(conv, "stride", where))
        e = _field(conv, "expand_ratio", where)
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e < _MAX_EXPAND:
            raise LUTError(f"architecture: {where} expand_ratio is {safeio.short(e)}, expected a positive number "
                           f"below {_MAX_EXPAND:g}")
        shortcut = blk.get("shortcut")
        if shortcut is not None and not isinstance(shortcut, Mapping):
            raise LUTError(f"architecture: {where} shortcut must be null or an object, got {safeio.short(shortcut)}")
        idskip = int(shortcut is not None and shortcut.get("name") != "ZeroLayer")
        if ofa:
            mid = conv.get("mid_channels") or round(cin * e)
            fields = dict(expand=_int(f"{where} mid_channels", mid), kernel=k, idskip=idskip,
                          se=int(bool(conv.get("use_se", False))), hs=int(conv.get("act_func") == "h_swish"))
        else:
            fields = dict(expand=_int(f"{where} expand_ratio", e), kernel=k, idskip=idskip)
        key, hw = _block(hw, cin, cout, s, **fields)
        layers.append((f"blocks.{i}", key))
    cls = _field(config, "classifier", "net.config")
    n_cls = _int("classifier.out_features", _field(cls, "out_features", "classifier"))
    mix = _field(config, "feature_mix_layer", "net.config")
    mix_in = _int("feature_mix_layer.in_channels", _field(mix, "in_channels", "feature_mix_layer"))
    mix_out = _int("feature_mix_layer.out_channels", _field(mix, "out_channels", "feature_mix_layer"))
    if not ofa:
        layers.append(("feature_mix_layer", format_key(LayerKey("Conv_1", (hw, hw, mix_in), (hw, hw, mix_out)))))
        layers.append(("classifier", format_key(LayerKey("Logits", (hw, hw, mix_out), (n_cls,)))))
        return layers
    fin = config["final_expand_layer"]
    f_in = _int("final_expand_layer.in_channels", _field(fin, "in_channels", "final_expand_layer"))
    f_out = _int("final_expand_layer.out_channels", _field(fin, "out_channels", "final_expand_layer"))
    return layers + _ofa_tail(hw, f_in, f_out, mix_out, n_cls)


def _ofa_tail(hw: int, f_in: int, f_out: int, mix_out: int, n_cls: int) -> list:
    return [("final_expand_layer", format_key(LayerKey("Conv_1", (hw, hw, f_in), (hw, hw, f_out)))),
            ("global_avg_pool", format_key(LayerKey("AvgPool2D", (hw, hw, f_out), (1, 1, f_out)))),
            ("feature_mix_layer", format_key(LayerKey("Conv_2", (1, 1, f_out), (1, 1, mix_out)))),
            ("classifier", format_key(LayerKey("Logits", (1, 1, mix_out), (n_cls,))))]


def ofa_spec_layers(spec: Mapping, image_size: int | None = None) -> list:
    """(layer name, key) pairs of an OFA MobileNetV3 arch {ks: [20], e: [20], d: [5], r: int or [int]}.

    Stage s runs its first d[s] blocks; block j of stage s uses ks[4s+j] and e[4s+j] (entries of blocks beyond
    the depth are ignored); middle channels are round(in_channels * e). ``image_size`` overrides ``r``.
    """
    for name, n in (("ks", 20), ("e", 20), ("d", 5)):
        v = _field(spec, name, "OFA arch")
        if not isinstance(v, list) or len(v) != n:
            raise LUTError(f"OFA arch field {name!r} must be a list of {n} numbers, got {safeio.short(v)}")
    r = image_size if image_size is not None else _field(spec, "r", "OFA arch (no --resolution given)")
    if isinstance(r, list):
        r = r[0] if len(r) == 1 else r
    size = _int("OFA arch resolution r", r)
    depths = [_int(f"OFA arch d[{s}]", d) for s, d in enumerate(spec["d"])]
    if max(depths) > 4:
        raise LUTError(f"OFA arch d = {depths}: each stage has at most 4 blocks")
    hw = _down(size, 2)
    layers = [("first_conv", format_key(LayerKey("Conv", (size, size, 3), (hw, hw, OFA_STEM))))]
    key, hw = _block(hw, OFA_STEM, OFA_STEM, 1, expand=OFA_STEM, kernel=3, idskip=1, se=0, hs=0)
    layers.append(("blocks.0", key))
    cin = OFA_STEM
    for s, depth in enumerate(depths):
        for j in range(depth):
            i = 4 * s + j
            k = _int(f"OFA arch ks[{i}]", spec["ks"][i])
            e = spec["e"][i]
            if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e < _MAX_EXPAND:
                raise LUTError(f"OFA arch e[{i}] is {safeio.short(e)}, expected a positive number below "
                               f"{_MAX_EXPAND:g}")
            stride = OFA_STRIDES[s] if j == 0 else 1
            key, hw = _block(hw, cin, OFA_WIDTHS[s], stride, expand=round(cin * e), kernel=k,
                             idskip=int(j > 0), se=OFA_SE[s], hs=OFA_HS[s])
            layers.append((f"stage{s + 1}.block{j + 1}", key))
            cin = OFA_WIDTHS[s]
    return layers + _ofa_tail(hw, cin, OFA_FINAL_EXPAND, OFA_FEATURE_MIX, 1000)


def arch_layers(arch: Mapping, image_size: int | None = None) -> list:
    """(layer name, key) pairs of a net.config (ProxylessNAS or OFA) or an OFA arch dict (ks/e/d/r)."""
    if not isinstance(arch, Mapping):
        raise LUTError(f"architecture must be a JSON object, got {type(arch).__name__}")
    if all(k in arch for k in ("ks", "e", "d")):
        return ofa_spec_layers(arch, image_size)
    if "blocks" in arch and "first_conv" in arch:
        size = image_size if image_size is not None else arch.get("resolution", arch.get("image_size", 224))
        return net_config_layers(arch, size)
    raise LUTError(f"architecture with fields {sorted(arch)} is neither a net.config (first_conv, blocks, ...) "
                   "nor an OFA arch (ks, e, d, r)")


def network_latency(lut: LatencyLUT, layers: list) -> NetLatency:
    """Sums the table means of (layer name, key) pairs; raises MissingKeysError listing every missing key."""
    missing = tuple((n, k) for n, k in layers if k not in lut.entries)
    if missing:
        flavors = {"ofa" if k.endswith(("-hs:0", "-hs:1")) else "proxyless"
                   for _, k in layers if k.startswith("expanded_conv")}
        hint = (f" (the table is a {lut.flavor} table but the architecture gives {flavors.pop()} keys)"
                if len(flavors) == 1 and lut.flavor not in flavors else "")
        lines = "\n".join(f"  {n}: {k}" for n, k in missing)
        raise MissingKeysError(f"{len(missing)} layer key(s) missing from latency table {lut.source}{hint}:\n"
                               f"{lines}", missing)
    per_layer = {n: lut.entries[k] for n, k in layers}
    return NetLatency(float(sum(per_layer.values())), per_layer, dict(layers))
