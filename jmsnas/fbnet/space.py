"""The FBNet search space as HW-NAS-Bench defines it for CIFAR-100 (Li et al., ICLR 2021; FBNet, Wu et al. 2019).

Macro-architecture (input 32 x 32 x 3): a 3 x 3 stem 3 -> 16 (stride 1), then 22 searchable layers in 7 stages of
[1, 4, 4, 4, 4, 4, 1] layers with out channels [16, 24, 32, 64, 112, 184, 352] and first-layer strides
[1, 1, 2, 2, 1, 2, 1] (the stage's other layers have stride 1), a 1 x 1 head convolution to 1504 channels, global
average pooling and a fully connected classifier to 100 classes.

Candidates of every layer (op index -> name, the order of HELP's and HW-NAS-Bench's data): 0 k3_e1, 1 k3_e1_g2,
2 k3_e3, 3 k3_e6, 4 k5_e1, 5 k5_e1_g2, 6 k5_e3, 7 k5_e6, 8 skip. kK_eE is FBNet's inverted-residual block: 1 x 1
convolution C -> E*C, K x K depthwise (the layer's stride), 1 x 1 convolution E*C -> C', with batch norm, ReLU after
the first two, and the input added when the shape is kept; g2 splits both 1 x 1 convolutions into 2 groups with a
channel shuffle between them. ``skip`` is the identity where the shape is kept, else a 1 x 1 convolution (stride)
+ batch norm + ReLU (FBNet's ``Identity``), so every candidate applies to every layer.
"""
from __future__ import annotations

import re
from typing import NamedTuple


class Block(NamedTuple):
    """A candidate: depthwise kernel (0 for skip), expansion ratio (0 for skip), groups of the 1 x 1 convolutions."""

    name: str
    kernel: int
    expand: int
    groups: int

    @property
    def is_skip(self) -> bool:
        return self.kernel == 0


def _block(name: str) -> Block:
    if name == "skip":
        return Block(name, 0, 0, 1)
    m = re.fullmatch(r"k(\d)_e(\d)(?:_g(\d))?", name)
    return Block(name, int(m.group(1)), int(m.group(2)), int(m.group(3) or 1))


OP_NAMES = ("k3_e1", "k3_e1_g2", "k3_e3", "k3_e6", "k5_e1", "k5_e1_g2", "k5_e3", "k5_e6", "skip")


class Layer(NamedTuple):
    """One searchable layer: its shapes (NHWC per image) and stride."""

    index: int
    in_ch: int
    out_ch: int
    in_hw: int
    out_hw: int
    stride: int

    @property
    def keeps_shape(self) -> bool:
        return self.stride == 1 and self.in_ch == self.out_ch


class FBNetSpace(NamedTuple):
    """The macro-architecture (hashable: a jit static argument). ``width`` multiplies every channel count (1.0 is
    the published space; smaller widths give the same layer/op structure for quick tests)."""

    name: str = "fbnet_c100"
    image_size: int = 32
    in_channels: int = 3
    num_classes: int = 100
    stem_channels: int = 16
    stage_layers: tuple = (1, 4, 4, 4, 4, 4, 1)
    stage_channels: tuple = (16, 24, 32, 64, 112, 184, 352)
    stage_strides: tuple = (1, 1, 2, 2, 1, 2, 1)
    head_channels: int = 1504

    @property
    def op_names(self) -> tuple:
        return OP_NAMES

    @property
    def blocks(self) -> tuple:
        return tuple(_block(n) for n in OP_NAMES)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def layers(self) -> tuple:
        out, hw, ch = [], self.image_size, self.stem_channels
        for n_layers, c, st in zip(self.stage_layers, self.stage_channels, self.stage_strides):
            for j in range(n_layers):
                s = st if j == 0 else 1
                o = -(-hw // s)
                out.append(Layer(len(out), ch, c, hw, o, s))
                hw, ch = o, c
        return tuple(out)


def fbnet_c100() -> FBNetSpace:
    """HW-NAS-Bench's FBNet space for CIFAR-100 (the space of HELP's FBNet data)."""
    return FBNetSpace()


def scaled(space: FBNetSpace, *, width: float = 1.0, image_size: int | None = None, in_channels: int | None = None,
           num_classes: int | None = None, name: str | None = None) -> FBNetSpace:
    """The same 22-layer structure at ``width`` times the channels (at least 2 each, even: g2 splits them) and
    another input/class count: for data other than CIFAR-100 and for quick tests. It keeps the space's name (so
    the published space's latency tables, which depend only on the layer and op indices, still apply: they give
    the published network's latency, not the scaled one's) unless ``name`` is given."""
    if not 0 < width <= 4:
        raise ValueError(f"width must be in (0, 4], got {width!r}")
    even = lambda c: max(2, 2 * round(c * width / 2))
    return space._replace(
        name=name or space.name,
        image_size=image_size or space.image_size, in_channels=in_channels or space.in_channels,
        num_classes=num_classes or space.num_classes, stem_channels=even(space.stem_channels),
        stage_channels=tuple(even(c) for c in space.stage_channels), head_channels=even(space.head_channels))


def block_flops(block: Block, layer: Layer) -> float:
    """Floating-point operations (2 per multiply-add) of ``block`` on ``layer`` per image (convolutions only)."""
    if block.is_skip:
        return 0.0 if layer.keeps_shape else 2.0 * layer.out_hw ** 2 * layer.in_ch * layer.out_ch
    mid = layer.in_ch * block.expand
    return 2.0 * (layer.in_hw ** 2 * layer.in_ch * mid / block.groups + layer.out_hw ** 2 * mid * block.kernel ** 2
                  + layer.out_hw ** 2 * mid * layer.out_ch / block.groups)
