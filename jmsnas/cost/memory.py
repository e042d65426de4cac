"""Peak memory of the part of a network placed on one device (Auto-Split, paper 001, section 3.2).

Memory = weights ("read-only" memory: every parameter of the part, stored at ``weight_bits``) plus the largest
activation working set ("read-write" memory) while the part runs, at ``act_bits``. The working set is taken on
the DAG, not just the chain: the part's layers run in ascending index order and, while layer j runs, every
tensor produced earlier and still needed later is alive, together with j's inputs and its output. So a skip
connection keeps its tensor alive across the layers it jumps over.

Lifetimes, in steps of the part's execution order:

* a tensor produced on the device lives from its producer's step to its last local consumer's step; if it must
  leave the device (a consumer runs elsewhere, or it is a network output) it is sent when the part finishes, so
  it lives until the last step;
* a tensor received from another device (or the network input) is present from the first step until its last
  local consumer ran.

Sizes are packed per tensor: ceil(elements * bits / 8) bytes (sub-byte activations packed, as in Auto-Split).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from jmsnas.graph import NetSpec

NET_INPUT = -1  # tensor id of the network input; layer j's output has id j


class MemoryReport(NamedTuple):
    """Peak memory of a part, in bytes.

    Attributes:
      weight_bytes: parameters of the part at the weight bit width.
      activation_bytes: the largest activation working set.
      peak_layer: index of the layer running when the working set peaks (-1 for an empty part).
      live: ids of the tensors alive at the peak (-1 = network input, j = output of layer j).
    """

    weight_bytes: int
    activation_bytes: int
    peak_layer: int
    live: tuple

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


def _packed(elems: int, bits: int) -> int:
    return -(-elems * bits // 8)


def _check(net: NetSpec, layer_indices: Sequence[int], weight_bits, act_bits) -> tuple:
    for what, b in (("weight_bits", weight_bits), ("act_bits", act_bits)):
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 64:
            raise ValueError(f"{what} must be an integer number of bits in [1, 64], got {b!r}")
    n = len(net.layers)
    idx = list(layer_indices)
    bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} are not layers of net {net.name!r} (expected integers in [0, {n}))")
    dup = sorted({i for i in idx if idx.count(i) > 1})
    if dup:
        raise ValueError(f"layer indices {dup} are listed more than once")
    return tuple(sorted(idx))


def memory_report(net: NetSpec, layer_indices: Sequence[int], weight_bits: int = 32,
                  act_bits: int = 32) -> MemoryReport:
    """Weights and peak activation working set of layers ``layer_indices`` of ``net`` run on one device."""
    part = _check(net, layer_indices, weight_bits, act_bits)
    weights = sum(_packed(net.layers[j].params, weight_bits) for j in part)
    if not part:
        return MemoryReport(0, 0, -1, ())
    step = {j: s for s, j in enumerate(part)}
    last = len(part) - 1
    consumers = {}
    for j, layer in enumerate(net.layers):
        for t in layer.inputs or (NET_INPUT,):
            consumers.setdefault(t, []).append(j)
    span = {}  # tensor id -> (first step, last step)
    for j in part:
        local = [step[c] for c in consumers.get(j, ()) if c in step]
        leaves = len(local) < len(consumers.get(j, ()))
        span[j] = (step[j], last if leaves or j not in consumers else max(local, default=step[j]))
        for t in net.layers[j].inputs or (NET_INPUT,):
            if t not in step:
                span[t] = (0, max(span.get(t, (0, 0))[1], step[j]))
    size = {t: _packed(net.input_elems if t == NET_INPUT else net.layers[t].out_elems, act_bits) for t in span}
    best, best_s = -1, 0
    for s in range(len(part)):
        total = sum(size[t] for t, (a, b) in span.items() if a <= s <= b)
        if total > best:
            best, best_s = total, s
    live = tuple(sorted(t for t, (a, b) in span.items() if a <= best_s <= b))
    return MemoryReport(weights, best, part[best_s], live)


def peak_memory_bytes(net: NetSpec, layer_indices: Sequence[int], weight_bits: int = 32,
                      act_bits: int = 32) -> int:
    """Weights plus the peak activation working set, in bytes, of ``layer_indices`` run on one device."""
    return memory_report(net, layer_indices, weight_bits, act_bits).total_bytes

