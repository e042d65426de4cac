"""Completion latency of a split network: eq. (1) for a chain and eq. (2) for a mesh (paper 003, section III).

One function serves the expected latency E[T] (probabilities p = softmax(alpha), E[tau_n^m] = sum_i p_i U_n^m(v_i))
and the latency of one discrete architecture (one-hot p). Everything is in ms and differentiable in p.

Communication: the output of the last layer d(m) on device m crosses the link to the next device,
eps = bytes * 8 / bandwidth + the link's fixed latency, and eps = 0 after the last device. The stem runs on the
first device in execution order (the UE, which captures the image) and the classifier head on the last.
In a mesh, the root forwards its output to each branch over that branch's own link (eq. (2) writes one eps for the
root; with different links per branch each branch term uses its own), and the max over branches is taken of
expected latencies when p is not one-hot — a lower bound of the true E[max] (Jensen), see the tests.

Deployed terms (``CostTable.call_ms``, ``handoff_ms``, ``handoff_ms_per_byte``; 0 in a table without them, where
everything above is exactly the paper's eq. (1)/(2)): every device pays its part's call cost once per image
(``device_fixed_ms``), and every link's eps gains its hand-off, handoff_ms + handoff_ms_per_byte x bytes
(``link_ms``), so the split and the ops are searched for what a deployment pays.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.cost.tables import CostTable
from jmsnas.gates import probabilities
from jmsnas.space import SearchSpace
from jmsnas.topology import transfer_ms


class Latency(NamedTuple):
    """total: ms; per_device: float32[M] compute ms; per_link: float32[L] communication ms (topology link order)."""

    total: jnp.ndarray
    per_device: jnp.ndarray
    per_link: jnp.ndarray


def layer_ms(table: CostTable, probs) -> jnp.ndarray:
    """E[tau_n^m] = sum_i p_i U_n^m(v_i): float32[M, N]."""
    return jnp.einsum("mnr,nr->mn", table.compute_ms, probs)


def _at(x, i):
    """x[i], or x itself for a scalar (a CostTable built without deployed terms holds 0.0)."""
    return x if jnp.ndim(x) == 0 else x[i]


def eps_ms(nbytes, bandwidth_mbps, latency_ms, handoff_ms=0.0, handoff_ms_per_byte=0.0):
    """A link's term carrying ``nbytes`` bytes, ms: the paper's eps = nbytes * 8 / bandwidth (Mbit/s) + latency
    (``topology.transfer_ms``), plus the deployed hand-off handoff_ms + handoff_ms_per_byte * nbytes (0: none).
    The one formula of a link's cost: ``link_ms`` (the search) and ``deploy.predict.predicted_links`` (the
    deployed pipeline's prediction) both call it."""
    return transfer_ms(nbytes, bandwidth_mbps, latency_ms) + handoff_ms + handoff_ms_per_byte * nbytes


def link_ms(table: CostTable, link: int, nbytes):
    """eps of link ``link`` carrying ``nbytes`` bytes (any shape), ms: ``eps_ms`` with the table's bandwidth,
    latency and hand-off of that link (0 in a table without one: exactly the paper's eps)."""
    return eps_ms(nbytes, table.bandwidth_mbps[link], table.link_latency_ms[link], _at(table.handoff_ms, link),
                  _at(table.handoff_ms_per_byte, link))


def device_fixed_ms(space: SearchSpace, table: CostTable, per_device, stem_device=None):
    """``per_device`` float[M] (ms) plus the once-per-image terms: the stem on ``stem_device`` (default the first
    device in execution order; may be traced), the head on the last, and every device's part call cost
    (``call_ms``, 0 in a table without one)."""
    order = space.topology.path_order()
    if stem_device is None:
        per_device = per_device.at[order[0]].add(table.stem_ms[order[0]])
    else:
        per_device = per_device.at[stem_device].add(jnp.asarray(table.stem_ms)[stem_device])
    per_device = per_device.at[order[-1]].add(table.head_ms[order[-1]])
    return per_device + table.call_ms


def _check_assignment(space: SearchSpace, assignment) -> None:
    """Rejects a concrete assignment that is not int[N] over the chain devices in non-decreasing chain order
    (a traced one, inside jit/vmap, cannot be inspected here)."""
    try:
        a = np.asarray(assignment)
    except jax.errors.TracerArrayConversionError:
        return
    order = list(space.topology.pre)
    if a.shape != (space.num_layers,) or a.dtype.kind not in "iu" or not np.isin(a, order).all():
        raise ValueError(f"assignment must be int[{space.num_layers}] of chain device indices {order}, "
                         f"got {a.tolist()}")
    pos = np.argsort(order)[a]
    if np.any(np.diff(pos) < 0):
        raise ValueError(f"assignment {a.tolist()} is not contiguous in chain order {order}: "
                         f"a layer would send its output back to an earlier device")


def chain_latency(space: SearchSpace, table: CostTable, probs, assignment=None) -> Latency:
    """Eq. (1). ``assignment`` int32[N] (device index per layer, contiguous in chain order) defaults to D^m."""
    topo = space.topology
    order = np.asarray(topo.pre)
    if assignment is not None:
        _check_assignment(space, assignment)
    assignment = jnp.asarray(space.layer_devices() if assignment is None else assignment)
    tau = layer_ms(table, probs)  # [M, N]
    onehot = jax.nn.one_hot(assignment, topo.num_devices, dtype=tau.dtype)  # [N, M]
    per_device = device_fixed_ms(space, table, jnp.einsum("mn,nm->m", tau, onehot))
    nbytes = link_bytes(space, table, assignment)
    per_link = jnp.zeros((len(topo.links),), tau.dtype)
    for j in range(len(order) - 1):
        link = topo.link_index(int(order[j]), int(order[j + 1]))
        per_link = per_link.at[link].set(link_ms(table, link, nbytes[link]))
    return Latency(jnp.sum(per_device) + jnp.sum(per_link), per_device, per_link)


def link_bytes(space: SearchSpace, table: CostTable, assignment=None) -> jnp.ndarray:
    """float32[L]: the bytes every link carries per image (topology link order). Chain: the tensor at the boundary
    the link crosses under ``assignment`` (D^m by default; the stem's output when the first device runs no
    layer). Mesh (D^m): the output of the sending device's last layer."""
    topo = space.topology
    nbytes = jnp.zeros((len(topo.links),), jnp.float32)
    if topo.kind != "chain":
        if assignment is None:
            for i, l in enumerate(topo.links):
                nbytes = nbytes.at[i].set(table.out_bytes[space.layers_of(topo.device_names.index(l.src))[-1]])
            return nbytes
        return _mesh_link_bytes(space, table, assignment)
    order = np.asarray(topo.pre)
    assignment = jnp.asarray(space.layer_devices() if assignment is None else assignment)
    chain_pos = jnp.asarray(np.argsort(order))[assignment]  # position of each layer's device along the chain
    for j in range(len(order) - 1):
        done = jnp.sum(chain_pos <= j)  # layers finished before crossing link j
        link = topo.link_index(int(order[j]), int(order[j + 1]))
        nbytes = nbytes.at[link].set(jnp.where(done > 0, table.out_bytes[jnp.maximum(done - 1, 0)], table.stem_bytes))
    return nbytes


class MeshSegments(NamedTuple):
    """A mesh space's two re-splittable segments: the prefix (the slots of pre + root: layers 0..P-1) over
    ``prefix_devices`` = pre + (root,), and the suffix (the slots of post: layers s0..N-1) over ``post``.
    A searched mesh split assigns each segment's layers contiguously to its devices in order (a device may take
    none and relay); every branch keeps its own sub-network, so the tensors on the root -> branch and branch ->
    aggregator links are fixed. Suffix boundary k carries out_bytes[s0 + k - 1] (k = 0: the merged branch outputs,
    the shape of a branch's output); prefix boundary j carries out_bytes[j - 1] (j = 0: the stem's output)."""

    prefix_devices: tuple
    prefix: int  # P
    post: tuple
    suffix_start: int  # s0


def mesh_segments(space: SearchSpace) -> MeshSegments:
    topo = space.topology
    pre_devs = tuple(topo.pre) + (topo.root,)
    prefix = sum(len(space.layers_of(m)) for m in pre_devs)
    suffix = sum(len(space.layers_of(m)) for m in topo.post)
    return MeshSegments(pre_devs, prefix, tuple(topo.post), space.num_layers - suffix)


def _segment_positions(seg_devices, assignment, lo, hi):
    """Position along ``seg_devices`` of the device of each layer lo..hi-1 (traced or concrete)."""
    lookup = np.full(max(seg_devices) + 1, -1, np.int32)
    lookup[list(seg_devices)] = np.arange(len(seg_devices))
    return jnp.asarray(lookup)[jnp.asarray(assignment)[lo:hi]]


def _mesh_link_bytes(space, table, assignment):
    topo, seg = space.topology, mesh_segments(space)
    nbytes = jnp.zeros((len(topo.links),), jnp.float32)
    pos = _segment_positions(seg.prefix_devices, assignment, 0, seg.prefix)
    for j in range(len(seg.prefix_devices) - 1):
        done = jnp.sum(pos <= j)
        link = topo.link_index(seg.prefix_devices[j], seg.prefix_devices[j + 1])
        nbytes = nbytes.at[link].set(jnp.where(done > 0, table.out_bytes[jnp.maximum(done - 1, 0)], table.stem_bytes))
    agg = topo.post[0]
    for b in topo.branches:
        nbytes = nbytes.at[topo.link_index(topo.root, b)].set(table.out_bytes[seg.prefix - 1])
        nbytes = nbytes.at[topo.link_index(b, agg)].set(table.out_bytes[space.layers_of(b)[-1]])
    pos = _segment_positions(seg.post, assignment, seg.suffix_start, space.num_layers)
    for j in range(len(seg.post) - 1):
        done = jnp.sum(pos <= j)
        link = topo.link_index(seg.post[j], seg.post[j + 1])
        nbytes = nbytes.at[link].set(table.out_bytes[seg.suffix_start + done - 1])
    return nbytes


def _check_mesh_assignment(space: SearchSpace, assignment) -> None:
    """Rejects a concrete mesh assignment outside the family of ``MeshSegments`` (traced ones pass)."""
    try:
        a = np.asarray(assignment)
    except jax.errors.TracerArrayConversionError:
        return
    seg, dev = mesh_segments(space), space.layer_devices()
    if a.shape != (space.num_layers,) or a.dtype.kind not in "iu":
        raise ValueError(f"assignment must be int[{space.num_layers}] of device indices, got {a.tolist()}")
    br = slice(seg.prefix, seg.suffix_start)
    if not np.array_equal(a[br], dev[br]):
        raise ValueError(f"assignment {a.tolist()}: every branch layer stays on its branch device "
                         f"({dev[br].tolist()} for layers {seg.prefix}..{seg.suffix_start - 1})")
    for devs, lo, hi, what in ((seg.prefix_devices, 0, seg.prefix, "before the fork"),
                               (seg.post, seg.suffix_start, space.num_layers, "after the merge")):
        part = a[lo:hi]
        if not np.isin(part, devs).all() or np.any(np.diff([devs.index(d) for d in part]) < 0):
            raise ValueError(f"assignment {a.tolist()}: layers {lo}..{hi - 1} ({what}) must run on devices "
                             f"{list(devs)} in that order")


def mesh_latency(space: SearchSpace, table: CostTable, probs, assignment=None) -> Latency:
    """Eq. (2): chain part C (before the root and from the aggregator on) plus the slowest root->branch path.
    ``assignment`` int32[N] (a searched split, see ``MeshSegments``) defaults to D^m."""
    topo = space.topology
    tau = layer_ms(table, probs)
    if assignment is None:
        per_device = jnp.stack([jnp.sum(tau[m, list(space.layers_of(m))]) for m in range(topo.num_devices)])
    else:
        _check_mesh_assignment(space, assignment)
        onehot = jax.nn.one_hot(jnp.asarray(assignment), topo.num_devices, dtype=tau.dtype)
        per_device = jnp.einsum("mn,nm->m", tau, onehot)
    per_device = device_fixed_ms(space, table, per_device)
    if assignment is not None:
        return _mesh_total(space, table, per_device, _mesh_link_bytes(space, table, assignment))
    last_out = lambda m: table.out_bytes[space.layers_of(m)[-1]]
    per_link = jnp.zeros((len(topo.links),), tau.dtype)
    chain_seq = list(topo.pre) + [topo.root]
    for a, b in zip(chain_seq, chain_seq[1:]):
        link = topo.link_index(a, b)
        per_link = per_link.at[link].set(link_ms(table, link, last_out(a)))
    for a, b in zip(topo.post, topo.post[1:]):
        link = topo.link_index(a, b)
        per_link = per_link.at[link].set(link_ms(table, link, last_out(a)))
    agg = topo.post[0]
    branch_terms = []
    for b in topo.branches:
        down, up = topo.link_index(topo.root, b), topo.link_index(b, agg)
        per_link = per_link.at[down].set(link_ms(table, down, last_out(topo.root)))
        per_link = per_link.at[up].set(link_ms(table, up, last_out(b)))
        branch_terms.append(per_device[topo.root] + per_link[down] + per_device[b] + per_link[up])
    chain_part = sum(per_device[m] for m in list(topo.pre) + list(topo.post))
    chain_part = chain_part + sum(per_link[topo.link_index(a, b)] for a, b in zip(chain_seq, chain_seq[1:]))
    chain_part = chain_part + sum(per_link[topo.link_index(a, b)] for a, b in zip(topo.post, topo.post[1:]))
    total = chain_part + jnp.max(jnp.stack(branch_terms))
    return Latency(total, per_device, per_link)


def _mesh_total(space, table, per_device, nbytes) -> Latency:
    """Eq. (2) from per-device compute ms and per-link bytes (the searched-split path of ``mesh_latency``)."""
    per_link = jnp.stack([link_ms(table, i, nbytes[i]) for i in range(len(space.topology.links))])
    return Latency(mesh_total_ms(space, per_device, per_link), per_device, per_link)


def mesh_total_ms(space: SearchSpace, per_device, per_link):
    """Eq. (2) from every device's compute ms and every link's ms: the chain part (pre, post, their links) plus
    the slowest root -> branch -> aggregator path (the root's compute, both links and the branch's compute)."""
    topo = space.topology
    chain_seq = list(topo.pre) + [topo.root]
    chain_links = [topo.link_index(a, b) for seq in (chain_seq, list(topo.post)) for a, b in zip(seq, seq[1:])]
    agg = topo.post[0]
    branch_terms = [per_device[topo.root] + per_link[topo.link_index(topo.root, b)] + per_device[b]
                    + per_link[topo.link_index(b, agg)] for b in topo.branches]
    chain_part = sum(per_device[m] for m in list(topo.pre) + list(topo.post)) + sum(per_link[i] for i in chain_links)
    return chain_part + jnp.max(jnp.stack(branch_terms))


def latency(space: SearchSpace, table: CostTable, probs, assignment=None) -> Latency:
    """Latency breakdown for probabilities ``probs`` float[N, R] (one-hot for a discrete architecture)."""
    if space.topology.kind == "chain":
        return chain_latency(space, table, probs, assignment)
    return mesh_latency(space, table, probs, assignment)


def expected_latency(space: SearchSpace, table: CostTable, alpha, assignment=None) -> Latency:
    """E_alpha[T] with p = softmax(alpha) over the valid candidates (differentiable in alpha)."""
    return latency(space, table, probabilities(alpha, jnp.asarray(space.mask())), assignment)


def arch_latency(space: SearchSpace, table: CostTable, ops, assignment=None) -> Latency:
    """T of one discrete architecture ops int32[N]."""
    return latency(space, table, jax.nn.one_hot(jnp.asarray(ops), table.compute_ms.shape[-1]), assignment)


def breakdown_dict(space: SearchSpace, lat: Latency) -> dict:
    """A JSON-ready breakdown: {"total", "per_device": {name: ms}, "per_link": {"a->b": ms}}."""
    topo = space.topology
    return {"total": float(lat.total),
            "per_device": {d.name: float(v) for d, v in zip(topo.devices, np.asarray(lat.per_device))},
            "per_link": {n: float(v) for n, v in zip(topo.link_names, np.asarray(lat.per_link))}}


def best_chain_assignment(space: SearchSpace, table: CostTable, probs) -> jnp.ndarray:
    """The contiguous layer->device assignment minimising eq. (1) for per-layer latencies E[tau] (exact DP).

    f[p, k] is the least latency of running layers 0..k-1 on the first p+1 chain devices; device p+1 then takes
    layers j..k-1 after receiving the tensor at boundary j over link p -> p+1:
    f[p+1, k] = min_{j<=k} f[p, j] + eps_p(j) + sum_{n=j}^{k-1} E[tau_n^{p+1}]. A device may take no layers (it
    relays the tensor). Returns int32[N] device indices; O(M N^2), jit-friendly, no gradient (an argmin).
    """
    topo = space.topology
    if topo.kind != "chain":
        raise ValueError(f"a chain split needs a chain topology, got {topo.kind!r} ({topo.name!r}); "
                         "best_mesh_assignment splits a mesh")
    order = list(topo.pre)
    tau = jax.lax.stop_gradient(layer_ms(table, probs))
    boundary_bytes = jnp.concatenate([table.stem_bytes[None], table.out_bytes])  # tensor at boundary j
    pos = _segment_dp(space, table, order, tau[jnp.asarray(order)], boundary_bytes)
    return jnp.asarray(order, jnp.int32)[pos]


def _segment_dp(space, table, order, tau, boundary_bytes):
    """Chain position (int[n]) of each of n consecutive layers split contiguously over the devices ``order``,
    minimising their compute tau [len(order), n] plus the links' eps at the split boundaries (the DP above)."""
    topo, n = space.topology, tau.shape[1]
    cum = jnp.concatenate([jnp.zeros((len(order), 1), tau.dtype), jnp.cumsum(tau, axis=1)], axis=1)  # [M, n+1]
    j_le_k = jnp.tril(jnp.ones((n + 1, n + 1), bool))  # [k, j]: j <= k
    f, choices = cum[0], []
    for p in range(len(order) - 1):
        link = topo.link_index(order[p], order[p + 1])
        cand = (f + link_ms(table, link, boundary_bytes) - cum[p + 1])[None, :] + cum[p + 1][:, None]  # [k, j]
        cand = jnp.where(j_le_k, cand, jnp.inf)
        choices.append(jnp.argmin(cand, axis=1))
        f = jnp.min(cand, axis=1)
    # backtrack: the start layer of every device along the chain
    starts, k = [], jnp.asarray(n)
    for p in range(len(order) - 2, -1, -1):
        k = choices[p][k]
        starts.append(k)
    starts = jnp.stack(starts[::-1]) if starts else jnp.zeros((0,), jnp.int32)  # start of devices 1..M-1
    return jnp.sum(jnp.arange(n)[:, None] >= starts[None, :], axis=1)  # chain position of every layer


def best_mesh_assignment(space: SearchSpace, table: CostTable, probs) -> jnp.ndarray:
    """The layer->device assignment of a mesh (``MeshSegments``) minimising eq. (2) for E[tau] (exact).

    Under such a split eq. (2) is T = [sum over pre + root of tau and chain links] + max_b C_b + [sum over post of
    tau and chain links] + stem/head terms, where C_b (root -> b link, branch b's compute, b -> aggregator link) does
    not depend on the split: the root's compute is in every branch term, so it leaves the max. The two brackets
    are independent chain problems, each solved by the chain DP. int32[N]; jit-friendly, no gradient."""
    topo = space.topology
    if topo.kind != "mesh":
        raise ValueError(f"a mesh split needs a mesh topology, got {topo.kind!r} ({topo.name!r})")
    seg = mesh_segments(space)
    tau = jax.lax.stop_gradient(layer_ms(table, probs))
    pre = jnp.asarray(seg.prefix_devices)
    pos = _segment_dp(space, table, list(seg.prefix_devices), tau[pre, :seg.prefix],
                      jnp.concatenate([table.stem_bytes[None], table.out_bytes[:seg.prefix]]))
    post = jnp.asarray(seg.post)
    spos = _segment_dp(space, table, list(seg.post), tau[post, seg.suffix_start:],
                       table.out_bytes[seg.suffix_start - 1:])
    dev = jnp.asarray(space.layer_devices())
    return jnp.concatenate([pre[pos], dev[seg.prefix:seg.suffix_start], post[spos]]).astype(jnp.int32)


def best_assignment(space: SearchSpace, table: CostTable, probs) -> jnp.ndarray:
    """The exact best split of E[tau]: ``best_chain_assignment`` or ``best_mesh_assignment``."""
    if space.topology.kind == "mesh":
        return best_mesh_assignment(space, table, probs)
    return best_chain_assignment(space, table, probs)


def searched_latency(space: SearchSpace, table: CostTable, probs) -> tuple:
    """(Latency under the best split of E[tau], that assignment); gradients flow through the chosen split."""
    assignment = best_assignment(space, table, probs)
    return latency(space, table, probs, assignment), assignment
