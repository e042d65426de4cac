"""E[T], E[memory] and E[energy] of the composed space in closed form (paper 003 eq. (1) chain, eq. (2) mesh).

Every cost is a sum (or, for the mesh's branches, a max) of terms that each depend on a few independent choices:

* layer n on device m: E[tau_n^m] = sum_{i,b} p_n(i) w_n(b) layer_ms[m, n, i, b] (ms);
* link l crossing boundary j: E[eps_l] = sum_{k,a} q_l(k) s_l(a) link_ms(l, wire_bytes[j, k, a]) (ms), a function
  of the bytes on the wire; its module's Conv-Reduce E = sum_k q_l(k) send_ms[src, j, k] is charged to the
  sender's compute and its Conv-Recover to the receiver's.

So E[T] of a chain is exact; on a mesh, as ``jmsnas.cost.latency.mesh_latency``, the max over branches is taken of
expected branch latencies (each branch term exact; their max a lower bound of E[max], Jensen). Memory per device
= weights + link buffers (the bytes of every link it sends or receives) + the largest activation working set,
whose expectation is exact by the distribution function of a max of independent variables (the layers' working
sets and the modules' on the device), as ``cost.memory.device_memory``. Energy is linear in the terms (exact).

A split (``assignment``) is int32[N], the device of every layer, the stem on the first device; or, where the
choices send the input (``Choices.send_input``, a chain), int32[N + 1] whose last entry is the stem's device
(``split_devices``): the links before it carry the input image (boundary N + 1), and the stem's compute,
weights and working set are charged there.

One-hot probabilities give one configuration's exact cost. With every mechanism off (one module choice "none",
one bit width 32) each function equals today's ``cost.latency.latency``, ``cost.memory.device_memory`` and
``cost.energy.energy``. Differentiable in every probability (the split is an argmin: no gradient through it).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.compose.choices import ChoiceProbs
from jmsnas.compose.terms import Terms
from jmsnas.cost.energy import Energy, powers
from jmsnas.cost.latency import Latency, device_fixed_ms, link_ms, mesh_segments, mesh_total_ms
from jmsnas.cost.memory import DeviceMemory, SpaceMemory


class LinkTerms(NamedTuple):
    """Expectations of every link at every boundary j, float32[L, J]: ``eps`` ms, ``send``/``recv`` module ms
    (charged to the link's sender/receiver), ``wire`` bytes, ``send_weight``/``recv_weight`` module bytes."""

    eps: jnp.ndarray
    send: jnp.ndarray
    recv: jnp.ndarray
    wire: jnp.ndarray
    send_weight: jnp.ndarray
    recv_weight: jnp.ndarray


def _ends(topo):
    src = np.array([topo.device_names.index(l.src) for l in topo.links], np.int32)
    dst = np.array([topo.device_names.index(l.dst) for l in topo.links], np.int32)
    return src, dst


def link_terms(space, table, terms: Terms, probs: ChoiceProbs) -> LinkTerms:
    """Every link's expected terms at every boundary (the searched split's DP reads them all)."""
    topo = space.topology
    src, dst = _ends(topo)
    rows = []
    for l in range(len(topo.links)):
        q, s = probs.module[l], probs.act_bits[l]
        rows.append((jnp.einsum("k,a,jka->j", q, s, link_ms(table, l, terms.wire_bytes)),
                     jnp.einsum("k,jk->j", q, terms.send_ms[src[l]]), jnp.einsum("k,jk->j", q, terms.recv_ms[dst[l]]),
                     jnp.einsum("k,a,jka->j", q, s, terms.wire_bytes), jnp.einsum("k,jk->j", q, terms.send_weight),
                     jnp.einsum("k,jk->j", q, terms.recv_weight)))
    j = terms.wire_bytes.shape[0]
    if not rows:
        return LinkTerms(*(jnp.zeros((0, j), jnp.float32) for _ in range(6)))
    return LinkTerms(*(jnp.stack(col) for col in zip(*rows)))


def layer_ms(terms: Terms, probs: ChoiceProbs) -> jnp.ndarray:
    """E[tau_n^m] = sum_{i,b} p_n(i) w_n(b) layer_ms[m, n, i, b]: float32[M, N] ms."""
    return jnp.einsum("mnib,ni,nb->mn", terms.layer_ms, probs.ops, probs.weight_bits)


def split_devices(space, assignment=None) -> tuple:
    """(the layers' devices int32[N], the stem's device) of a split (D^m by default; may be traced): an int[N]
    split keeps the stem on the first device in execution order (a Python int), an int[N + 1] one names it last."""
    a = jnp.asarray(space.layer_devices() if assignment is None else assignment)
    n = space.num_layers
    if a.shape[0] == n + 1:
        return a[:n], a[n]
    return a, space.topology.path_order()[0]


def link_boundaries(space, assignment=None) -> jnp.ndarray:
    """int32[L]: the boundary j each link crosses under ``assignment`` (D^m by default; may be traced): j = 0 the
    stem's output, j = n + 1 layer n's output (chain: the layers done before it; mesh: see ``MeshSegments``);
    j = N + 1 the input image, on a chain's links before the stem's device (``split_devices``)."""
    topo = space.topology
    a, stem = split_devices(space, assignment)
    out = jnp.zeros((len(topo.links),), jnp.int32)

    def segment(devices, lo, hi, out):
        lookup = np.full(topo.num_devices, -1, np.int32)
        lookup[list(devices)] = np.arange(len(devices))
        pos = jnp.asarray(lookup)[a[lo:hi]]
        stem_pos = jnp.asarray(lookup)[stem] if lo == 0 else 0
        for p in range(len(devices) - 1):
            j = lo + jnp.sum(pos <= p)
            if lo == 0 and not isinstance(stem, int):
                j = jnp.where(stem_pos > p, space.num_layers + 1, j)
            out = out.at[topo.link_index(devices[p], devices[p + 1])].set(j)
        return out

    if topo.kind == "chain":
        return segment(list(topo.pre), 0, space.num_layers, out)
    seg = mesh_segments(space)
    out = segment(list(seg.prefix_devices), 0, seg.prefix, out)
    out = segment(list(seg.post), seg.suffix_start, space.num_layers, out)
    for b in topo.branches:
        out = out.at[topo.link_index(topo.root, b)].set(seg.prefix)
        out = out.at[topo.link_index(b, topo.post[0])].set(space.layers_of(b)[-1] + 1)
    return out


def _at(rows, bounds):
    """rows[l, bounds[l]] for every link: float32[L]."""
    return jnp.take_along_axis(rows, bounds[:, None], axis=1)[:, 0] if rows.shape[0] else rows[:, 0]


def _per_device_ms(space, table, terms, probs, assignment, lt, bounds):
    topo = space.topology
    tau = layer_ms(terms, probs)
    dev, stem = split_devices(space, assignment)
    per_device = jnp.einsum("mn,nm->m", tau, jax.nn.one_hot(dev, topo.num_devices, dtype=tau.dtype))
    per_device = device_fixed_ms(space, table, per_device,  # stem, head, every part's call cost
                                 None if isinstance(stem, int) else stem)
    if len(topo.links):
        src, dst = _ends(topo)
        per_device = per_device.at[src].add(_at(lt.send, bounds)).at[dst].add(_at(lt.recv, bounds))
    return per_device


def latency(space, table, terms: Terms, probs: ChoiceProbs, assignment=None) -> Latency:
    """E[T] (ms) under ``probs`` (one-hot: one configuration's T) and the split ``assignment`` (int[N], D^m by
    default): per_device is each device's expected compute (its layers, its modules' halves, stem/head), per_link
    each link's expected eps. Chain: eq. (1). Mesh: eq. (2) with the max over branches of expected terms."""
    topo = space.topology
    bounds = link_boundaries(space, assignment)
    lt = link_terms(space, table, terms, probs)
    per_device = _per_device_ms(space, table, terms, probs, assignment, lt, bounds)
    per_link = _at(lt.eps, bounds)
    if topo.kind == "chain":
        return Latency(jnp.sum(per_device) + jnp.sum(per_link), per_device, per_link)
    return Latency(mesh_total_ms(space, per_device, per_link), per_device, per_link)


def memory(space, mem: SpaceMemory, table, terms: Terms, probs: ChoiceProbs, assignment=None) -> DeviceMemory:
    """E[M_m] in bytes for every device: weights (layers at their bits on quantizing devices, modules, stem/head)
    + link buffers (the expected bytes of every link it sends or receives, and the input image on the first
    device) + E[largest activation working set] (its layers', the stem's/head's, its modules' halves). The stem's
    weights and working set are on the stem's device (``split_devices``)."""
    topo = space.topology
    bounds = link_boundaries(space, assignment)
    lt = link_terms(space, table, terms, probs)
    dev, stem = split_devices(space, assignment)
    onehot = jax.nn.one_hot(dev, topo.num_devices, dtype=jnp.float32)  # [N, M]
    order = topo.path_order()
    first, last = np.zeros(topo.num_devices, np.float32), np.zeros(topo.num_devices, np.float32)
    first[order[0]], last[order[-1]] = 1.0, 1.0
    if not isinstance(stem, int):  # the stem's weights and working set on its device (the image stays on the first)
        first = jax.nn.one_hot(stem, topo.num_devices, dtype=jnp.float32)
    w_layer = jnp.einsum("mnib,ni,nb->mn", terms.weight_bytes, probs.ops, probs.weight_bits)
    weights = jnp.einsum("mn,nm->m", w_layer, onehot) + first * mem.stem_weight_bytes + last * mem.head_weight_bytes
    buffers = jnp.zeros(topo.num_devices, jnp.float32).at[order[0]].add(table.input_bytes)
    thresholds = jnp.sort(jnp.concatenate([mem.thresholds, terms.act_values]))
    below = (mem.act_bytes[None] <= thresholds[:, None, None]).astype(jnp.float32)  # [J, N, R]
    cdf_n = jnp.einsum("jnr,nr->jn", below, probs.ops)  # P(A_n <= v_j)
    cdf = jnp.prod(1.0 - onehot[None] + onehot[None] * cdf_n[:, :, None], axis=1)  # [J, M]
    for const, is_dev in ((mem.stem_act_bytes, first), (mem.head_act_bytes, last)):
        cdf = cdf * jnp.where((thresholds[:, None] >= const) | (is_dev[None] == 0), 1.0, 0.0)
    if len(topo.links):
        src, dst = _ends(topo)
        wire = _at(lt.wire, bounds)
        weights = weights.at[src].add(_at(lt.send_weight, bounds)).at[dst].add(_at(lt.recv_weight, bounds))
        buffers = buffers.at[src].add(wire).at[dst].add(wire)
        for l in range(len(topo.links)):
            for acts, m in ((terms.send_act, src[l]), (terms.recv_act, dst[l])):
                p_below = (acts[bounds[l]][None] <= thresholds[:, None]).astype(jnp.float32) @ probs.module[l]
                cdf = cdf.at[:, m].multiply(p_below)
    acts = jnp.einsum("j,jm->m", jnp.diff(thresholds), 1.0 - cdf[:-1])
    return DeviceMemory(weights + buffers + acts, weights, acts, buffers)


def energy(space, table, terms: Terms, probs: ChoiceProbs, assignment=None) -> Energy:
    """E[energy] in mJ: each device's active power x its expected compute ms (modules included), plus tx/rx
    power x the expected airtime (bytes * 8 / bandwidth) of every link it sends/receives (cost.energy's model)."""
    topo = space.topology
    active, tx, rx = (jnp.asarray(a, jnp.float32) for a in powers(topo))
    lat = latency(space, table, terms, probs, assignment)
    bounds = link_boundaries(space, assignment)
    air_ms = _at(link_terms(space, table, terms, probs).wire, bounds) * 8.0 / (table.bandwidth_mbps * 1e3)
    per_device = active * lat.per_device
    if len(topo.links):
        src, dst = _ends(topo)
        per_device = per_device.at[src].add(tx * air_ms).at[dst].add(rx * air_ms)
    per_link = (tx + rx) * air_ms
    return Energy(jnp.sum(per_device), per_device, per_link)


def _segment_dp(tau, eps):
    """Chain position (int[n]) of each of n consecutive layers split contiguously over P devices, minimising their
    compute tau float[P, n] plus eps[p][j] (crossing from device p to p + 1 at the segment's boundary j, 0..n)."""
    n = tau.shape[1]
    cum = jnp.concatenate([jnp.zeros((tau.shape[0], 1), tau.dtype), jnp.cumsum(tau, axis=1)], axis=1)
    j_le_k = jnp.tril(jnp.ones((n + 1, n + 1), bool))  # [k, j]: j <= k
    f, choices = cum[0], []
    for p in range(tau.shape[0] - 1):
        cand = (f + eps[p] - cum[p + 1])[None, :] + cum[p + 1][:, None]  # [k, j]
        cand = jnp.where(j_le_k, cand, jnp.inf)
        choices.append(jnp.argmin(cand, axis=1))
        f = jnp.min(cand, axis=1)
    starts, k = [], jnp.asarray(n)
    for p in range(tau.shape[0] - 2, -1, -1):
        k = choices[p][k]
        starts.append(k)
    starts = jnp.stack(starts[::-1]) if starts else jnp.zeros((0,), jnp.int32)
    return jnp.sum(jnp.arange(n)[:, None] >= starts[None, :], axis=1)


def sends_input(space, terms: Terms) -> bool:
    """Whether ``terms`` hold the input boundary (built with ``Choices.send_input``)."""
    return terms.wire_bytes.shape[0] == space.num_layers + 2


def best_assignment(space, table, terms: Terms, probs: ChoiceProbs) -> jnp.ndarray:
    """The split minimising E[T] (exact DP, as ``cost.latency.best_assignment``, with every link's expected eps
    and module compute at every boundary): chain contiguous along the chain, mesh the ``MeshSegments`` family.
    int32[N]; where the terms send the input (``sends_input``), int32[N + 1], the stem placed by the same DP as
    one more item before the layers (the links before it carry the image). jit-friendly, no gradient."""
    topo = space.topology
    probs = jax.lax.stop_gradient(probs)
    tau = layer_ms(terms, probs)
    lt = link_terms(space, table, terms, probs)
    cross = lt.eps + lt.send + lt.recv  # [L, J]
    if topo.kind == "chain" and sends_input(space, terms):
        devices, n = list(topo.pre), space.num_layers
        stem = jnp.asarray(table.stem_ms, tau.dtype)[:, None]
        items = jnp.concatenate([stem, tau], axis=1)[jnp.asarray(devices)]  # [P, N + 1]: the stem first
        order = jnp.asarray([n + 1] + list(range(n + 1)))  # the input, the stem's output, the layers' outputs
        eps = [cross[topo.link_index(devices[p], devices[p + 1])][order] for p in range(len(devices) - 1)]
        dev = jnp.asarray(devices, jnp.int32)[_segment_dp(items, eps)]
        return jnp.concatenate([dev[1:], dev[:1]])

    def split(devices, lo, hi):
        eps = [cross[topo.link_index(devices[p], devices[p + 1]), lo:hi + 1] for p in range(len(devices) - 1)]
        pos = _segment_dp(tau[jnp.asarray(devices), lo:hi], eps)
        return jnp.asarray(devices, jnp.int32)[pos]

    if topo.kind == "chain":
        return split(list(topo.pre), 0, space.num_layers)
    seg = mesh_segments(space)
    dev = jnp.asarray(space.layer_devices(), jnp.int32)
    return jnp.concatenate([split(list(seg.prefix_devices), 0, seg.prefix), dev[seg.prefix:seg.suffix_start],
                            split(list(seg.post), seg.suffix_start, space.num_layers)])


def searched_latency(space, table, terms: Terms, probs: ChoiceProbs) -> tuple:
    """(E[T] under the best split of the expected terms, that split int32[N])."""
    assignment = best_assignment(space, table, terms, probs)
    return latency(space, table, terms, probs, assignment), assignment
