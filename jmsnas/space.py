"""The search space built from a topology (paper 003, sections III-C and IV-A).

Each device m runs D^m layer slots. A slot has a fixed input/output shape and stride; its candidates are the
13 operations of section IV-A (MBConv with kernel 3/5/7 and expansion 3/6, each with or without shortcut, and
identity). Candidates that cannot apply to a slot (identity or shortcut where the shape changes) are masked.

Shapes change only at the first layer of a device: ``device_channels[m]`` and ``device_strides[m]`` give the
output channels and stride of that layer; the device's other layers keep the shape. In a mesh, each branch
device runs its own sub-network on the root's output and the aggregator averages the branch outputs (a mean
keeps the aggregator's input shape and scale independent of the number of branches; a concatenation would
make the aggregator's width, and so its cost, grow with every added branch).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from jmsnas import topology as T
from jmsnas.topology import Topology, TopologyError


class OpSpec(NamedTuple):
    """A candidate operation: an MBConv (kernel, expansion, with/without shortcut) or identity."""

    name: str
    kernel: int  # 0 for identity
    expand: int  # 0 for identity
    residual: bool

    @property
    def is_identity(self) -> bool:
        return self.kernel == 0


OPS: tuple = tuple(
    OpSpec(f"mbconv_k{k}_e{e}" + ("_res" if r else ""), k, e, r)
    for k, e, r in itertools.product((3, 5, 7), (3, 6), (False, True))
) + (OpSpec("identity", 0, 0, False),)
OP_NAMES: tuple = tuple(o.name for o in OPS)
NUM_OPS: int = len(OPS)
IDENTITY: int = OP_NAMES.index("identity")


def op_index(name: str) -> int:
    """Index of a candidate op by name, with a clear error for unknown names."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown op {name!r}; expected one of {list(OP_NAMES)}")
    return OP_NAMES.index(name)


class LayerSlot(NamedTuple):
    """One searchable layer: where it runs and its fixed shapes (NHWC, per image)."""

    index: int
    device: int  # index into topology.devices
    branch: int  # position in topology.branches, or -1 outside the tree part
    in_ch: int
    out_ch: int
    in_hw: int
    out_hw: int
    stride: int

    @property
    def keeps_shape(self) -> bool:
        return self.stride == 1 and self.in_ch == self.out_ch

    @property
    def out_elems(self) -> int:
        return self.out_hw * self.out_hw * self.out_ch


class Arch(NamedTuple):
    """A discrete architecture: the candidate index of every layer, int32[N] (a pytree, so vmap-able)."""

    ops: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Static, hashable description of the supernet (safe as a jit static argument)."""

    topology: Topology
    layers: tuple
    image_size: int
    in_channels: int
    num_classes: int
    stem_channels: int
    stem_stride: int
    head_channels: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def op_names(self) -> tuple:
        return OP_NAMES

    @property
    def stem_out_hw(self) -> int:
        return _out_hw(self.image_size, self.stem_stride)

    @property
    def head_in(self) -> tuple:
        last = self.layers[-1]
        return last.out_hw, last.out_ch

    def mask(self) -> np.ndarray:
        """bool[N, R]: which candidates apply to each slot."""
        m = np.ones((self.num_layers, NUM_OPS), dtype=bool)
        for s in self.layers:
            if not s.keeps_shape:
                for i, o in enumerate(OPS):
                    if o.is_identity or o.residual:
                        m[s.index, i] = False
        return m

    def layer_devices(self) -> np.ndarray:
        """int32[N]: the device index of every layer slot."""
        return np.array([s.device for s in self.layers], dtype=np.int32)

    def layers_of(self, device: int) -> tuple:
        return tuple(s.index for s in self.layers if s.device == device)

    def input_of(self, n: int) -> tuple:
        """Indices of the layers whose outputs feed layer n (-1 means the stem; several means a mean)."""
        topo = self.topology
        s = self.layers[n]
        if topo.kind == "mesh":
            if s.branch >= 0 and n == self.layers_of(s.device)[0]:
                return (self.layers_of(topo.root)[-1],)
            if s.device == topo.post[0] and n == self.layers_of(s.device)[0]:
                return tuple(self.layers_of(b)[-1] for b in topo.branches)
        return (n - 1,)

    def validate_arch(self, ops: Sequence[int]) -> None:
        """Raises ValueError if ``ops`` has the wrong length or picks a masked candidate."""
        ops = np.asarray(ops)
        if ops.shape != (self.num_layers,):
            raise ValueError(f"architecture has shape {ops.shape}, expected ({self.num_layers},)")
        mask = self.mask()
        for n, i in enumerate(ops.tolist()):
            if not 0 <= i < NUM_OPS or not mask[n, i]:
                raise ValueError(f"layer {n}: op index {i} is not a valid candidate; allowed "
                                 f"{[OP_NAMES[j] for j in np.flatnonzero(mask[n])]}")


def _out_hw(hw: int, stride: int) -> int:
    return -(-hw // stride)  # SAME padding


def build_space(topology: Topology, *, image_size: int, in_channels: int, num_classes: int,
                device_channels: Sequence[int], device_strides: Sequence[int], stem_channels: int = 16,
                stem_stride: int = 1, head_channels: int = 128) -> SearchSpace:
    """Lays out the layer slots of ``topology`` (D^m per device) with the per-device shape schedule."""
    m = topology.num_devices
    names = topology.device_names
    for what, seq in (("device_channels", device_channels), ("device_strides", device_strides)):
        if len(seq) != m:
            raise TopologyError(f"{what} has {len(seq)} entries {list(seq)}, expected one per device {list(names)}")
    for d, c, st in zip(names, device_channels, device_strides):
        if not isinstance(c, (int, np.integer)) or c < 1:
            raise ValueError(f"device_channels for {d!r} must be a positive integer, got {c!r}")
        if st not in (1, 2):
            raise ValueError(f"device_strides for {d!r} must be 1 or 2, got {st!r}")
    for what, v in (("image_size", image_size), ("in_channels", in_channels), ("num_classes", num_classes),
                    ("stem_channels", stem_channels), ("head_channels", head_channels)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    if stem_stride not in (1, 2):
        raise ValueError(f"stem_stride must be 1 or 2, got {stem_stride!r}")
    if topology.kind == "mesh":
        shapes = {(device_channels[b], device_strides[b]) for b in topology.branches}
        if len(shapes) != 1:
            raise ValueError(f"mesh branches {[names[b] for b in topology.branches]} must share channels and "
                             f"stride so their outputs can be averaged, got {sorted(shapes)}")

    layers = []
    hw, ch = _out_hw(image_size, stem_stride), stem_channels

    def add_device(dev, branch, hw, ch):
        for j in range(topology.layers_per_device[dev]):
            stride = device_strides[dev] if j == 0 else 1
            out_ch = device_channels[dev] if j == 0 else ch
            out_hw = _out_hw(hw, stride)
            layers.append(LayerSlot(len(layers), dev, branch, ch, out_ch, hw, out_hw, stride))
            hw, ch = out_hw, out_ch
        return hw, ch

    for dev in topology.pre:
        hw, ch = add_device(dev, -1, hw, ch)
    if topology.kind == "mesh":
        hw, ch = add_device(topology.root, -1, hw, ch)
        outs = [add_device(b, k, hw, ch) for k, b in enumerate(topology.branches)]
        hw, ch = outs[0]
        for dev in topology.post:
            hw, ch = add_device(dev, -1, hw, ch)
    return SearchSpace(topology, tuple(layers), image_size, in_channels, num_classes, stem_channels,
                       stem_stride, head_channels)


_SCALARS = ("image_size", "in_channels", "num_classes", "stem_channels", "stem_stride", "head_channels")
_FIELDS = ("topology", *_SCALARS, "device_channels", "device_strides")


def to_dict(space: SearchSpace) -> dict:
    """The space as plain JSON data, the one serialisation of a space (result.json's ``space``, a parts
    manifest's ``space``): its topology in the topology-file format (``topology.to_dict``, every field explicit)
    and the arguments of ``build_space`` that lay out its slots. ``from_dict(to_dict(s)) == s``."""
    firsts = [space.layers[space.layers_of(d)[0]] for d in range(space.topology.num_devices)]
    return {"topology": T.to_dict(space.topology), **{k: int(getattr(space, k)) for k in _SCALARS},
            "device_channels": [int(s.out_ch) for s in firsts], "device_strides": [int(s.stride) for s in firsts]}


def from_dict(d, source: str = "the recorded space") -> SearchSpace:
    """The SearchSpace of ``to_dict``'s data, validated again (``topology.from_dict``, ``build_space``); a
    ValueError (TopologyError for the topology) names ``source`` and what is missing or bad."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: must be a mapping with {list(_FIELDS)}, got {type(d).__name__}")
    missing = [k for k in _FIELDS if k not in d]
    if missing:
        raise ValueError(f"{source}: lacks {missing}")
    topo = T.from_dict(d["topology"], f"{source}: topology")
    try:
        return build_space(topo, **{k: d[k] for k in _SCALARS}, device_channels=tuple(d["device_channels"]),
                           device_strides=tuple(d["device_strides"]))
    except TopologyError:
        raise
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def op_flops(op: OpSpec, s: LayerSlot) -> float:
    """Floating-point operations (2 per multiply-add) of candidate ``op`` at slot ``s``, per image."""
    if op.is_identity:
        return 0.0
    mid = s.in_ch * op.expand
    expand = 2.0 * s.in_hw * s.in_hw * s.in_ch * mid
    depthwise = 2.0 * s.out_hw * s.out_hw * mid * op.kernel * op.kernel
    project = 2.0 * s.out_hw * s.out_hw * mid * s.out_ch
    return expand + depthwise + project


def op_params(op: OpSpec, s: LayerSlot) -> int:
    """Parameters of candidate ``op`` at slot ``s`` (convolution weights and batch-norm scale/bias)."""
    if op.is_identity:
        return 0
    mid = s.in_ch * op.expand
    return s.in_ch * mid + mid * op.kernel * op.kernel + mid * s.out_ch + 2 * (mid + mid + s.out_ch)


def op_memory_bytes(op: OpSpec, s: LayerSlot, bytes_per_elem: int = 4) -> float:
    """Memory traffic of ``op`` at slot ``s`` per image: weights plus the activations read and written, in bytes."""
    if op.is_identity:
        return 0.0
    mid = s.in_ch * op.expand
    acts = s.in_hw ** 2 * s.in_ch + s.in_hw ** 2 * mid * 2 + s.out_hw ** 2 * mid * 2 + s.out_hw ** 2 * s.out_ch
    return float(bytes_per_elem * (acts + op_params(op, s)))


def device_stages(topology: Topology) -> tuple:
    """int per device: its depth stage along the network (mesh branches share one stage, as do star sources)."""
    stage = [0] * topology.num_devices
    if topology.kind == "chain":
        order = [[d] for d in topology.pre]
    elif topology.kind == "mesh":
        order = [[d] for d in topology.pre] + [[topology.root], list(topology.branches)] + [[d] for d in topology.post]
    else:  # star: the sources, then the aggregator's chain
        order = [list(topology.branches)] + [[d] for d in topology.post]
    for s, devs in enumerate(order):
        for d in devs:
            stage[d] = s
    return tuple(stage)


def adapt_schedule(topology: Topology, device_channels: Sequence[int], device_strides: Sequence[int]) -> tuple:
    """(channels, strides) with one entry per device of ``topology``, resampled from a template schedule.

    Given one entry per device, the template is returned unchanged. Otherwise the template is read as a
    schedule over depth: each device's stage (``device_stages``) is placed at the same relative depth in the
    template; its width is interpolated linearly there and rounded, and each of the template's stride-2 steps is
    kept at its relative depth (at most one per stage, so the total downsampling is the template's while there
    are enough stages). E.g. (24, 32, 48, 64) / (1, 2, 1, 2) on a 3-device chain gives (24, 40, 64) / (1, 2, 2).
    """
    m = topology.num_devices
    if len(device_channels) == m and len(device_strides) == m:
        return tuple(device_channels), tuple(device_strides)
    if not device_channels or len(device_channels) != len(device_strides):
        raise ValueError(f"device_channels {list(device_channels)} and device_strides {list(device_strides)} must "
                         "be non-empty and of equal length to serve as a template")
    stages = device_stages(topology)
    n_st, n_t = max(stages) + 1, len(device_channels)
    pos = lambda s: s * (n_t - 1) / (n_st - 1) if n_st > 1 else 0.0
    widths = []
    for s in range(n_st):
        j = pos(s)
        lo, hi = int(math.floor(j)), int(math.ceil(j))
        widths.append(max(1, int(math.floor(device_channels[lo] + (j - lo) * (device_channels[hi] - device_channels[lo])
                                            + 0.5))))
    taken = set()
    for j, st in enumerate(device_strides):
        if st != 2:
            continue
        want = int(math.floor(j * (n_st - 1) / (n_t - 1) + 0.5)) if n_t > 1 else 0
        free = sorted((s for s in range(n_st) if s not in taken), key=lambda s: (abs(s - want), -s))
        if free:
            taken.add(free[0])
    strides = [2 if s in taken else 1 for s in range(n_st)]
    return tuple(widths[stages[d]] for d in range(m)), tuple(strides[stages[d]] for d in range(m))
