"""Batched evaluation of a population of sub-networks of the supernet (loss, accuracy, latency per architecture).

``evaluate_population`` is one jitted function of a population ``ops`` int32[P, N]: it compiles once per
population size P (and space, batch shapes and static options) and returns, for every architecture, what
``supernet.apply`` with its one-hot gates gives in eval mode. It does less work than P single evaluations:

* the stem does not depend on the architecture and runs once;
* layer 0 reads the shared stem output, so each of its valid candidates runs once and architectures pick theirs;
* architectures that share a prefix (the same ops in layers 0..n) share layer n's output, which is computed
  once (``share_prefixes``): evolution's children repeat most of their parents' layers, and duplicates cost
  nothing past the head;
* at every later layer the population is sorted by its candidate's (kernel, expansion) class and cut into chunks
  of ``chunk`` architectures; ``lax.map`` walks the chunks and ``lax.switch`` runs each chunk as one MBConv
  ``vmap``-ped over its architectures, padded only to the widest kernel and expansion in that chunk (a chunk of
  identities, or of repeated prefixes, runs nothing). Activations stay in each layer's sorted order and the next
  layer gathers its chunk's rows through an index map, so no population-sized permutation copy is made;
* the MBConv runs channels-first ([C, B, H, W]) with eval-mode batch norm folded into the convolution weights,
  and on small images the depthwise convolution is one matmul per channel with the convolution's matrix (the
  shifted-slice form is slow on XLA:CPU at 2x2-8x8, where most taps fall in the padding).

Plain ``vmap`` of the single-architecture evaluation is no answer on its own: the supernet picks each layer's
candidate with ``lax.switch``, which under ``vmap`` becomes a select that runs every candidate.

Batch-norm recalibration (``bn_batches`` float[K, B, H, W, C]): every architecture's statistics are re-estimated
in train mode on the K batches (all architectures at once, by the same chunked path), as the exact average over
the K batches of each batch's per-channel mean and biased variance (OFA's ``set_running_statistics``, not a
momentum average); the batch ``x`` is then evaluated in eval mode with those statistics. Without ``bn_batches``
the supernet's running statistics of each chosen candidate are used.

``evaluate_loop`` is the obvious alternative and the oracle: a Python loop over architectures of one jitted
single-architecture evaluation through ``supernet.apply`` with one-hot gates.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas import ops as O
from jmsnas import supernet as SN
from jmsnas.cost.latency import arch_latency
from jmsnas.dwconv import depthwise_conv, resolve_impl, same_padding
from jmsnas.gates import onehot_gates
from jmsnas.objectives import cross_entropy
from jmsnas.space import NUM_OPS, OPS, SearchSpace

_ZERO_STATS_SCALE = 1.0 / (1.0 - O.BN_MOMENTUM)  # train-mode BN from zero running stats returns (1 - m) * batch


class _Classes(NamedTuple):
    """Static per-layer branch table: branch b pads to (kernel[b], expand[b]); branch 0 is identity."""

    kernels: tuple  # distinct kernel sizes of the valid MBConvs, ascending
    expands: tuple  # distinct expansions, ascending
    k_index: np.ndarray  # int32[V]: 1 + index into kernels (0 for identity)
    e_index: np.ndarray  # int32[V]: 1 + index into expands (0 for identity)
    rank: np.ndarray  # int32[V]: sort key (identity first, then by kernel, then expansion)
    has_identity: bool


def _classes(space: SearchSpace, n: int) -> _Classes:
    lay = SN.layout(space, n)
    conv = [OPS[i] for i in lay.valid if not OPS[i].is_identity]
    ks, es = tuple(sorted({o.kernel for o in conv})), tuple(sorted({o.expand for o in conv}))
    ki = np.array([0 if OPS[i].is_identity else 1 + ks.index(OPS[i].kernel) for i in lay.valid], np.int32)
    ei = np.array([0 if OPS[i].is_identity else 1 + es.index(OPS[i].expand) for i in lay.valid], np.int32)
    return _Classes(ks, es, ki, ei, ki * (len(es) + 1) + ei, bool((ki == 0).any()))


def _branch_of(cl: _Classes, kmax_idx, emax_idx):
    """Branch index for a chunk whose widest kernel/expansion indices are (kmax_idx, emax_idx) (0 = identity)."""
    return jnp.where(kmax_idx == 0, 0, int(cl.has_identity) + (kmax_idx - 1) * len(cl.expands) + (emax_idx - 1))


def _candidate_params(space: SearchSpace, n: int, params_n, vs, k: int, e: int):
    """Parameters of candidates at positions vs int32[c] of layer n, cropped to a k x k window and in_ch * e
    channels and masked to each candidate's own window and channels: a pytree of [c, ...] arrays."""
    s, lay = space.layers[n], SN.layout(space, n)
    mid, lo = s.in_ch * e, (lay.kmax - k) // 2
    cm = jnp.asarray(lay.cmask)[vs][:, :mid]
    km = jnp.asarray(lay.kmask)[vs][:, lo:lo + k, lo:lo + k]
    ws = jnp.zeros_like(vs) if SN.is_shared(params_n) else vs  # one superkernel, or one weight set per candidate
    p = {"expand": params_n["expand"][ws][:, :, :mid] * cm[:, None, :],
         "dw": params_n["dw"][ws][:, lo:lo + k, lo:lo + k, :mid] * km * cm[:, None, None, :],
         "project": params_n["project"][ws][:, :mid] * cm[:, :, None],
         "bn3": jax.tree_util.tree_map(lambda a: a[vs], params_n["bn3"])}
    for name in ("bn1", "bn2"):
        p[name] = {key: a[vs][:, :mid] * cm for key, a in params_n[name].items()}
    return p


def _crop_stats(stats, mid: int):
    return {name: {key: (a[:, :mid] if name != "bn3" else a) for key, a in st.items()} for name, st in stats.items()}


def _pad_stats(stats, mid_max: int):
    pad = lambda a: jnp.pad(a, ((0, 0), (0, mid_max - a.shape[1])))
    return {name: {key: (pad(a) if name != "bn3" else a) for key, a in st.items()} for name, st in stats.items()}


def _zero_stats(space: SearchSpace, n: int, c: int):
    """All-zero BN statistics of c candidates of layer n (padded widths), float32[c, ch] leaves."""
    s, mid_max = space.layers[n], SN.layout(space, n).mid_max
    widths = {"bn1": mid_max, "bn2": mid_max, "bn3": s.out_ch}
    return {name: {key: jnp.zeros((c, w), jnp.float32) for key in ("mean", "var")} for name, w in widths.items()}


def _toeplitz_index(hw: int, k: int, stride: int) -> np.ndarray:
    """int32[P, Q]: the tap (i * k + j) linking input pixel p to output pixel q, k * k where none (SAME padding)."""
    lo, _, out = same_padding(hw, k, stride)
    idx = np.full((hw * hw, out * out), k * k, np.int32)
    for a, b, i, j in itertools.product(range(out), range(out), range(k), range(k)):
        r, c = stride * a + i - lo, stride * b + j - lo
        if 0 <= r < hw and 0 <= c < hw:
            idx[r * hw + c, a * out + b] = i * k + j
    return idx


def _small_image(hw: int, k: int) -> bool:
    """Whether the depthwise conv of a k x k kernel on hw x hw images runs as a matmul per channel.

    Measured on the 2-core CPU (channels-first, 4 architectures x 256 images): the matmul form took 12-14 ms
    against 30-220 ms for the shifted sum at 4x4 (k = 3..7) and 160-200 ms against 220-490 ms at 8x8; its
    matrices grow as (H W)^2, so larger images use the shifted sum.
    """
    return hw * hw <= max(64, 2 * k * k)


def _depthwise(h, w, stride: int):
    """Depthwise conv (SAME) of channels-first h float[C, B, H, W] with w float[k, k, C] -> [C, B, H', W'].

    Small images on CPU: for every channel one matmul of the B x (H W) image rows with that channel's (H W) x (H' W')
    convolution matrix (gathered from w by a static index map), batched over channels with no transposes.
    Larger ones, and every size on GPU/TPU: ``dwconv.depthwise_conv`` on the NHWC transpose.
    """
    ch, bsz, hw, _ = h.shape
    k = w.shape[0]
    if resolve_impl("auto") == "xla" or not _small_image(hw, k):
        y = depthwise_conv(jnp.transpose(h, (1, 2, 3, 0)), w, stride)
        return jnp.transpose(y, (3, 0, 1, 2))
    out = same_padding(hw, k, stride)[2]
    flat = jnp.concatenate([w.reshape(k * k, ch), jnp.zeros((1, ch), w.dtype)]).T  # [C, k*k + 1]
    mats = flat[:, _toeplitz_index(hw, k, stride)]  # [C, P, Q]
    y = lax.dot_general(h.reshape(ch, bsz, hw * hw), mats, (((2,), (1,)), ((0,), (0,))))
    return y.reshape(ch, bsz, out, out)


def _pointwise(h, w):
    """1x1 conv of channels-first h float[Cin, B, H, W] with w float[Cin, Cout] -> [Cout, B, H, W]."""
    return jnp.tensordot(w, h, axes=((0,), (0,)))


def _batch_stats(h):
    """Mean and biased variance per channel of channels-first h (what train-mode batch norm normalises with)."""
    axes = tuple(range(1, h.ndim))
    mean = jnp.mean(h, axes, keepdims=True)
    return mean.reshape(-1), jnp.mean(jnp.square(h - mean), axes)


def _per_channel(v):
    return v[:, None, None, None]


def _mbconv(p, stats, x, stride: int, train: bool):
    """MBConv (1x1 expand, BN, ReLU6, depthwise, BN, ReLU6, 1x1 project, BN; no shortcut) on x float[C, B, H, W].

    Eval: batch norm with ``stats`` ({bn1, bn2, bn3} of {mean, var}) folded into each convolution's weights and
    a bias; returns (y, stats). Train: batch statistics; returns (y, {bn: {mean, var}} of this batch).
    """
    convs = (("bn1", _pointwise, p["expand"]), ("bn2", lambda h, w: _depthwise(h, w, stride), p["dw"]),
             ("bn3", _pointwise, p["project"]))
    h, new = x, {}
    for name, conv, w in convs:
        bn = p[name]
        if train:
            h = conv(h, w)
            mean, var = _batch_stats(h)
            new[name] = {"mean": mean, "var": var}
            scale = bn["scale"] * lax.rsqrt(var + O.BN_EPS)
            h = h * _per_channel(scale) + _per_channel(bn["bias"] - mean * scale)
        else:
            scale = bn["scale"] * lax.rsqrt(stats[name]["var"] + O.BN_EPS)
            h = conv(h, w * scale) + _per_channel(bn["bias"] - stats[name]["mean"] * scale)
        h = jax.nn.relu6(h) if name != "bn3" else h
    return h, (new if train else stats)


def _run_branch(space: SearchSpace, n: int, params_n, vs, x, stats, k: int, e: int, train: bool):
    """c candidates (positions vs) of layer n on channels-first inputs x float[c, C, B, H, W], padded to (k, e).

    Eval: ``stats`` are the candidates' BN statistics [c, ch]; returns (y [c, C', B, H', W'], stats).
    Train: returns the batch statistics padded to the layer's widths.
    """
    s, lay = space.layers[n], SN.layout(space, n)
    p = _candidate_params(space, n, params_n, vs, k, e)
    st = None if train else _crop_stats(stats, s.in_ch * e)
    y, new = jax.vmap(lambda pp, ss, xx: _mbconv(pp, ss, xx, s.stride, train))(p, st, x)
    if s.keeps_shape:
        bshape = (-1,) + (1,) * (y.ndim - 1)
        y = jnp.asarray(lay.mbconv)[vs].reshape(bshape) * y + jnp.asarray(lay.shortcut)[vs].reshape(bshape) * x
    return y, (_pad_stats(new, lay.mid_max) if train else stats)


def _branches(space: SearchSpace, n: int, params_n, train: bool):
    """The lax.switch branches of layer n: identity (where valid), one per (kernel, expansion) pair, then a
    skip branch (zeros) for chunks whose architectures all repeat an earlier one's prefix."""
    cl, s = _classes(space, n), space.layers[n]

    def identity(vs, x, stats):
        return x, (_zero_stats(space, n, vs.shape[0]) if train else stats)

    def padded(k, e):
        return lambda vs, x, stats: _run_branch(space, n, params_n, vs, x, stats, k, e, train)

    def skip(vs, x, stats):
        y = jnp.zeros((vs.shape[0], s.out_ch, x.shape[2], s.out_hw, s.out_hw), x.dtype)
        return y, (_zero_stats(space, n, vs.shape[0]) if train else stats)

    return [identity] * cl.has_identity + [padded(k, e) for k in cl.kernels for e in cl.expands] + [skip]


def _representatives(prefix, col):
    """rep int32[P]: the first architecture with the same prefix id and the same op in this column."""
    same = (prefix[:, None] == prefix[None, :]) & (col[:, None] == col[None, :])
    return jnp.argmax(same, axis=1).astype(jnp.int32)


class _Acts(NamedTuple):
    """Activations of the population: architecture a's are table[row[a]] (table float[R, C, B, H, W])."""

    table: jnp.ndarray
    row: jnp.ndarray


def _materialise(a: _Acts):
    return a.table[a.row]


def _layer0(space: SearchSpace, params_n, stem_out, stats0, train: bool):
    """Every valid candidate of layer 0 on the shared stem output, each at its own size: ([V, B, ...], stats [V])."""
    lay = SN.layout(space, 0)
    ys, sts = [], []
    for v, i in enumerate(lay.valid):
        vs = jnp.array([v], jnp.int32)
        st = jax.tree_util.tree_map(lambda a: a[v:v + 1], stats0)
        if OPS[i].is_identity:
            y, new = stem_out[None], (_zero_stats(space, 0, 1) if train else st)
        else:
            y, new = _run_branch(space, 0, params_n, vs, stem_out[None], st, OPS[i].kernel, OPS[i].expand, train)
        ys.append(y)
        sts.append(new)
    return jnp.concatenate(ys), jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *sts)


def _layer(space: SearchSpace, n: int, params_n, acts: _Acts, ops, prefix, stats, chunk: int, share: bool,
           train: bool):
    """Layer n >= 1 for the whole population (P divisible by chunk): sorted, chunked, one branch per chunk.

    ``prefix`` int32[P]: architectures with equal ids have equal ops in layers 0..n-1 (so equal inputs here);
    with ``share``, only the first architecture of each (prefix, op) group is computed: the others are sorted
    last and chunks made of them only are skipped. ``stats`` (eval): the population's BN statistics of this
    layer, [P, ch] leaves. Returns (activations, the new prefix ids, and in train mode the batch statistics
    [P, ch] in population order, else None).
    """
    lay, cl = SN.layout(space, n), _classes(space, n)
    P = ops.shape[0]
    pos = jnp.asarray(lay.position)[ops[:, n]]
    rep = _representatives(prefix, ops[:, n]) if share else jnp.arange(P, dtype=jnp.int32)
    repeat = rep != jnp.arange(P, dtype=jnp.int32)
    key = jnp.where(repeat, int(cl.rank.max()) + 1, jnp.asarray(cl.rank)[pos])
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    members = order.reshape(P // chunk, chunk)
    kmax = jnp.max(jnp.asarray(cl.k_index)[pos[members]], axis=1)
    emax = jnp.max(jnp.asarray(cl.e_index)[pos[members]], axis=1)
    branches = _branches(space, n, params_n, train)
    which = jnp.where(jnp.all(repeat[members], axis=1), len(branches) - 1, _branch_of(cl, kmax, emax))
    if train:
        stats = _zero_stats(space, n, P)

    def body(args):
        ids, b = args
        x = acts.table[acts.row[ids]]
        st = jax.tree_util.tree_map(lambda a: a[ids], stats)
        y, new = lax.switch(b, branches, pos[ids], x, st)
        return (y, new) if train else (y, None)

    ys, new = lax.map(body, (members, which))
    row = jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))[rep]
    if train:
        new = jax.tree_util.tree_map(lambda a: a.reshape((P,) + a.shape[2:])[row], new)
    return _Acts(ys.reshape((P,) + ys.shape[2:]), row), rep, new


def _head_zero_stats(space: SearchSpace, P: int):
    return {"bn": {key: jnp.zeros((P, space.head_channels), jnp.float32) for key in ("mean", "var")}}


def _forward(space: SearchSpace, params, ops, x, bn, chunk: int, share: bool, train: bool):
    """Logits float[P, B, classes] of the population on x float[B, H, W, C].

    Eval: ``bn`` = {"stem": shared stats, "layers": (layer 0 stats stacked by candidate [V0, ch], then [P, ch]
    per architecture for n >= 1), "head": [P, ch]}. Train: ``bn`` is ignored; returns the batch statistics in
    that same layout.
    """
    P = ops.shape[0]
    zeros = jnp.zeros((space.stem_channels,), jnp.float32)
    stem_st = {"bn": {"mean": zeros, "var": zeros}} if train else bn["stem"]
    h, stem_new = O.conv_bn_apply(params["stem"], stem_st, x, space.stem_stride, train)
    h = jnp.transpose(h, (3, 0, 1, 2))  # channels first: [C, B, H, W]
    outputs, layer_stats = {}, []
    for s in space.layers:
        n = s.index
        if n == 0:
            st0 = _zero_stats(space, 0, len(SN.layout(space, 0).valid)) if train else bn["layers"][0]
            table, new = _layer0(space, params["layers"][0], h, st0, train)
            outputs[0] = _Acts(table, jnp.asarray(SN.layout(space, 0).position)[ops[:, 0]])
            prefix = _representatives(jnp.zeros((P,), jnp.int32), ops[:, 0])
        else:
            srcs = space.input_of(n)
            acts = outputs[srcs[0]] if len(srcs) == 1 else _Acts(
                sum(_materialise(outputs[j]) for j in srcs) / len(srcs), jnp.arange(P, dtype=jnp.int32))
            outputs[n], prefix, new = _layer(space, n, params["layers"][n], acts, ops, prefix,
                                             None if train else bn["layers"][n], chunk, share, train)
        layer_stats.append(new)
    head_st = _head_zero_stats(space, P) if train else bn["head"]
    last = jnp.transpose(_materialise(outputs[space.num_layers - 1]), (0, 2, 3, 4, 1))  # [P, B, H, W, C]
    logits, head_new = jax.vmap(lambda st, xx: O.head_apply(params["head"], st, xx, train))(head_st, last)
    if train:  # ops' batch norm started from zero running statistics returned (1 - momentum) * batch statistics
        stem_new, head_new = jax.tree_util.tree_map(lambda a: a * _ZERO_STATS_SCALE, (stem_new, head_new))
    return logits, {"stem": stem_new, "layers": tuple(layer_stats), "head": head_new}


def _stored_stats(space: SearchSpace, state, ops):
    """Eval-mode statistics from the supernet's running averages of each architecture's chosen candidates."""
    P = ops.shape[0]
    layers = [state["layers"][0]]
    for n in range(1, space.num_layers):
        pos = jnp.asarray(SN.layout(space, n).position)[ops[:, n]]
        layers.append(jax.tree_util.tree_map(lambda a: a[pos], state["layers"][n]))
    head = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (P,) + a.shape), state["head"])
    return {"stem": state["stem"], "layers": tuple(layers), "head": head}


def _recalibrated_stats(space: SearchSpace, params, ops, bn_batches, chunk: int, share: bool):
    """Per-architecture statistics: the average over the K batches of each batch's mean and biased variance."""
    def batch_stats(xk):
        return _forward(space, params, ops, xk, None, chunk, share, train=True)[1]

    stats = lax.map(batch_stats, bn_batches)
    return jax.tree_util.tree_map(lambda a: jnp.mean(a, axis=0), stats)


def _check_inputs(space: SearchSpace, ops, x, y, bn_batches):
    """Raises ValueError for a malformed population, batch or recalibration batches (before any compute)."""
    shape = np.shape(ops)
    if len(shape) != 2 or shape[1] != space.num_layers or shape[0] < 1:
        raise ValueError(f"archs_ops has shape {shape}, expected (P, {space.num_layers}) with P >= 1")
    if not jnp.issubdtype(jnp.result_type(ops), jnp.integer):
        raise ValueError(f"archs_ops must hold integer op indices, got dtype {jnp.result_type(ops)}")
    if not isinstance(ops, jax.core.Tracer):
        o = np.asarray(ops)
        inside = (o >= 0) & (o < NUM_OPS)
        ok = inside & space.mask()[np.arange(space.num_layers)[None, :], np.where(inside, o, 0)]
        if not ok.all():
            a, n = (int(i) for i in np.argwhere(~ok)[0])
            raise ValueError(f"archs_ops[{a}, {n}] = {o[a, n]} is not a valid candidate of layer {n}; allowed "
                             f"{[i for i in np.flatnonzero(space.mask()[n])]}")
    image = (space.image_size, space.image_size, space.in_channels)
    if np.ndim(x) != 4 or tuple(np.shape(x)[1:]) != image:
        raise ValueError(f"x has shape {np.shape(x)}, expected (B, {image[0]}, {image[1]}, {image[2]})")
    if np.shape(y) != (np.shape(x)[0],):
        raise ValueError(f"y has shape {np.shape(y)}, expected ({np.shape(x)[0]},) integer labels")
    if bn_batches is not None and (np.ndim(bn_batches) != 5 or tuple(np.shape(bn_batches)[2:]) != image
                                   or np.shape(bn_batches)[0] < 1):
        raise ValueError(f"bn_batches has shape {np.shape(bn_batches)}, expected (K, B, {image[0]}, {image[1]}, "
                         f"{image[2]}) with K >= 1")


def _metrics(logits, y):
    """Cross-entropy and accuracy of logits float[B, classes] against labels int[B]."""
    return cross_entropy(logits, y), jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(jnp.float32))


def _latency_ms(space: SearchSpace, table, ops):
    return jax.vmap(lambda o: arch_latency(space, table, o).total)(ops)


def _evaluate_population(space, table, params, state, ops, x, y, bn_batches, chunk: int, share: bool = True):
    P = ops.shape[0]
    padded = jnp.concatenate([ops, jnp.broadcast_to(ops[:1], (-P % chunk, ops.shape[1]))]) if P % chunk else ops
    if bn_batches is None:
        bn = _stored_stats(space, state, padded)
    else:
        bn = _recalibrated_stats(space, params, padded, bn_batches, chunk, share)
    logits, _ = _forward(space, params, padded, x, bn, chunk, share, train=False)
    loss, acc = jax.vmap(_metrics, in_axes=(0, None))(logits[:P], y)
    return {"loss": loss, "accuracy": acc, "latency_ms": _latency_ms(space, table, ops)}


_STATIC_ARGS = ("space", "chunk", "share")
_evaluate_population_jit = jax.jit(_evaluate_population, static_argnames=_STATIC_ARGS)


def default_chunk() -> int:
    """Architectures per chunk when none is given: 1 on the CPU backend, where the measured time grew with the
    chunk (a chunk's expanded activations must stay in cache; see benchmarks/bench_batched_eval.py), 8 on
    accelerators, where a chunk is the parallel work of one kernel (a guess: not measured here)."""
    return 1 if jax.default_backend() == "cpu" else 8


def evaluate_population(space: SearchSpace, table, params, state, archs_ops, x, y, *, bn_batches=None,
                        chunk: int | None = None, share_prefixes: bool = True) -> dict:
    """Loss, accuracy and latency of P architectures of the supernet on one batch, all at once.

    Args:
      space: the search space (static: one compilation per space, population size and batch shapes).
      table: the CostTable the latency is read from.
      params: supernet parameters (``supernet.init`` layout).
      state: the supernet's batch-norm running statistics (``supernet.init`` layout).
      archs_ops: int[P, N], one architecture per row (valid candidate indices).
      x: float32[B, H, W, C] images.
      y: int[B] labels.
      bn_batches: optional float32[K, B', H, W, C]; if given, each architecture's BN statistics are recalibrated
        on these K batches (exact average of the per-batch means and biased variances) before evaluating x.
      chunk: architectures per chunk of the sorted population (static; P is padded up to a multiple of it);
        ``None``: ``default_chunk()``.
      share_prefixes: compute the layers that architectures share as a common prefix once (static).

    Returns:
      {"loss": float32[P] mean cross-entropy, "accuracy": float32[P] fraction in [0, 1],
      "latency_ms": float32[P] total latency T in ms (``arch_latency``)}.
    """
    _check_inputs(space, archs_ops, x, y, bn_batches)
    chunk = default_chunk() if chunk is None else chunk
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    ops = jnp.asarray(archs_ops, jnp.int32)
    return _evaluate_population_jit(space, table, params, state, ops, x, y, bn_batches,
                                    chunk=int(min(chunk, ops.shape[0])), share=bool(share_prefixes))


def _recalibrated_state(space: SearchSpace, params, state, gates, bn_batches):
    """Supernet state whose chosen candidates hold the exact K-batch averages of the batch statistics."""
    zero = jax.tree_util.tree_map(jnp.zeros_like, state)
    stats = lax.map(lambda xk: SN.apply(space, params, zero, gates, xk, train=True)[1], bn_batches)
    return jax.tree_util.tree_map(lambda a: jnp.mean(a, axis=0) * _ZERO_STATS_SCALE, stats)


def _evaluate_one(space, table, params, state, ops, x, y, bn_batches):
    """One architecture ops int32[N] through ``supernet.apply`` with one-hot gates (the oracle)."""
    gates = onehot_gates(ops, NUM_OPS)
    if bn_batches is not None:
        state = _recalibrated_state(space, params, state, gates, bn_batches)
    logits, _ = SN.apply(space, params, state, gates, x, train=False)
    loss, acc = _metrics(logits, y)
    return {"loss": loss, "accuracy": acc, "latency_ms": arch_latency(space, table, ops).total}


_evaluate_one_jit = jax.jit(_evaluate_one, static_argnames=("space",))


def evaluate_loop(space: SearchSpace, table, params, state, archs_ops, x, y, *, bn_batches=None) -> dict:
    """The same results as ``evaluate_population`` from a Python loop over architectures of one jitted
    single-architecture evaluation (``supernet.apply`` with one-hot gates); the oracle and benchmark peer."""
    _check_inputs(space, archs_ops, x, y, bn_batches)
    ops = jnp.asarray(archs_ops, jnp.int32)
    rows = [_evaluate_one_jit(space, table, params, state, ops[a], x, y, bn_batches) for a in range(ops.shape[0])]
    return {key: jnp.stack([r[key] for r in rows]) for key in ("loss", "accuracy", "latency_ms")}
