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

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.graph import NetSpec
from jmsnas.space import OPS, op_params

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



# ------------------------------------------------------------------------------------------------------------
# The searched networks (jmsnas.space): memory of every device, for one architecture or in expectation.
#
# M_m = W_m + B_m + max_{k in steps(m)} A_k  (bytes, one inference of one image), where
#   W_m: the parameters the device stores (its layers' chosen candidates, the stem on the first device and the
#        head on the last; convolution weights, BN scale/bias and BN running mean/variance, as in parts/<m>.npz);
#   B_m: its link buffers: the bytes of every tensor it receives (the camera image on the first device) and of
#        every tensor it sends, each held in a buffer of its own for the whole inference;
#   A_k: the working set of step k (a layer, the stem or the head): the live activations while it runs. An MBConv
#        of input x (in elements), expanded tensor e1 (in_hw^2 * mid), depthwise output e2 (out_hw^2 * mid) and
#        output y runs three convolutions; BN and ReLU6 work in place, and x stays alive to the end only when the
#        candidate has a shortcut (the skip tensor): A = max(x + e1, r x + e1 + e2, r x + e2 + y), r = 1 with a
#        shortcut, else 0. Identity: A = x (its output is its input). Stem: image + its output. Head: max(x + h,
#        h + pooled, pooled + logits), h the 1x1 convolution's output.
# Consecutive layers on a device hand their tensor on (layer n's output is layer n+1's input, counted in both
# A's but never alive twice), so the device's activation peak is the largest A_k.
#
# In expectation under the architecture distribution (independent layers, p_n = softmax(alpha_n) over the valid
# candidates): E[W_m] is linear in p, B_m does not depend on the ops, and the largest working set is a maximum of
# independent discrete variables, computed exactly from its distribution function:
#   E[max_k A_k] = sum_j (v_j - v_{j-1}) (1 - F(v_{j-1})),  F(v) = prod_{k on m} P(A_k <= v),  v_0 = 0,
# over the sorted distinct values v_j of the table: a polynomial in p, so differentiable like E[T], and equal to
# the enumeration over all architectures (tests).
# ------------------------------------------------------------------------------------------------------------


class SpaceMemory(NamedTuple):
    """Per-candidate memory of a search space, in bytes (a pytree of arrays).

    Attributes:
      weight_bytes: float32[N, R]: stored parameters of candidate i at slot n (0 where masked or identity).
      act_bytes: float32[N, R]: working set A of candidate i at slot n.
      stem_weight_bytes / head_weight_bytes: scalars, stored with the first / last device.
      stem_act_bytes / head_act_bytes: scalars, the stem's and the head's working sets.
      thresholds: float32[J]: the sorted distinct working-set values (0 first) at which E[max] is evaluated.
    """

    weight_bytes: jnp.ndarray
    act_bytes: jnp.ndarray
    stem_weight_bytes: jnp.ndarray
    head_weight_bytes: jnp.ndarray
    stem_act_bytes: jnp.ndarray
    head_act_bytes: jnp.ndarray
    thresholds: jnp.ndarray


class DeviceMemory(NamedTuple):
    """Memory of every device in bytes, float32[M] each: ``total = weights + buffers + activations``."""

    total: jnp.ndarray
    weights: jnp.ndarray
    activations: jnp.ndarray
    buffers: jnp.ndarray


def op_working_set_elems(op, s) -> int:
    """Elements of the largest activation working set while candidate ``op`` runs at slot ``s`` (per image)."""
    x = s.in_hw * s.in_hw * s.in_ch
    if op.is_identity:
        return x
    mid = s.in_ch * op.expand
    e1, e2, y = s.in_hw * s.in_hw * mid, s.out_hw * s.out_hw * mid, s.out_hw * s.out_hw * s.out_ch
    r = x if op.residual else 0
    return max(x + e1, r + e1 + e2, r + e2 + y)


def op_stored_params(op, s) -> int:
    """Scalars candidate ``op`` stores at slot ``s``: ``space.op_params`` plus the BN running mean and variance."""
    if op.is_identity:
        return 0
    mid = s.in_ch * op.expand
    return op_params(op, s) + 2 * (mid + mid + s.out_ch)


def stem_head_counts(space) -> dict:
    """Stored scalars and working-set elements of the stem and the head (per image)."""
    hw, c_in, c = space.stem_out_hw, space.in_channels, space.stem_channels
    head_hw, head_in = space.head_in
    h, k = space.head_channels, space.num_classes
    return {"stem_params": 9 * c_in * c + 4 * c,
            "head_params": head_in * h + 4 * h + h * k + k,
            "stem_act": space.image_size ** 2 * c_in + hw * hw * c,
            "head_act": max(head_hw ** 2 * (head_in + h), head_hw ** 2 * h + h, h + k)}


def space_memory(space, activation_bits: int = 32, weight_bits: int = 32) -> SpaceMemory:
    """The per-candidate memory table of ``space`` with activations at ``activation_bits`` and weights at
    ``weight_bits`` bits (the network stores float32 weights; the activation width is the cost model's)."""
    for what, b in (("weight_bits", weight_bits), ("activation_bits", activation_bits)):
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 64:
            raise ValueError(f"{what} must be an integer number of bits in [1, 64], got {b!r}")
    mask = space.mask()
    w = np.array([[_packed(op_stored_params(o, s), weight_bits) for o in OPS] for s in space.layers], np.float64)
    a = np.array([[_packed(op_working_set_elems(o, s), activation_bits) for o in OPS] for s in space.layers],
                 np.float64)
    w, a = np.where(mask, w, 0.0), np.where(mask, a, 0.0)
    sh = stem_head_counts(space)
    stem_a, head_a = _packed(sh["stem_act"], activation_bits), _packed(sh["head_act"], activation_bits)
    thresholds = np.unique(np.concatenate([[0.0, stem_a, head_a], a[mask]]))
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    return SpaceMemory(f32(w), f32(a), f32(_packed(sh["stem_params"], weight_bits)),
                       f32(_packed(sh["head_params"], weight_bits)), f32(stem_a), f32(head_a), f32(thresholds))


def _device_onehot(space, assignment):
    """float32[N, M]: 1 where layer n runs on device m (D^m, or a given int[N] assignment, maybe traced)."""
    dev = jnp.asarray(space.layer_devices() if assignment is None else assignment)
    return jax.nn.one_hot(dev, space.topology.num_devices, dtype=jnp.float32)


def device_memory(space, mem: SpaceMemory, table, probs, assignment=None) -> DeviceMemory:
    """E[M_m] for every device under per-layer probabilities ``probs`` float[N, R] (one-hot: one architecture's
    exact memory). ``assignment`` int[N] (a chain's or a mesh's layer->device split) defaults to D^m; ``table``
    (a ``CostTable``) gives the bytes every link carries. Differentiable in ``probs``."""
    from jmsnas.cost.latency import link_bytes  # latency imports nothing from here; avoid a cycle at import time
    topo = space.topology
    onehot = _device_onehot(space, assignment)  # [N, M]
    order = topo.path_order()
    first, last = np.zeros(topo.num_devices, np.float32), np.zeros(topo.num_devices, np.float32)
    first[order[0]], last[order[-1]] = 1.0, 1.0
    weights = jnp.einsum("nr,nr,nm->m", probs, mem.weight_bytes, onehot)
    weights = weights + first * mem.stem_weight_bytes + last * mem.head_weight_bytes
    # F_m(v) = prod_n [(1 - on_nm) + on_nm P(A_n <= v)] for the layers, times the stem's/head's indicators
    below = (mem.act_bytes[None] <= mem.thresholds[:, None, None]).astype(jnp.float32)  # [J, N, R]
    cdf_n = jnp.einsum("jnr,nr->jn", below, probs)  # P(A_n <= v_j)
    cdf = jnp.prod(1.0 - onehot[None] + onehot[None] * cdf_n[:, :, None], axis=1)  # [J, M]
    for const, is_dev in ((mem.stem_act_bytes, first), (mem.head_act_bytes, last)):
        cdf = cdf * jnp.where((mem.thresholds[:, None] >= const) | (is_dev[None] == 0), 1.0, 0.0)
    gaps = jnp.diff(mem.thresholds)  # v_j - v_{j-1}, j >= 1
    acts = jnp.einsum("j,jm->m", gaps, 1.0 - cdf[:-1])
    lb = link_bytes(space, table, assignment)
    buffers = jnp.zeros(topo.num_devices, jnp.float32).at[order[0]].add(table.input_bytes)
    for i, l in enumerate(topo.links):
        src, dst = topo.device_names.index(l.src), topo.device_names.index(l.dst)
        buffers = buffers.at[src].add(lb[i]).at[dst].add(lb[i])
    return DeviceMemory(weights + buffers + acts, weights, acts, buffers)


def arch_memory(space, mem: SpaceMemory, table, ops, assignment=None) -> DeviceMemory:
    """M_m of one discrete architecture ``ops`` int[N] (bytes per device)."""
    return device_memory(space, mem, table, jax.nn.one_hot(jnp.asarray(ops), mem.act_bytes.shape[-1]), assignment)


def expected_memory(space, mem: SpaceMemory, table, alpha, assignment=None) -> DeviceMemory:
    """E_alpha[M_m] with p = softmax(alpha) over the valid candidates (differentiable in alpha)."""
    from jmsnas.gates import probabilities
    return device_memory(space, mem, table, probabilities(alpha, jnp.asarray(space.mask())), assignment)


def memory_limits(topology) -> np.ndarray:
    """float64[M]: every device's ``memory_bytes``."""
    return np.array([d.memory_bytes for d in topology.devices], np.float64)
