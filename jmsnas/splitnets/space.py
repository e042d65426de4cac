"""The split-aware search space (SplitNets, paper 000, section 3.1.1 and Fig. 3).

The network is a stem followed by P phases. Phase p has ``max_depth`` block slots: slot 0 changes the shape
(stride ``phase_strides[p]``, ``phase_channels[p]`` channels; the paper's one stride-2 block per phase), the other
slots keep it and have a shortcut. Each phase owns one candidate split module (``module``) that can sit after any
of its active blocks. An architecture chooses, as integer genes (``SplitSpace.mask`` gives their valid values):

* ``ops``: the MBConv (kernel, expansion) of every slot, P * max_depth genes;
* ``depth``: how many slots of each phase run (1 .. max_depth; slot 0 always runs), P genes;
* ``split_phase`` and ``split_offset``: the split module sits in phase p after its m-th active block
  (m = offset + 1, clamped to the phase's depth): M blocks run on the sensor, the K others on the aggregator;
* ``reduction``: d = c_p // r for r in ``reductions`` (the module sends d of the c_p channels).

Exactly one split module is selected by a searched network (the split phase's). During supernet training a
single-view network may carry more (``extras``: one flag per phase, Appendix D's extra modules).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import numpy as np

from jmsnas.splitnets.module import check_reduction


class SplitArch(NamedTuple):
    """A decoded architecture (plain Python values).

    ops: per phase, per slot, the (kernel, expansion) index into ``SplitSpace.op_choices``;
    depth: active slots per phase; split: (phase, m) with 1 <= m <= depth[phase]; d: channels sent.
    """

    ops: tuple
    depth: tuple
    split: tuple
    d: int


@dataclasses.dataclass(frozen=True)
class SplitSpace:
    """Static, hashable description of a split-aware supernet (safe as a jit static argument)."""

    image_size: int  # H == W of one view, pixels
    in_channels: int
    num_classes: int
    views: int  # V sensors, one view each
    stem_channels: int = 8
    phase_channels: tuple = (16, 24, 32)
    phase_strides: tuple = (1, 2, 2)
    max_depth: int = 3
    kernels: tuple = (3, 5)
    expands: tuple = (3, 6)
    reductions: tuple = (2, 4, 8)
    split_kernel: int = 1
    head_channels: int = 64
    share_weights: bool | None = None  # sensor and aggregator blocks share weights; None: only for views == 1

    def __post_init__(self):
        validate_space(self)

    @property
    def shared(self) -> bool:
        return self.views == 1 if self.share_weights is None else bool(self.share_weights)

    @property
    def num_phases(self) -> int:
        return len(self.phase_channels)

    @property
    def op_choices(self) -> tuple:
        return tuple(itertools.product(self.kernels, self.expands))

    @property
    def kmax(self) -> int:
        return max(self.kernels)

    @property
    def emax(self) -> int:
        return max(self.expands)

    def d_choices(self, p: int) -> tuple:
        return tuple(self.phase_channels[p] // r for r in self.reductions)

    def d_max(self, p: int) -> int:
        return max(self.d_choices(p))

    def phase_hw(self, p: int) -> int:
        """Spatial size (pixels) of phase p's feature maps."""
        hw = self.image_size
        for s in self.phase_strides[:p + 1]:
            hw = -(-hw // s)
        return hw

    def slot(self, p: int, b: int) -> tuple:
        """(in_ch, out_ch, in_hw, out_hw, stride) of slot b of phase p."""
        c_out = self.phase_channels[p]
        if b == 0:
            c_in = self.stem_channels if p == 0 else self.phase_channels[p - 1]
            in_hw = self.image_size if p == 0 else self.phase_hw(p - 1)
            return c_in, c_out, in_hw, self.phase_hw(p), self.phase_strides[p]
        return c_out, c_out, self.phase_hw(p), self.phase_hw(p), 1

    def residual(self, p: int, b: int) -> bool:
        c_in, c_out, _, _, stride = self.slot(p, b)
        return stride == 1 and c_in == c_out

    def op_name(self, p: int, b: int, o: int) -> str:
        k, e = self.op_choices[o]
        return f"mbconv_k{k}_e{e}" + ("_res" if self.residual(p, b) else "")

    # ------------------------------------------------------------------------------------------- genes

    @property
    def num_slots(self) -> int:
        return self.num_phases * self.max_depth

    @property
    def num_genes(self) -> int:
        return self.num_slots + self.num_phases + 3

    @property
    def positions(self) -> tuple:
        """Every split position (phase, m) in execution order; index = phase * max_depth + m - 1."""
        return tuple((p, m) for p in range(self.num_phases) for m in range(1, self.max_depth + 1))

    def mask(self) -> np.ndarray:
        """bool[G, R]: the valid values of every gene (see the module docstring for the layout)."""
        sizes = ([len(self.op_choices)] * self.num_slots + [self.max_depth] * self.num_phases
                 + [self.num_phases, self.max_depth, len(self.reductions)])
        m = np.zeros((self.num_genes, max(sizes)), bool)
        for g, n in enumerate(sizes):
            m[g, :n] = True
        return m

    def decode(self, genes) -> SplitArch:
        """The architecture of a gene vector int[G] (the split offset clamped to the phase's depth)."""
        g = [int(v) for v in np.asarray(genes).reshape(-1)]
        mask = self.mask()
        if len(g) != self.num_genes or not all(0 <= v < mask.shape[1] and mask[i, v] for i, v in enumerate(g)):
            raise ValueError(f"genes {g} are not a valid architecture of this space ({self.num_genes} genes, "
                             "values within SplitSpace.mask())")
        P, D = self.num_phases, self.max_depth
        ops = tuple(tuple(g[p * D + b] for b in range(D)) for p in range(P))
        depth = tuple(1 + v for v in g[P * D:P * D + P])
        sp, off, r = g[P * D + P:]
        return SplitArch(ops, depth, (sp, min(off + 1, depth[sp])), self.d_choices(sp)[r])

    def encode(self, arch: SplitArch) -> np.ndarray:
        """int32[G] genes of a decoded architecture (inverse of ``decode`` on canonical architectures)."""
        p, m = arch.split
        g = [o for ph in arch.ops for o in ph] + [dd - 1 for dd in arch.depth]
        g += [p, m - 1, self.d_choices(p).index(arch.d)]
        return np.asarray(g, np.int32)

    def extreme(self, largest: bool) -> np.ndarray:
        """Genes of the largest (widest ops, full depth, split last, largest d) or smallest network."""
        cost = lambda o: self.op_choices[o][0] ** 2 * self.op_choices[o][1]
        order = sorted(range(len(self.op_choices)), key=cost)
        o = order[-1] if largest else order[0]
        P, D = self.num_phases, self.max_depth
        r = int(np.argmin(self.reductions)) if largest else int(np.argmax(self.reductions))
        g = [o] * (P * D) + [D - 1 if largest else 0] * P + [P - 1 if largest else 0, D - 1 if largest else 0, r]
        return np.asarray(g, np.int32)


def validate_space(s: SplitSpace) -> None:
    """Raises ValueError naming the first bad field (V < 1, d >= c, ...)."""
    for what in ("image_size", "in_channels", "num_classes", "views", "stem_channels", "max_depth",
                 "split_kernel", "head_channels"):
        v = getattr(s, what)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
    if not s.phase_channels or len(s.phase_channels) != len(s.phase_strides):
        raise ValueError(f"phase_channels {s.phase_channels} and phase_strides {s.phase_strides} must be non-empty "
                         "and of equal length (one entry per phase)")
    for what, seq, ok in (("phase_strides", s.phase_strides, lambda v: v in (1, 2)),
                          ("kernels", s.kernels, lambda v: v in (3, 5, 7)),
                          ("expands", s.expands, lambda v: v in (3, 6)),
                          ("phase_channels", s.phase_channels, lambda v: isinstance(v, int) and v >= 2),
                          ("reductions", s.reductions, lambda v: isinstance(v, int) and not isinstance(v, bool))):
        if not seq or not all(ok(v) for v in seq):
            raise ValueError(f"{what} has a bad entry: {seq!r}")
    if len(set(s.reductions)) != len(s.reductions):
        raise ValueError(f"reductions must be distinct, got {s.reductions!r}")
    for p, c in enumerate(s.phase_channels):
        for r in s.reductions:
            check_reduction(c, c // r if r >= 1 else c, where=f"phase {p} (c = {c}) with reduction {r}")
