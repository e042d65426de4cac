"""Derivation and repair of a composed configuration: the most probable one within T_const and every limit, exact.

The configuration's log-probability under independent gates is a sum over the groups: log p_n(op) + log w_n(bits)
per layer, log q_l(module) + log s_l(bits) per link. Under a fixed split its latency, memory and energy are sums
(and maxima) of the same groups' terms (``compose.cost``), so the problem
    min -log P(config)  s.t.  T(config) <= T_const,  M_m(config) <= memory_bytes_m,  E_m(config) <= energy_mj_m
is solved exactly by dynamic programmes over Pareto frontiers (no point is dropped unless another is at least as
good in every coordinate that is summed, so the optimum is never pruned):

* chain: an option of layer n is a pair (op, weight bits), an option of a link a pair (module, transmitted bits).
  Without binding limits every group adds (latency, cost): one frontier over all groups. With limits, a device's
  memory and energy depend on its layers and on the options of the (at most two) links it touches, so the DP runs
  along the chain over the link options: for every option of its incoming and outgoing link, device m's exact
  frontier within its limits (``jmsnas.limits.device_frontier``, which enumerates the largest working set) is
  added to the frontier so far, and the union over the incoming link's options pruned again;
* mesh: T = const + A + max_b B_b, where A sums the chain part (pre, root, post layers and their links, the fork
  links' Conv-Reduce on the root and the merge links' Conv-Recover on the aggregator) and B_b branch b's terms.
  Branch options carry (B, A, cost); for every candidate value c of the max, each branch keeps its points with
  B <= c and the sum of the A frontier and the branches' (A, cost) frontiers takes the cheapest within
  T_const - const - c. Exact over the space; with limits that can bind, a mesh is refused (one line): its root's
  and aggregator's memory depend on every branch's link options together, which this DP does not model.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import limits as L
from jmsnas.compose import cost as K
from jmsnas.compose import frontier as F
from jmsnas.compose.choices import ChoiceProbs, Config, Choices, onehot, probs_from_logits
from jmsnas.compose.terms import Terms
from jmsnas.cost.energy import powers
from jmsnas.limits import DeviceLimits, LimitsError


class ComposedRepair(NamedTuple):
    config: Config  # the repaired (or unchanged) configuration
    latency_ms: float  # its T
    repaired: bool  # True if the derived configuration was over T_const or a limit and was changed
    feasible: bool  # False if no configuration meets T_const within the limits (config is then the fastest one)
    min_latency_ms: float  # the least T of the space (within the limits)
    logprob_loss: float  # log P(derived) - log P(config) >= 0


def check_logits(logits: ChoiceProbs) -> None:
    """ValueError unless every logit is finite or -inf (a masked candidate)."""
    if any(np.isnan(np.asarray(x)).any() or np.isposinf(np.asarray(x)).any() for x in logits):
        raise ValueError("the logits hold NaN or +inf: the configuration probabilities are undefined")


def derive(space, choices: Choices, logits: ChoiceProbs, probs: ChoiceProbs | None = None) -> Config:
    """The most probable configuration: the argmax of every gate (ops over their valid candidates); ``probs``:
    the logits' probabilities, where the caller has them."""
    probs = probs_from_logits(space, choices, logits) if probs is None else probs
    arg = lambda p: np.asarray(jnp.argmax(p, axis=-1), np.int32)
    return Config(*(arg(p) for p in probs))


class _Problem(NamedTuple):
    """float64 views of the terms under a fixed split. Layer options: column i * Bw + b; link options: k * Ba + a."""

    dev: np.ndarray  # int[N] device of every layer
    stem: int  # the stem's device
    bounds: np.ndarray  # int[L] boundary of every link
    lat: np.ndarray  # [N, R * Bw] ms on the layer's device
    cost: np.ndarray  # [N, R * Bw] -log p - log w
    valid: np.ndarray  # [N, R * Bw]
    link_cost: np.ndarray  # [L, K * Ba] -log q - log s
    eps: np.ndarray  # [L, K * Ba] ms on the wire
    send: np.ndarray  # [L, K * Ba] Conv-Reduce ms on the sender
    recv: np.ndarray  # [L, K * Ba] Conv-Recover ms on the receiver
    wire: np.ndarray  # [L, K * Ba] bytes
    link_valid: np.ndarray  # [K * Ba] the link options a link may take (the module "none" only when optional)
    width: int  # N + L: the length of a picks row


_link_boundaries = jax.jit(K.link_boundaries, static_argnums=0)  # one call per split instead of dozens of small ones


@jax.jit
def _link_ms(table, wire):
    """``cost.latency.link_ms`` of every link l at its bytes ``wire[l]``: one call."""
    return jnp.stack([K.link_ms(table, l, wire[l]) for l in range(wire.shape[0])])


def _problem(space, table, terms: Terms, choices: Choices, probs: ChoiceProbs, assignment) -> _Problem:
    f = lambda x: np.asarray(x, np.float64)
    topo, n = space.topology, space.num_layers
    dev, stem = (np.asarray(x) for x in K.split_devices(space, assignment))
    bounds = np.asarray(_link_boundaries(space, None if assignment is None else jnp.asarray(assignment)))
    lm = f(terms.layer_ms)[dev, np.arange(n)]  # [N, R, Bw]
    nb = lm.shape[-1]
    logp = lambda p: np.log(np.maximum(f(p), 1e-30))
    cost = -(logp(probs.ops)[:, :, None] + logp(probs.weight_bits)[:, None, :])
    valid = np.repeat(space.mask()[:, :, None], nb, -1)
    links = len(topo.links)
    ka = lambda x: x.reshape(links, -1)
    src, dst = (np.array([topo.device_names.index(getattr(l, e)) for l in topo.links], np.int64)
                for e in ("src", "dst"))
    wire = f(terms.wire_bytes)[bounds]  # [L, K, Ba]
    eps = f(_link_ms(table, jnp.asarray(wire, jnp.float32))) if links else wire
    na = wire.shape[-1]
    rep = lambda x: np.repeat(x[..., None], na, -1)
    send = rep(f(terms.send_ms)[src, bounds]) if links else wire
    recv = rep(f(terms.recv_ms)[dst, bounds]) if links else wire
    lcost = -(logp(probs.module)[:, :, None] + logp(probs.act_bits)[:, None, :])
    link_valid = np.repeat(choices.group_masks()[1], na)
    return _Problem(dev, int(stem), bounds, lm.reshape(n, -1), cost.reshape(n, -1), valid.reshape(n, -1), ka(lcost), ka(eps),
                    ka(send), ka(recv), ka(wire), link_valid, n + links)


def _group(P: _Problem, pos: int, cols, values) -> tuple:
    """The options ``cols`` of one group (a layer: pos < N; a link: N + l) as a (points, picks) frontier; ``values``
    are that group's whole rows (latency, ..., cost)."""
    picks = np.full((len(cols), P.width), -1, np.int64)
    picks[:, pos] = cols
    return F.pareto(np.stack([v[cols] for v in values], 1), picks)


def _layer_group(P, n, extra=0):
    cols = np.flatnonzero(P.valid[n])
    return _group(P, n, cols, [P.lat[n]] + [np.zeros(P.lat.shape[1])] * extra + [P.cost[n]])


def _to_config(P: _Problem, picks, nb, na) -> Config:
    n = len(P.dev)
    lay, lk = picks[:n], picks[n:]
    return Config((lay // nb).astype(np.int32), (lay % nb).astype(np.int32), (lk // na).astype(np.int32),
                  (lk % na).astype(np.int32))


class _Device(NamedTuple):
    """The duck type ``jmsnas.limits.device_frontier`` reads: one device's layers and terms under fixed links."""

    layers: np.ndarray
    weight: np.ndarray
    act: np.ndarray
    energy: np.ndarray
    mem_const: float
    act_floor: float
    energy_const: float
    mem_limit: float
    energy_limit: float


class _Limited(NamedTuple):
    """What a device's frontier within its limits reads besides its layers and its links' options."""

    space: object
    table: object
    limits: DeviceLimits
    P: _Problem
    na: int
    send: tuple  # (weight bytes [J, K], activation bytes [J, K]) of the Conv-Reduce at boundary j, reduction k
    recv: tuple  # the same of the Conv-Recover
    weight: np.ndarray  # [N, R * Bw] bytes of every layer option's weights on the layer's own device
    act: np.ndarray  # [N, R * Bw] bytes of its activations
    energy: np.ndarray  # [N, R * Bw] mJ of its compute
    active: np.ndarray  # [M] W computing
    tx: np.ndarray  # [L] W transmitting
    rx: np.ndarray  # [L] W receiving
    air: np.ndarray  # [L, K * Ba] ms on the air of every link option


def _limited(space, table, terms, limits: DeviceLimits, P: _Problem, nb: int, na: int) -> _Limited:
    f = lambda x: np.asarray(x, np.float64)
    n = space.num_layers
    active, tx, rx = powers(space.topology)
    return _Limited(space, table, limits, P, na, (f(terms.send_weight), f(terms.send_act)),
                    (f(terms.recv_weight), f(terms.recv_act)), f(terms.weight_bytes)[P.dev, np.arange(n)].reshape(n, -1),
                    np.repeat(f(limits.mem.act_bytes)[:, :, None], nb, -1).reshape(n, -1),
                    active[P.dev][:, None] * P.lat, active, tx, rx,
                    P.wire * 8.0 / (f(table.bandwidth_mbps)[:, None] * 1e3))


def _link_side(X: _Limited, m: int, l: int, c: int, sending: bool) -> tuple:
    """(bytes held, activation floor, mJ) device m spends on link l's option c: the wire buffer and its end of the
    module (Conv-Reduce when ``sending``, else Conv-Recover), and the radio's energy."""
    P = X.P
    j, k = P.bounds[l], c // X.na
    weight, act = X.send if sending else X.recv
    ms = P.send[l, c] if sending else P.recv[l, c]
    power = X.tx[l] if sending else X.rx[l]
    return float(weight[j, k]) + P.wire[l, c], float(act[j, k]), X.active[m] * ms + power * X.air[l, c]


def _device_front(X: _Limited, m: int, ins=(), outs=(), extra=(0.0, 0.0, 0.0)):
    """Device m's exact (latency, cost) frontier within its limits (``jmsnas.limits.device_frontier``, which
    enumerates the largest working set), its incoming links ``ins`` and outgoing ``outs`` at the given options
    [(link, option)], plus ``extra`` (bytes held, activation floor, mJ) of links counted elsewhere."""
    P, mem, table = X.P, X.limits.mem, X.table
    topo = X.space.topology
    first, last, stem = topo.path_order()[0], topo.path_order()[-1], P.stem
    const = float(table.input_bytes) * (m == first) + float(mem.stem_weight_bytes) * (m == stem) \
        + float(mem.head_weight_bytes) * (m == last) + extra[0]
    floor = max([float(mem.stem_act_bytes)] * (m == stem) + [float(mem.head_act_bytes)] * (m == last)
                + [0.0, extra[1]])
    e = X.active[m] * (float(table.stem_ms[m]) * (m == stem) + float(table.head_ms[m]) * (m == last)) + extra[2]
    for (l, c), sending in [(io, False) for io in ins] + [(io, True) for io in outs]:
        b, a, en = _link_side(X, m, l, c, sending)
        const, floor, e = const + b, max(floor, a), e + en
    d = _Device(np.flatnonzero(P.dev == m), X.weight, X.act, X.energy, const, floor, e,
                F.slack(X.limits.memory_bytes[m]), F.slack(X.limits.energy_mj[m]))
    lat, cost, picks = L.device_frontier(d, P.lat, P.cost, P.valid)
    rows = np.full((len(lat), P.width), -1, np.int64)
    rows[:, d.layers] = picks
    return np.stack([lat, cost], 1), rows


def _link_option(P: _Problem, l: int, c: int):
    """Link l at option c as a (latency on the chain part, cost) frontier of one point."""
    n = len(P.dev)
    return _group(P, n + l, np.array([c]), [P.eps[l] + P.send[l] + P.recv[l], P.link_cost[l]])


def _chain_dp(X: _Limited, order: list, head=None, tail=None):
    """The exact (latency, cost) frontier of the devices ``order`` (a chain: consecutive devices joined by a link)
    within their limits, as a dict keyed by the option of the link ``head`` into the first device (None: none) and
    of the link ``tail`` out of the last (None: none): {(c_head, c_tail): frontier}; the links between them
    included, ``head`` and ``tail`` not. The DP runs along the chain over the link options."""
    P, topo = X.P, X.space.topology
    opts = np.flatnonzero(P.link_valid)
    links = [topo.link_index(order[p], order[p + 1]) for p in range(len(order) - 1)]
    out = {}
    for c_head in (opts if head is not None else [None]):
        ins = [] if head is None else [(head, c_head)]
        for c_tail in (opts if tail is not None else [None]):
            outs = [] if tail is None else [(tail, c_tail)]
            if not links:
                out[c_head, c_tail] = _device_front(X, order[0], ins, outs)
                continue
            fronts = {c: F.add(_device_front(X, order[0], ins, [(links[0], c)]), _link_option(P, links[0], c))
                      for c in opts}
            for p in range(1, len(order)):
                l_in = links[p - 1]
                l_out = links[p] if p < len(links) else None
                new = {}
                for c_out in (opts if l_out is not None else [None]):
                    o = [(l_out, c_out)] if l_out is not None else outs
                    parts = [F.add(fronts[c], _device_front(X, order[p], [(l_in, c)], o)) for c in fronts]
                    u = F.union(parts)
                    if u is not None and l_out is not None:
                        u = F.add(u, _link_option(P, l_out, c_out))
                    new[c_out] = u
                fronts = {c: v for c, v in new.items() if v is not None}
                if not fronts:
                    break
            if fronts:
                out[c_head, c_tail] = fronts[None]
    return {k: v for k, v in out.items() if len(v[0])}


def _chain_with_limits(space, table, terms, limits: DeviceLimits, P: _Problem, nb, na):
    """The exact (latency, cost) frontier of a chain within every device's limits (the DP over link options)."""
    X = _limited(space, table, terms, limits, P, nb, na)
    return _chain_dp(X, list(space.topology.pre)).get((None, None))


def _mesh(space, P: _Problem, terms):
    """(A frontier (A, cost), per-branch frontiers (B, A, cost)) of a mesh under a fixed split."""
    topo, n = space.topology, space.num_layers
    front_a = (np.zeros((1, 2)), np.full((1, P.width), -1, np.int64))
    for m in list(topo.pre) + [topo.root] + list(topo.post):
        for layer in np.flatnonzero(P.dev == m):
            front_a = F.add(front_a, _layer_group(P, layer))
    seq = list(topo.pre) + [topo.root]
    for a, b in list(zip(seq, seq[1:])) + list(zip(topo.post, topo.post[1:])):
        l = topo.link_index(a, b)
        cols = np.flatnonzero(P.link_valid)
        front_a = F.add(front_a, _group(P, n + l, cols, [P.eps[l] + P.send[l] + P.recv[l], P.link_cost[l]]))
    branches = []
    cols = np.flatnonzero(P.link_valid)
    for b in topo.branches:
        fb = (np.zeros((1, 3)), np.full((1, P.width), -1, np.int64))
        for layer in np.flatnonzero(P.dev == b):
            fb = F.add(fb, _layer_group(P, layer, extra=1))
        down, up = topo.link_index(topo.root, b), topo.link_index(b, topo.post[0])
        fb = F.add(fb, _group(P, n + down, cols, [P.eps[down] + P.recv[down], P.send[down], P.link_cost[down]]))
        fb = F.add(fb, _group(P, n + up, cols, [P.eps[up] + P.send[up], P.recv[up], P.link_cost[up]]))
        branches.append(fb)
    return front_a, branches


def _sum_max(f, g, maxcols: int):
    """Minkowski combination of two (points, picks) frontiers whose last ``maxcols`` coordinates combine by max (the
    other ones add), pruned."""
    a, b = f[0][:, None], g[0][None]
    k = f[0].shape[1] - maxcols
    pts = np.concatenate([(a[..., :k] + b[..., :k]), np.maximum(a[..., k:], b[..., k:])], -1).reshape(-1,
                                                                                                     f[0].shape[1])
    picks = np.maximum(f[1][:, None], g[1][None]).reshape(-1, f[1].shape[1])
    return F.pareto(pts, picks)


def _mesh_with_limits(space, table, terms, limits: DeviceLimits, P: _Problem, nb, na, budget, base):
    """(cheapest picks with base + T within budget or None, least T - base, its picks) of a mesh within every
    device's limits, exact (module docstring); None when no configuration is within them.

    T - base = A + max_b B_b. The root's and the aggregator's memory and energy depend on every branch's fork (merge)
    link option together, through sums (bytes held, mJ) and a max (the activation floor): each branch option
    carries the part it adds to the root's and the aggregator's (only the coordinates of a device with a finite
    limit), the branches combine by sum and max, and the root's and aggregator's frontiers are computed for each
    combination that remains (once per distinct value). For every candidate value c of the max, each branch keeps
    per (fork option, merge option) its cheapest point with B <= c."""
    X = _limited(space, table, terms, limits, P, nb, na)
    topo = space.topology
    opts = np.flatnonzero(P.link_valid)
    root, agg = topo.root, topo.post[0]
    n = space.num_layers
    pre, post = list(topo.pre), list(topo.post)
    l_in = topo.link_index(pre[-1], root) if pre else None
    l_out = topo.link_index(post[0], post[1]) if len(post) > 1 else None
    up = {c: f for (_, c), f in _chain_dp(X, pre, tail=l_in).items()} if pre else {None: None}
    down = {c: f for (c, _), f in _chain_dp(X, post[1:], head=l_out).items()} if l_out is not None else {None: None}
    if not up or not down:
        return None, np.inf, None
    up = {c: f if c is None else F.add(f, _link_option(P, l_in, c)) for c, f in up.items()}  # with the root's link
    used = lambda m: [bool(np.isfinite(limits.memory_bytes[m]))] * 2 + [bool(np.isfinite(limits.energy_mj[m]))]
    r_use, a_use = used(root), used(agg)

    options = []  # per branch: rows [B, A, cost, root sums/max..., agg sums/max...] and picks
    for b in topo.branches:
        d, u = topo.link_index(root, b), topo.link_index(b, agg)
        pts, picks = [], []
        for cd in opts:
            rs = np.compress(r_use, _link_side(X, root, d, cd, True))
            for cu in opts:
                fb = _device_front(X, b, [(d, cd)], [(u, cu)])
                if not len(fb[0]):
                    continue
                as_ = np.compress(a_use, _link_side(X, agg, u, cu, False))
                big = fb[0][:, 0] + P.eps[d, cd] + P.recv[d, cd] + P.eps[u, cu] + P.send[u, cu]
                small = P.send[d, cd] + P.recv[u, cu]
                cost = fb[0][:, 1] + P.link_cost[d, cd] + P.link_cost[u, cu]
                k = len(big)
                pts.append(np.column_stack([big, np.full(k, small), cost, np.tile(rs, (k, 1)), np.tile(as_, (k, 1))]))
                pk = fb[1].copy()
                pk[:, n + d], pk[:, n + u] = cd, cu
                picks.append(pk)
        if not pts:
            return None, np.inf, None
        options.append((np.concatenate(pts), np.concatenate(picks)))

    # the coordinates after (A, cost): root's [bytes, floor, mJ] then the aggregator's, those in use; floors take max
    names = [("r", i) for i in range(3) if r_use[i]] + [("a", i) for i in range(3) if a_use[i]]
    sums = [q for q, (_, i) in enumerate(names) if i != 1]
    maxes = [q for q, (_, i) in enumerate(names) if i == 1]
    perm = [0, 1] + [2 + q for q in sums] + [2 + q for q in maxes]  # (A, cost, sums..., maxima...)
    at = [perm.index(2 + q) for q in range(len(names))]  # where each of ``names`` sits in a combined row

    def sides(row):  # the root's and the aggregator's extra (bytes, floor, mJ) of a combined row
        extra = {"r": [0.0, 0.0, 0.0], "a": [0.0, 0.0, 0.0]}
        for (who, i), pos in zip(names, at):
            extra[who][i] = float(row[pos])
        return tuple(extra["r"]), tuple(extra["a"])

    ends = {}

    def end_front(extra_r, extra_a):  # up + root + aggregator + down, within their limits (None: none fits)
        key = (extra_r, extra_a)
        if key not in ends:
            root_f = F.union([F.add(up[c], _device_front(X, root, [(l_in, c)], [], extra_r)) if c is not None else
                              _device_front(X, root, [], [], extra_r) for c in up])
            agg_f = F.union([F.add(F.add(_device_front(X, agg, [], [(l_out, c)], extra_a), _link_option(P, l_out, c)),
                                   down[c]) if c is not None else _device_front(X, agg, [], [], extra_a)
                             for c in down])
            ends[key] = None if root_f is None or agg_f is None else F.add(root_f, agg_f)
        return ends[key]

    caps = np.unique(np.concatenate([o[0][:, 0] for o in options]))
    best, t_min, fastest = None, np.inf, None
    for cap in caps:
        total = (np.zeros((1, len(perm))), np.full((1, P.width), -1, np.int64))
        for pts, picks in options:
            ok = pts[:, 0] <= cap
            if not ok.any():
                total = None
                break
            rows = pts[ok][:, 1:][:, perm]
            total = _sum_max(total, F.pareto(rows, picks[ok]), len(maxes))
        if total is None:
            continue
        for row, pk in zip(*total):
            end = end_front(*sides(row))
            if end is None:
                continue
            lat = cap + row[0] + end[0][:, 0]
            cost = row[1] + end[0][:, 1]
            i = int(np.argmin(lat))
            if lat[i] < t_min:
                t_min, fastest = lat[i], np.maximum(pk, end[1][i])
            ok = np.flatnonzero(F.within(base + lat, budget))
            if len(ok):
                j = ok[np.argmin(cost[ok])]
                if best is None or cost[j] < best[0]:
                    best = (cost[j], np.maximum(pk, end[1][j]))
    if fastest is None:
        return None, np.inf, None
    return (None if best is None else best[1]), t_min, fastest


def _mesh_best(front_a, branches, budget, base=0.0):
    """(cheapest picks with base + A + max_b B_b within budget or None, least A + max B, its picks)."""
    caps = np.unique(np.concatenate([f[0][:, 0] for f in branches]))
    best, t_min, fastest = None, np.inf, None
    for cap in caps:
        total = front_a
        for f in branches:
            ok = f[0][:, 0] <= cap
            if not ok.any():
                total = None
                break
            total = F.add(total, F.pareto(f[0][ok][:, 1:], f[1][ok]))
        if total is None:
            continue
        if cap + total[0][0, 0] < t_min:
            t_min, fastest = cap + total[0][0, 0], total[1][0]
        ok = np.flatnonzero(F.within(base + cap + total[0][:, 0], budget))
        if len(ok):
            j = ok[np.argmin(total[0][ok, 1])]
            if best is None or total[0][j, 1] < best[0]:
                best = (total[0][j, 1], total[1][j])
    return (None if best is None else best[1]), t_min, fastest


def _evaluate_impl(space, table, terms, probs, mem, assignment):
    """(T ms, memory bytes [M] or None, energy mJ [M]) of one-hot ``probs``: one compiled call per space."""
    t = K.latency(space, table, terms, probs, assignment).total
    m = None if mem is None else K.memory(space, mem, table, terms, probs, assignment).total
    return t, m, K.energy(space, table, terms, probs, assignment).per_device


_evaluate = jax.jit(_evaluate_impl, static_argnums=0)


def _fits(space, table, terms, choices, limits, config, assignment, t_const_ms):
    probs = onehot(space, choices, config)
    a = jnp.asarray(space.layer_devices() if assignment is None else assignment, jnp.int32)
    t, mem, en = _evaluate(space, table, terms, probs, None if limits is None else limits.mem, a)
    ok = bool(F.within(float(t), t_const_ms))
    if limits is not None:
        ok = ok and bool(np.all(F.within(np.asarray(mem, np.float64), limits.memory_bytes))
                         and np.all(F.within(np.asarray(en, np.float64), limits.energy_mj)))
    return ok, float(t)


def _logp(P: _Problem, picks) -> float:
    n = len(P.dev)
    return -float(P.cost[np.arange(n), picks[:n]].sum() + P.link_cost[np.arange(P.width - n), picks[n:]].sum())


def repair(space, table, terms: Terms, choices: Choices, logits: ChoiceProbs, t_const_ms: float, assignment=None,
           limits: DeviceLimits | None = None, probs: ChoiceProbs | None = None) -> ComposedRepair:
    """The most probable configuration with T <= ``t_const_ms`` (ms) and, with ``limits``, every device within
    its memory_bytes and energy_mj under the split ``assignment`` (D^m by default); the derived one when it fits.
    ``probs``: the logits' probabilities, where the caller has them (``anysplit`` repairs one logits under many
    splits). Raises ``LimitsError`` (one line) when no configuration keeps every device within its limits, and
    ValueError for a mesh whose limits can bind (see the module's docstring)."""
    check_logits(logits)
    topo = space.topology
    probs = probs_from_logits(space, choices, logits) if probs is None else probs
    P = _problem(space, table, terms, choices, probs, assignment)
    nb, na = len(choices.weight_bits), len(choices.act_bits)
    derived = derive(space, choices, logits, probs)
    if limits is not None and (np.isfinite(limits.memory_bytes).any() or np.isfinite(limits.energy_mj).any()):
        if topo.kind not in ("chain", "mesh"):
            raise ValueError(f"the composed repair with memory or energy limits is exact on chains and meshes; "
                             f"topology {topo.name!r} is a {topo.kind}: remove its devices' limits")
    else:
        limits = None
    const = float(table.stem_ms[P.stem]) + float(table.head_ms[topo.path_order()[-1]])
    if topo.kind == "chain":
        if limits is None:
            front = (np.zeros((1, 2)), np.full((1, P.width), -1, np.int64))
            for layer in range(space.num_layers):
                front = F.add(front, _layer_group(P, layer))
            cols = np.flatnonzero(P.link_valid)
            for l in range(len(topo.links)):
                front = F.add(front, _group(P, space.num_layers + l, cols,
                                           [P.eps[l] + P.send[l] + P.recv[l], P.link_cost[l]]))
        else:
            front = _chain_with_limits(space, table, terms, limits, P, nb, na)
            if front is None:
                raise LimitsError("no configuration of the composed space keeps every device within its memory and "
                                  "energy limits under this split")
        best = F.cheapest(front, t_const_ms, const)
        t_min, fastest = const + front[0][0, 0], front[1][0]
    elif limits is None:
        front_a, branches = _mesh(space, P, terms)
        best, t_min, fastest = _mesh_best(front_a, branches, t_const_ms, const)
        t_min += const
    else:
        best, t_min, fastest = _mesh_with_limits(space, table, terms, limits, P, nb, na, t_const_ms, const)
        if fastest is None:
            raise LimitsError("no configuration of the composed space keeps every device within its memory and "
                              "energy limits under this split")
        t_min += const
    ok, t_derived = _fits(space, table, terms, choices, limits, derived, assignment, t_const_ms)
    if ok:
        return ComposedRepair(derived, t_derived, False, True, t_min, 0.0)
    picks = fastest if best is None else best
    config = _to_config(P, picks, nb, na)
    derived_picks = np.concatenate([derived.ops * nb + derived.weight_bits, derived.module * na + derived.act_bits])
    t = _fits(space, table, terms, choices, limits, config, assignment, t_const_ms)[1]
    return ComposedRepair(config, t, True, best is not None, t_min, _logp(P, derived_picks) - _logp(P, picks))
