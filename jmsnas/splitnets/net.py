"""The split-aware supernet as pure functions: ``init(key, space, init_mode)`` and ``apply``.

Every slot holds one widest MBConv (kernel ``kmax``, expansion ``emax``) whose centred k x k window and first
c_in * e channels a candidate uses (weights masked, one program for every candidate: the ops, depth and d of an
architecture are traced values, so one compilation serves the whole space). Batch norm is shared by the candidates
of a slot; evaluations recalibrate it per architecture (``recalibrate``).

Views are folded into the batch on the sensor side: x float32[B, V, H, W, C] runs as [B * V, H, W, C] through the
stem and the on-sensor blocks (weights shared across views), the split module's reduce sends d channels per view,
and the aggregator's recover (V = 1) or View-Fuse (V > 1) continues on [B, ...]. The split position changes where
that fold ends, so ``apply`` is a ``lax.switch`` over the positions (one branch per position, each the whole
network with its split at that place). With ``space.shared`` the on-aggregator blocks use the on-sensor weights
(single view, section 3.1.1), otherwise their own (multi-view, section 3.1.2).

``module="none"`` gives the baselines' networks without a split module at the same place: V = 1 sends the c
channels unchanged, V > 1 averages the V views' c-channel features (fusion without parameters).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas.space import OpSpec
from jmsnas.splitnets import module as SM
from jmsnas.splitnets.space import SplitSpace

_ZERO_STATS_SCALE = 1.0 / (1.0 - O.BN_MOMENTUM)


def _block_init(key, space: SplitSpace, p: int, b: int):
    c_in, c_out, _, _, _ = space.slot(p, b)
    return O.mbconv_init(key, OpSpec("widest", space.kmax, space.emax, False), c_in, c_out)


def _side_init(key, space: SplitSpace):
    keys = jax.random.split(key, space.num_slots)
    blocks = [_block_init(keys[p * space.max_depth + b], space, p, b)
              for p in range(space.num_phases) for b in range(space.max_depth)]
    return tuple(x[0] for x in blocks), tuple(x[1] for x in blocks)


def init(key, space: SplitSpace, init_mode: str = "geometric"):
    """(params, state): ``stem``, ``sensor`` (one widest block per slot), ``aggregator`` (absent when shared),
    ``modules`` (one split module per phase, ``module.init`` with ``init_mode``), ``head``."""
    k_stem, k_sen, k_agg, k_mod, k_head = jax.random.split(key, 5)
    params, state = {}, {}
    params["stem"], state["stem"] = O.conv_bn_init(k_stem, 3, space.in_channels, space.stem_channels)
    params["sensor"], state["sensor"] = _side_init(k_sen, space)
    if not space.shared:
        params["aggregator"], state["aggregator"] = _side_init(k_agg, space)
    params["modules"] = tuple(SM.init(k, c, space.d_max(p), space.views, space.split_kernel, init_mode)
                              for p, (k, c) in enumerate(zip(jax.random.split(k_mod, space.num_phases),
                                                             space.phase_channels)))
    params["head"], state["head"] = O.head_init(k_head, space.phase_channels[-1], space.head_channels,
                                                space.num_classes)
    return params, state


def _tables(space: SplitSpace):
    """Static lookup tables: kernel mask float[O, kmax, kmax, 1], expansion of each op int[O], d float[P, R]."""
    km = np.zeros((len(space.op_choices), space.kmax, space.kmax, 1), np.float32)
    for o, (k, _) in enumerate(space.op_choices):
        lo = (space.kmax - k) // 2
        km[o, lo:lo + k, lo:lo + k] = 1.0
    ex = np.array([e for _, e in space.op_choices], np.int32)
    dd = np.array([space.d_choices(p) for p in range(space.num_phases)], np.int32)
    return jnp.asarray(km), jnp.asarray(ex), jnp.asarray(dd)


def _block(space: SplitSpace, p: int, b: int, params, state, x, o, active, train: bool):
    """Slot (p, b) with traced op index o and traced active flag; an inactive slot passes x through."""
    km, ex, _ = _tables(space)
    c_in, _, _, _, stride = space.slot(p, b)
    mid_max = c_in * space.emax
    cm = (jnp.arange(mid_max) < c_in * ex[o]).astype(jnp.float32)
    q = {"expand": params["expand"] * cm, "dw": params["dw"] * km[o] * cm, "project": params["project"] * cm[:, None],
         "bn3": params["bn3"]}
    for name in ("bn1", "bn2"):
        q[name] = {k: v * cm for k, v in params[name].items()}
    residual = space.residual(p, b)
    y, new = O.mbconv_apply(q, state, x, OpSpec("padded", space.kmax, 0, residual), stride, train)
    if b == 0:
        return y, new
    return jnp.where(active, y, x), jax.tree_util.tree_map(lambda a, c: jnp.where(active, a, c), new, state)


def _forward_at(space: SplitSpace, pos: tuple, module: str, params, state, genes, extras, x, train: bool):
    """The whole network with the split at ``pos`` = (phase, m) (static; (0, 0): right after the stem).

    genes int32[G], extras float32[P] (1: an extra reduce/recover in that phase after slot 0; single view only),
    x float32[B, V, H, W, C]. Returns (logits float32[B, classes], new state)."""
    _, _, dd = _tables(space)
    P, D, V = space.num_phases, space.max_depth, space.views
    bsz = x.shape[0]
    h = x.reshape((bsz * V,) + x.shape[2:])
    new = {"modules": ()}
    h, new["stem"] = O.conv_bn_apply(params["stem"], state["stem"], h, 1, train)
    sides = {"sensor": list(state["sensor"])}
    if not space.shared:
        sides["aggregator"] = list(state["aggregator"])
    side = "sensor"

    def split(h, p):
        if module == "none":
            return h if V == 1 else h.reshape((bsz, V) + h.shape[1:]).mean(axis=1)
        d = dd[p, genes[P * D + P + 2]]
        return SM.apply(params["modules"][p], h, d, V)

    if pos == (0, 0):
        h, side = split(h, 0), ("sensor" if space.shared else "aggregator")
    for p in range(P):
        for b in range(D):
            i = p * D + b
            w = params[side if not space.shared else "sensor"][i]
            st = sides[side if not space.shared else "sensor"][i]
            h, st = _block(space, p, b, w, st, h, genes[i], b < genes[P * D + p] + 1, train)
            sides[side if not space.shared else "sensor"][i] = st
            if (p, b + 1) == pos:
                h, side = split(h, p), ("sensor" if space.shared else "aggregator")
            elif b == 0 and V == 1 and module != "none" and extras is not None and p != pos[0]:
                d = dd[p, genes[P * D + P + 2]]
                h = jnp.where(extras[p] > 0, SM.apply(params["modules"][p], h, d, 1), h)
    logits, new["head"] = O.head_apply(params["head"], state["head"], h, train)
    new["sensor"] = tuple(sides["sensor"])
    if not space.shared:
        new["aggregator"] = tuple(sides["aggregator"])
    del new["modules"]
    return logits, new


def position_index(space: SplitSpace, genes):
    """Traced index into ``space.positions`` of a gene vector (the offset clamped to the phase's depth)."""
    P, D = space.num_phases, space.max_depth
    p = genes[P * D + P]
    depth = jnp.asarray(genes)[P * D:P * D + P][p] + 1
    m = jnp.minimum(genes[P * D + P + 1] + 1, depth)
    return p * D + m - 1


def apply(space: SplitSpace, params, state, genes, x, *, train: bool, extras=None):
    """Logits float32[B, classes] and the new BN state of the architecture ``genes`` int32[G] (traced) on
    x float32[B, V, H, W, C]; ``extras`` float32[P] adds training-time split modules (single view)."""
    genes = jnp.asarray(genes, jnp.int32)
    branches = [lambda pr, st, g, ex, xx, pos=pos: _forward_at(space, pos, "split", pr, st, g, ex, xx, train)
                for pos in space.positions]
    return jax.lax.switch(position_index(space, genes), branches, params, state, genes, extras, x)


def apply_fixed(space: SplitSpace, params, state, genes, x, *, train: bool, pos: tuple, module: str = "split"):
    """The network at a static split position ``pos`` ((0, 0): after the stem), with (``"split"``) or without
    (``"none"``) the split module; for the baselines."""
    return _forward_at(space, pos, module, params, state, jnp.asarray(genes, jnp.int32), None, x, train)


def recalibrate(fwd, params, state, calib_x):
    """BN statistics of one architecture: the average over K calibration batches (calib_x float32[K, B, ...]) of
    each batch's mean and biased variance (``fwd(params, state, x, train=True) -> (logits, new_state)``); only the
    shapes of ``state`` are used (arrays, or ``jax.ShapeDtypeStruct``s)."""
    zero = jax.tree_util.tree_map(jnp.zeros_like, state)
    stats = jax.lax.map(lambda xk: fwd(params, zero, xk, True)[1], calib_x)
    return jax.tree_util.tree_map(lambda a: jnp.mean(a, axis=0) * _ZERO_STATS_SCALE, stats)
