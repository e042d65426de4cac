"""Auto-Split's joint split and bit-width search (paper 001, section 4, Algorithm 1) and its baselines.

A network is N layers in topological order (``edges``: (producer, consumer), producer -1 the network input).
Splitting at n runs layers [0, n) on the edge device (the first device of ``solvers.chain_path``) with per-layer
weight and activation bit widths, sends every tensor made before n and read at or after n (``solvers.cut_bytes``;
the raw input at ``input_bits`` when n = 0) packed at its bit width to the cloud (the last device; devices between
relay it, paying each link), and runs layers [n, N) on the cloud at 16 bits (eq. (1)). n = N sends nothing.

Memory of the edge part (eq. (3)): weights sum_i ceil(s^w_i b^w_i / 8) bytes (after batch-norm folding) plus the
largest activation working set on the DAG (``working_set_bytes``: a tensor lives from its producer to its last
local consumer, or to the end when it must be sent; the raw input while it is read), each tensor packed at its
producer's activation bits.

Algorithm 1, with the choices this implementation makes:

* P (eq. (6)): n with T_n <= T_0 (bytes crossing cut n at b_min; T_0 the raw input) and
  b_min (sum_{i<n} s^w_i + max_{i<n} s^a_i) / 8 <= M. ``potential_splits``.
* (8) by the Lagrangian method (``lagrangian_assign``): for multiplier lam every layer takes
  argmin_b D^w_i(b) + lam s^w_i b / 8, and of the solutions at every breakpoint of lam (both sides) the one with the
  least distortion within the budget is returned. It is optimal for the memory it uses (the known property of the
  method); budgets between two breakpoints can be left partly unused.
* (9): with the working-set memory M_a = max_i s^a_i b^a_i / 8 of a chain, the constraint M_a <= M_act holds
  layer by layer, so the exact solution gives every layer its least-distortion bit width with s^a_i b / 8 <= M_act
  (``assign_activations``); the Lagrangian would return the same.
* The (M_wgt, M_act) grid: uniform bit widths of B on layers [0, n), pairs with M_wgt + M_act > M skipped; each
  solution is then checked against M with the DAG working set (5b) and dropped if over.
* Beyond the paper's list (``latency_variants``): (7)-(9) pick bits by distortion alone, but latency depends on
  them too (L_tr on the transmitted tensor's bits, the edge's memory-bound layers on every tensor's bits). So every
  solution is also listed with the transmitted tensors lowered to each smaller width of B (Fig. 7 of the paper
  varies exactly this: W8A8-T8 vs W8A8-T1) and with all its edge activations capped at each width of B, and at
  every n of P the uniform assignments of B (the grid's own points) are listed. The accuracy check decides which
  are acceptable; without these the list can miss a uniform 8-bit split that is both faster and within A.
* Selection (Remark 4): solutions in order of latency, the first whose accuracy drop (a caller-supplied function,
  measured or a proxy) is within A. Cloud-only (drop 0) is always in the list, so one is always found.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import numpy as np

from jmsnas.cost import roofline
from jmsnas.graph import NetSpec
from jmsnas.quant.packing import transmitted_bytes
from jmsnas.quant.quantizers import check_bit_set
from jmsnas.split.solvers import chain_path, check_edges, cut_bytes, path_links
from jmsnas.topology import Topology, transfer_ms

FLOAT_BITS = 16  # the paper's "original" precision: the cloud and the float baselines run FP16
U8 = 8


class Problem(NamedTuple):
    """One network on one edge/cloud pair, all in plain arrays (shapes: N layers, K = |B|, L = len(lat_bits)).

    Attributes:
      names: layer names.
      w_elems: float[N] s^w, weights after batch-norm folding (0 for layers without weights).
      a_elems: float[N] s^a, output elements per image.
      edges: (producer, consumer) pairs, producer -1 the input.
      input_elems, input_bits: the raw input and its bits per value (8 for camera pixels).
      bits: the candidate set B (sorted).
      dw, da: float[N, K] distortion D^w_i(b), D^a_i(b) for b in B.
      lat_bits: bit widths the latency tables cover (B plus 8 and 16).
      edge_ms: float[N, L, L] latency of layer i on the edge at (weight bits, activation bits) = lat_bits[(k, l)].
      cloud_ms: float[N] latency of layer i on the cloud at 16 bits.
      link_bw_mbps, link_lat_ms: float[P] the links from the edge to the cloud (relayed).
      memory_bytes: M, the edge memory limit in bytes.
    """

    names: tuple
    w_elems: np.ndarray
    a_elems: np.ndarray
    edges: tuple
    input_elems: int
    input_bits: int
    bits: tuple
    dw: np.ndarray
    da: np.ndarray
    lat_bits: tuple
    edge_ms: np.ndarray
    cloud_ms: np.ndarray
    link_bw_mbps: np.ndarray
    link_lat_ms: np.ndarray
    memory_bytes: float

    @property
    def n(self) -> int:
        return len(self.names)


class Solution(NamedTuple):
    """A split n with bit widths of the edge layers [0, n) and its costs (ms, bytes)."""

    method: str
    split: int
    wbits: tuple
    abits: tuple
    latency_ms: float
    edge_ms: float
    transmit_ms: float
    cloud_ms: float
    sent_bytes: int
    edge_memory_bytes: int
    distortion: float

    def key(self) -> tuple:
        return self.split, self.wbits, self.abits

    def bit_arrays(self, units: int) -> tuple:
        """(wbits, abits) int32[units]: the edge layers' bits, 0 (float) from the split on."""
        wb, ab = np.zeros(units, np.int32), np.zeros(units, np.int32)
        wb[: self.split], ab[: self.split] = self.wbits, self.abits
        return wb, ab


def folded_weight_elems(net: NetSpec) -> np.ndarray:
    """s^w of a zoo network after batch-norm folding: a convolution's BN scale and bias become one bias per output
    channel (zoo convolutions all carry BN, counted as 2 * C_out parameters); other layers keep their count."""
    return np.array([l.params - l.out_shape[-1] if l.kind in ("conv", "dwconv") else l.params
                     for l in net.layers], dtype=float)


def make_problem(net: NetSpec, topo: Topology, memory_bytes: float, bits, dw, da, *, w_elems=None,
                 input_bits: int = 8) -> Problem:
    """A Problem for ``net`` on ``topo`` (edge = first device of the chain path, cloud = last) with roofline
    latencies: a layer reads and writes activations at its activation bits and its weights at its weight bits."""
    bits = check_bit_set(bits)
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or not memory_bytes > 0:
        raise ValueError(f"the edge memory limit must be a positive number of bytes, got {memory_bytes!r}")
    n = len(net.layers)
    w = folded_weight_elems(net) if w_elems is None else np.asarray(w_elems, float)
    dw, da = np.asarray(dw, float), np.asarray(da, float)
    for what, d in (("dw", dw), ("da", da)):
        if d.shape != (n, len(bits)) or not np.isfinite(d).all() or (d < 0).any():
            raise ValueError(f"{what} must be finite, >= 0 and shaped ({n}, {len(bits)}), got {d.shape}")
    path = chain_path(topo)
    edge, cloud = topo.devices[path[0]], topo.devices[path[-1]]
    _, bw, lat = path_links(topo, path)
    lat_bits = tuple(sorted(set(bits) | {U8, FLOAT_BITS}))
    ins = roofline.layer_input_elems(net)
    layers = [l._replace(params=int(p)) for l, p in zip(net.layers, w)]
    edge_ms = np.array([[[roofline.layer_latency_ms(l, edge, ba, in_elems=e, weight_bits=bw_)
                          for ba in lat_bits] for bw_ in lat_bits] for l, e in zip(layers, ins)]).reshape(
        n, len(lat_bits), len(lat_bits))
    cloud_ms = np.array([roofline.layer_latency_ms(l, cloud, FLOAT_BITS, in_elems=e) for l, e in zip(layers, ins)])
    return Problem(tuple(l.name for l in net.layers), w, np.array([l.out_elems for l in net.layers], float),
                   tuple(net.edges()), net.input_elems, int(input_bits), bits, dw, da, lat_bits, edge_ms, cloud_ms,
                   bw, lat, float(memory_bytes))


# ----------------------------------------------------------------------------------------------- costs

@functools.lru_cache(maxsize=64)
def _consumers_of(edges: tuple, n: int) -> dict:
    out = {}
    for u, v in check_edges(edges, n):
        out.setdefault(u, []).append(v)
    return out


def crossing(p: Problem, n: int) -> list:
    """Tensors sent at split n: producers (-1 = input) before n with a consumer at or after n (none if n = N)."""
    return list(crossing_of(tuple(p.edges), p.n, n))


@functools.lru_cache(maxsize=4096)
def crossing_of(edges: tuple, num: int, n: int) -> tuple:
    """``crossing`` of a network of ``num`` layers given as its (producer, consumer) ``edges``."""
    if n >= num:
        return ()
    return tuple(sorted(u for u, vs in _consumers_of(edges, num).items() if u < n and max(vs) >= n))


@functools.lru_cache(maxsize=4096)
def _lifetimes(edges: tuple, num: int, n: int):
    """(tensor ids int[T], first step int[T], last step int[T]) of the tensors live while layers [0, n) run."""
    cons = _consumers_of(edges, num)
    ids, first, last = [], [], []
    for t in [-1] + list(range(n)):
        vs = cons.get(t, [])
        local = [v for v in vs if v < n]
        if t < 0 and not local:
            continue
        ids.append(t)
        first.append(0 if t < 0 else t)
        last.append(n - 1 if (len(local) < len(vs) or (t >= 0 and not vs)) else max(local))
    return np.array(ids), np.array(first), np.array(last)


def _packed_sizes(p: Problem, ids: np.ndarray, abits) -> np.ndarray:
    """Bytes of tensors ``ids`` (-1 = input) at their bits: packed for <= 8 bits, whole bytes above."""
    ab = np.asarray(abits, float)
    elems = np.where(ids < 0, p.input_elems, p.a_elems[np.maximum(ids, 0)])
    bits = np.where(ids < 0, p.input_bits, ab[np.maximum(ids, 0)] if len(ab) else p.input_bits)
    return np.where(bits <= 8, np.ceil(elems * bits / 8), elems * np.ceil(bits / 8))


def working_set_bytes(p: Problem, n: int, abits: Sequence[int]) -> int:
    """Largest activation working set (bytes) of layers [0, n) run in order, tensor j packed at abits[j]."""
    if n == 0:
        return 0
    ids, first, last = _lifetimes(tuple(p.edges), p.n, n)
    diff = np.zeros(n + 1)
    sizes = _packed_sizes(p, ids, abits)
    np.add.at(diff, first, sizes)
    np.add.at(diff, last + 1, -sizes)
    return int(np.max(np.cumsum(diff)[:n]))


def edge_memory_bytes(p: Problem, n: int, wbits: Sequence[int], abits: Sequence[int]) -> int:
    """Weights of layers [0, n) at their bits plus the working set (eq. (3) on the DAG), in bytes."""
    weights = float(np.sum(np.ceil(p.w_elems[:n] * np.asarray(wbits, float) / 8))) if n else 0.0
    return int(weights + working_set_bytes(p, n, abits))


def evaluate(p: Problem, method: str, n: int, wbits: Sequence[int], abits: Sequence[int]) -> Solution:
    """Latency (eq. (1)), bytes sent, edge memory and distortion of split n with the given edge bit widths."""
    if not 0 <= n <= p.n or len(wbits) != n or len(abits) != n:
        raise ValueError(f"split {n} needs {n} weight and activation bit widths, got {len(wbits)}, {len(abits)}")
    li = {b: i for i, b in enumerate(p.lat_bits)}
    bi = {b: i for i, b in enumerate(p.bits)}
    rows = np.arange(n)
    edge = float(p.edge_ms[rows, [li[b] for b in wbits], [li[b] for b in abits]].sum()) if n else 0.0
    cross = np.array(crossing(p, n), int)
    sent = int(_packed_sizes(p, cross, abits).sum()) if len(cross) else 0
    tr = float(sum(transfer_ms(sent, bw, lat) for bw, lat in zip(p.link_bw_mbps, p.link_lat_ms))) if sent else 0.0
    cloud = float(p.cloud_ms[n:].sum())
    if n and all(b in bi for b in wbits) and all(b in bi for b in abits):
        dist = float(p.dw[rows, [bi[b] for b in wbits]].sum() + p.da[rows, [bi[b] for b in abits]].sum())
    else:  # uniform baselines at widths outside B: distortion over the layers whose widths are in B
        dist = float(sum(p.dw[i, bi[wbits[i]]] + p.da[i, bi[abits[i]]] for i in range(n)
                         if wbits[i] in bi and abits[i] in bi))
    return Solution(method, int(n), tuple(int(b) for b in wbits), tuple(int(b) for b in abits), edge + tr + cloud,
                    edge, tr, cloud, sent, edge_memory_bytes(p, n, wbits, abits), dist)


# ----------------------------------------------------------------------------------------------- eq. (6), (8), (9)

def potential_splits(p: Problem) -> list:
    """P of eq. (6): splits n in [0, N] with T_n <= T_0 and b_min (sum_{i<n} s^w_i + max_{i<n} s^a_i) / 8 <= M."""
    bmin = p.bits[0]
    out_b = np.array([transmitted_bytes(a, bmin) for a in p.a_elems], float)
    t0 = transmitted_bytes(p.input_elems, p.input_bits)
    cut = cut_bytes(out_b, t0, check_edges(p.edges, p.n))
    cut[p.n] = 0.0
    w = np.concatenate([[0.0], np.cumsum(p.w_elems)])
    a = np.concatenate([[0.0], np.maximum.accumulate(p.a_elems)])
    ok = (cut <= t0) & (bmin * (w + a) / 8 <= p.memory_bytes)
    return [int(n) for n in np.flatnonzero(ok)]


def lagrangian_assign(dist: np.ndarray, cost: np.ndarray, budget: float):
    """Lagrangian solution of min sum_i dist[i, c_i] s.t. sum_i cost[i, c_i] <= budget; options sorted by cost.

    Returns int[n] option indices, or None when even the cheapest options exceed the budget. For every multiplier
    lam at which some layer's choice changes (the slopes between two of its options), just below and just above,
    each layer takes argmin dist + lam * cost (ties to the cheaper option); of these, the least total distortion
    within the budget is returned (ties: less cost).
    """
    dist, cost = np.asarray(dist, float), np.asarray(cost, float)
    if dist.shape[0] == 0:
        return np.zeros(0, int)
    dd = dist[:, :, None] - dist[:, None, :]
    dc = cost[:, None, :] - cost[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = np.where(dc > 0, dd / dc, np.nan)
    s = np.unique(slopes[np.isfinite(slopes) & (slopes > 0)])
    lams = np.concatenate([[0.0], s * (1 - 1e-9), s * (1 + 1e-9), [np.inf]])
    vals = dist[None] + np.where(np.isinf(lams)[:, None, None], 0.0, lams[:, None, None]) * cost[None]
    choice = np.argmin(vals, axis=2)
    choice[np.isinf(lams)] = np.argmin(cost, axis=1)  # lam = inf: cheapest options (sorted, so index 0)
    rows = np.arange(dist.shape[0])
    tc, td = cost[rows, choice].sum(1), dist[rows, choice].sum(1)
    ok = tc <= budget * (1 + 1e-12) + 1e-9
    if not ok.any():
        return None
    best = min(np.flatnonzero(ok), key=lambda j: (td[j], tc[j]))
    return choice[best]


def assign_weights(p: Problem, n: int, budget_bytes: float):
    """(8) for layers [0, n): weight bit widths (tuple) within budget_bytes by the Lagrangian method, or None."""
    cost = p.w_elems[:n, None] * np.array(p.bits, float)[None] / 8
    c = lagrangian_assign(p.dw[:n], cost, budget_bytes)
    return None if c is None else tuple(p.bits[k] for k in c)


def assign_activations(p: Problem, n: int, budget_bytes: float):
    """(9) for layers [0, n) with M_a = max_i s^a_i b_i / 8: each layer's least-distortion width within the budget
    (ties: fewer bits), or None when some layer does not fit even at b_min."""
    out = []
    for i in range(n):
        ok = [k for k, b in enumerate(p.bits) if p.a_elems[i] * b / 8 <= budget_bytes * (1 + 1e-12)]
        if not ok:
            return None
        out.append(p.bits[min(ok, key=lambda k: (p.da[i, k], k))])
    return tuple(out)


# ----------------------------------------------------------------------------------------------- Algorithm 1

def candidates(p: Problem, latency_variants: bool = True) -> list:
    """The list S of Algorithm 1 (cloud-only first), each within M; duplicates removed. ``latency_variants``
    (see the module docstring) adds, for each solution, the transmitted tensors and all edge activations capped
    at every smaller width of B, and at every n of P the uniform assignments of B that define the grid."""
    out = {(0, (), ()): evaluate(p, "autosplit", 0, (), ())}
    for n in potential_splits(p):
        if n == 0:
            continue
        mw = [p.w_elems[:n].sum() * b / 8 for b in p.bits]
        ma = [p.a_elems[:n].max() * b / 8 for b in p.bits]
        sent = [t for t in crossing(p, n) if t >= 0]
        for m_w in mw:
            wb = assign_weights(p, n, m_w)
            if wb is None:
                continue
            for m_a in ma:
                if m_w + m_a > p.memory_bytes:
                    continue
                ab = assign_activations(p, n, m_a)
                if ab is None:
                    continue
                variants = {ab}
                if latency_variants:
                    for t in p.bits:
                        variants.add(tuple(min(b, t) if i in sent else b for i, b in enumerate(ab)))
                        variants.add(tuple(min(b, t) for b in ab))
                for v in variants:
                    _add(out, p, n, wb, v)
        if latency_variants:
            for b in p.bits:
                _add(out, p, n, (b,) * n, (b,) * n)
    return list(out.values())


def _add(out: dict, p: Problem, n: int, wb: tuple, ab: tuple) -> None:
    if (n, wb, ab) not in out:
        s = evaluate(p, "autosplit", n, wb, ab)
        if s.edge_memory_bytes <= p.memory_bytes:
            out[(n, wb, ab)] = s


def select(cands: Sequence[Solution], accuracy_drop: Callable[[Solution], float], max_drop: float):
    """(chosen solution, its drop, number of candidates whose drop was computed): the lowest-latency candidate
    whose drop is within ``max_drop``, trying candidates in order of latency (then distortion)."""
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise ValueError(f"the accuracy-drop threshold A must be a number >= 0, got {max_drop!r}")
    for k, s in enumerate(sorted(cands, key=lambda s: (s.latency_ms, s.distortion, s.split)), 1):
        d = float(accuracy_drop(s))
        if d <= max_drop + 1e-12:
            return s, d, k
    raise ValueError("no candidate meets the accuracy threshold (the list must hold cloud-only, split 0)")


# ----------------------------------------------------------------------------------------------- baselines

def cloud_only(p: Problem) -> Solution:
    return evaluate(p, "cloud_only", 0, (), ())


def edge_only_u8(p: Problem) -> Solution:
    """Everything on the edge at uniform 8 bits (check ``edge_memory_bytes <= memory_bytes`` for feasibility)."""
    return evaluate(p, "edge_only_u8", p.n, (U8,) * p.n, (U8,) * p.n)


def best_uniform_split(p: Problem, bits: int, method: str):
    """The lowest-latency split with every edge layer at ``bits`` whose edge part fits M (split 0 always fits)."""
    sols = [evaluate(p, method, n, (bits,) * n, (bits,) * n) for n in range(p.n + 1)]
    ok = [s for s in sols if s.edge_memory_bytes <= p.memory_bytes]
    return min(ok, key=lambda s: (s.latency_ms, s.sent_bytes, s.split))


def neurosurgeon(p: Problem) -> Solution:
    """Neurosurgeon: the best single split with a float (16-bit) edge part, among splits that fit M."""
    return best_uniform_split(p, FLOAT_BITS, "neurosurgeon")


def u8_split(p: Problem) -> Solution:
    """QDMP-like: the best split with the edge part at uniform 8 bits, among splits that fit M."""
    return best_uniform_split(p, U8, "u8_split")
