"""Networks as layer specs: a DAG of layers with their operations, parameters and output sizes.

This is the common currency of the model zoo, the roofline cost model, peak-memory accounting and the split
solvers. Layers are listed in a topological order; ``inputs`` names the producer layers by index (an empty
tuple means the network input), so skip connections are explicit edges.
"""
from __future__ import annotations

import math
from typing import NamedTuple


class LayerSpec(NamedTuple):
    """One layer of a network, per image (batch 1).

    Attributes:
      name: unique layer name.
      kind: operation kind, e.g. "conv", "dwconv", "fc", "pool", "add", "se", "act".
      macs: multiply-accumulate operations.
      params: number of parameters.
      out_shape: output shape without the batch dimension, e.g. (H, W, C) or (C,).
      inputs: indices of the producer layers; () for the network input.
    """

    name: str
    kind: str
    macs: int
    params: int
    out_shape: tuple
    inputs: tuple = ()

    @property
    def out_elems(self) -> int:
        return int(math.prod(self.out_shape))


class NetSpec(NamedTuple):
    """A network as a topologically ordered tuple of LayerSpecs."""

    name: str
    input_shape: tuple
    layers: tuple

    @property
    def total_macs(self) -> int:
        return sum(l.macs for l in self.layers)

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def input_elems(self) -> int:
        return int(math.prod(self.input_shape))

    def edges(self) -> list:
        """(producer, consumer) pairs; producer -1 is the network input."""
        return [(p, i) for i, l in enumerate(self.layers) for p in (l.inputs or (-1,))]

    def validate(self) -> None:
        names = [l.name for l in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"net {self.name!r} has duplicate layer names")
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ValueError(f"net {self.name!r} input_shape {self.input_shape} must hold positive sizes")
        for i, l in enumerate(self.layers):
            _check_counts(self.name, i, l)
            for p in l.inputs:
                if not (0 <= p < i):
                    raise ValueError(f"net {self.name!r} layer {l.name!r} (index {i}) has input {p}, "
                                     "expected an earlier layer index")


def _check_counts(net: str, i: int, l: LayerSpec) -> None:
    """ValueError naming the layer whose macs / params are negative or whose out_shape is not positive."""
    for field in ("macs", "params"):
        if getattr(l, field) < 0:
            raise ValueError(f"net {net!r} layer {l.name!r} (index {i}) has {field}={getattr(l, field)}, "
                             "expected a count >= 0")
    if not l.out_shape or any(d < 1 for d in l.out_shape):
        raise ValueError(f"net {net!r} layer {l.name!r} (index {i}) has out_shape {l.out_shape}, expected "
                         "positive sizes")
