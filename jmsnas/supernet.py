"""The supernet as pure functions: init(key, space) and apply(space, params, state, gates, x, train).

Parameters are ``{"stem": ..., "layers": (layer_params, ...), "head": ...}``; each layer holds its valid candidates
stacked and zero-padded to the widest kernel and expansion (by default one shared superkernel whose windows and
leading channels the candidates use, with one batch norm per candidate); ``state`` mirrors it with batch-norm
running statistics. A mixed op outputs g^T v(x): with ``gates.paths`` given, only those K candidates are computed
(at their own size, one ``lax.switch`` per path executing one branch at run time, or padded: see
``candidate_impl``), otherwise every valid candidate is. The compact network of one architecture has only the
chosen candidates' parameters and computes exactly what the supernet computes with the matching one-hot gates.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas import ops as O
from jmsnas.gates import Gates
from jmsnas.space import OPS, OpSpec, SearchSpace


def _valid_ops(space: SearchSpace, n: int) -> list:
    return [int(i) for i in np.flatnonzero(space.mask()[n])]


class _Layout(NamedTuple):
    """Static padding layout of one layer's stacked candidates (position v = index in the valid list)."""

    valid: tuple  # op indices of the valid candidates
    kmax: int
    mid_max: int
    position: np.ndarray  # int32[R]: op index -> position v
    kmask: np.ndarray  # float32[V, kmax, kmax, 1]: candidate v's centred k x k window
    cmask: np.ndarray  # float32[V, mid_max]: candidate v's first in_ch * expand channels
    mbconv: np.ndarray  # float32[V]: 1 for an MBConv, 0 for identity
    shortcut: np.ndarray  # float32[V]: 1 where the input is added (shortcut or identity)


def layout(space: SearchSpace, n: int) -> _Layout:
    s = space.layers[n]
    valid = tuple(_valid_ops(space, n))
    convs = [OPS[i] for i in valid if not OPS[i].is_identity]
    kmax = max(o.kernel for o in convs)
    mid_max = s.in_ch * max(o.expand for o in convs)
    position = np.zeros(len(OPS), np.int32)
    position[list(valid)] = np.arange(len(valid))
    kmask = np.zeros((len(valid), kmax, kmax, 1), np.float32)
    cmask = np.zeros((len(valid), mid_max), np.float32)
    for v, i in enumerate(valid):
        o = OPS[i]
        if not o.is_identity:
            lo = (kmax - o.kernel) // 2
            kmask[v, lo:lo + o.kernel, lo:lo + o.kernel] = 1.0
            cmask[v, :s.in_ch * o.expand] = 1.0
    mbconv = np.array([0.0 if OPS[i].is_identity else 1.0 for i in valid], np.float32)
    shortcut = np.array([1.0 if OPS[i].is_identity or OPS[i].residual else 0.0 for i in valid], np.float32)
    return _Layout(valid, kmax, mid_max, position, kmask, cmask, mbconv, shortcut)


def _init_layer(key, space: SearchSpace, n: int, shared: bool):
    """Stacked, zero-padded parameters of every valid candidate of layer n (one entry per candidate).

    With ``shared`` the convolution weights are one widest (kmax x kmax, largest expansion) set whose centred
    sub-kernel and leading channels every candidate uses; batch norm stays per candidate.
    """
    s, lay = space.layers[n], layout(space, n)
    V, M = len(lay.valid), lay.mid_max
    W = 1 if shared else V
    # NumPy arrays filled in place when called eagerly; under a trace (jit, eval_shape) jnp's, so that the program
    # broadcasts its zeros instead of carrying them as constants
    zeros, ones = (jnp.zeros, jnp.ones) if isinstance(key, jax.core.Tracer) else (np.zeros, np.ones)
    p = {"expand": zeros((W, s.in_ch, M), np.float32), "dw": zeros((W, lay.kmax, lay.kmax, M), np.float32),
         "project": zeros((W, M, s.out_ch), np.float32)}
    for name, ch in (("bn1", M), ("bn2", M), ("bn3", s.out_ch)):
        p[name] = {"scale": zeros((V, ch), np.float32), "bias": zeros((V, ch), np.float32)}
    st = {name: {"mean": zeros((V, ch), np.float32), "var": ones((V, ch), np.float32)}
          for name, ch in (("bn1", M), ("bn2", M), ("bn3", s.out_ch))}
    for v, (i, kv) in enumerate(zip(lay.valid, jax.random.split(key, V))):
        op = OPS[i]
        if op.is_identity:
            continue
        mid = s.in_ch * op.expand
        for name, ch in (("bn1", mid), ("bn2", mid), ("bn3", s.out_ch)):
            p[name]["scale"] = _put(p[name]["scale"], (v, slice(None, ch)), 1.0)
        if shared:
            continue
        q, _ = O.mbconv_init(kv, op, s.in_ch, s.out_ch)
        lo = (lay.kmax - op.kernel) // 2
        p["expand"] = _put(p["expand"], (v, slice(None), slice(None, mid)), q["expand"])
        p["dw"] = _put(p["dw"], (v, slice(lo, lo + op.kernel), slice(lo, lo + op.kernel), slice(None, mid)), q["dw"])
        p["project"] = _put(p["project"], (v, slice(None, mid)), q["project"])
        for name, ch in (("bn1", mid), ("bn2", mid), ("bn3", s.out_ch)):
            p[name]["scale"] = _put(p[name]["scale"], (v, slice(None, ch)), q[name]["scale"])
    if shared:
        widest = OpSpec("widest", lay.kmax, M // s.in_ch, False)
        q, _ = O.mbconv_init(key, widest, s.in_ch, s.out_ch)
        for name in ("expand", "dw", "project"):
            p[name] = _put(p[name], 0, q[name])
    return jax.device_put(p), jax.device_put(st)  # placed as they are: no executable per shape


def _put(a, index, value):
    """``a`` with ``a[index] = value``: written in place into a NumPy array, or, when ``value`` is traced (the
    initialisation under ``jit``/``eval_shape``), as ``a.at[index].set(value)``."""
    if isinstance(value, jax.core.Tracer) or isinstance(a, jax.core.Tracer):
        return jnp.asarray(a).at[index].set(value)
    a[index] = value
    return a


def is_shared(params_n) -> bool:
    """True if layer params hold one shared convolution weight set (static: read from the shapes)."""
    return params_n["expand"].shape[0] == 1 and params_n["bn1"]["scale"].shape[0] > 1


def init(key, space: SearchSpace, *, shared_weights: bool = True):
    """Initial (params, state) of the whole supernet; each layer holds its candidates stacked and zero-padded.

    ``shared_weights=True`` (default): the candidates of a layer share one superkernel (the k x k kernel is the
    centre of the 7 x 7 one, expansion 3 the first half of expansion 6's channels, with and without shortcut the same
    weights), as in Single-Path NAS and Once-for-All; each candidate keeps its own batch norm. Sampling one path
    per step then trains weights every candidate uses, which is what makes stage 1 learn in a few epochs on small
    data (with separate weights a path is trained on 1/13 of the steps and the sampled networks see inconsistent
    features: on the digits a supernet with separate weights stayed at chance for 10 epochs).
    ``shared_weights=False``: every candidate has its own weights, as in ProxylessNAS/JMSNAS.
    """
    k_stem, k_head, k_layers = jax.random.split(key, 3)
    params, state = {}, {}
    params["stem"], state["stem"] = O.conv_bn_init(k_stem, 3, space.in_channels, space.stem_channels)
    layers = [_init_layer(kn, space, n, shared_weights)
              for n, kn in enumerate(jax.random.split(k_layers, space.num_layers))]
    params["layers"] = tuple(l[0] for l in layers)
    state["layers"] = tuple(l[1] for l in layers)
    params["head"], state["head"] = O.head_init(k_head, space.layers[-1].out_ch, space.head_channels,
                                                space.num_classes)
    return params, state


def _conv_classes(lay: _Layout) -> tuple:
    """The distinct (kernel, expansion) pairs of a layer's MBConv candidates, in order of first appearance.

    Candidates with and without shortcut share a class: they compute the same convolutions (with their own BN).
    """
    out = []
    for i in lay.valid:
        op = OPS[i]
        if not op.is_identity and (op.kernel, op.expand) not in out:
            out.append((op.kernel, op.expand))
    return tuple(out)


def _class_of(lay: _Layout) -> np.ndarray:
    """int32[V]: the branch of candidate v in ``_conv_classes`` order; identity gets the last branch."""
    classes = _conv_classes(lay)
    return np.array([len(classes) if OPS[i].is_identity else classes.index((OPS[i].kernel, OPS[i].expand))
                     for i in lay.valid], np.int32)


def _window(space: SearchSpace, lay: _Layout, n: int, params_n, state_n, kernel: int, expand: int, v):
    """Candidate v's own parameters and BN state from layer n's stacks: the centred kernel x kernel window and the
    first in_ch * expand channels of the (shared or v-th) convolution weights, and row v of its batch norms, cut
    to its channels. ``v`` may be a Python int (NumPy or jax leaves) or a traced index."""
    s = space.layers[n]
    mid, lo = s.in_ch * expand, (lay.kmax - kernel) // 2
    w = 0 if is_shared(params_n) else v
    p = {"expand": params_n["expand"][w, :, :mid], "dw": params_n["dw"][w, lo:lo + kernel, lo:lo + kernel, :mid],
         "project": params_n["project"][w, :mid]}
    st = {}
    for name, ch in (("bn1", mid), ("bn2", mid), ("bn3", s.out_ch)):
        p[name] = {k: a[v, :ch] for k, a in params_n[name].items()}
        st[name] = {k: a[v, :ch] for k, a in state_n[name].items()}
    return p, st


def _own_size(space: SearchSpace, lay: _Layout, n: int, kernel: int, expand: int, params_n, state_n, v, x,
              train: bool, dw_impl: str):
    """Candidate v (traced) of class (kernel, expand) at its own size (``_window``: static slices of the stacks,
    candidate v's BN row gathered). Returns (y without the shortcut, candidate v's new BN row padded to the stack
    widths: new statistics in its own channels)."""
    p, st = _window(space, lay, n, params_n, state_n, kernel, expand, v)
    y, new = O.mbconv_apply(p, st, x, OpSpec("own", kernel, expand, False), space.layers[n].stride, train, dw_impl)
    row = jax.tree_util.tree_map(lambda a: a[v], state_n)
    return y, jax.tree_util.tree_map(lambda old, b: old.at[:b.shape[0]].set(b), row, new)


def _sampled_candidate(space: SearchSpace, lay: _Layout, n: int, params_n, state_n, v, x, train: bool,
                       dw_impl: str):
    """Candidate at position v (traced) of layer n; only its own computation runs.

    ``lax.switch`` over the layer's (kernel, expansion) classes picks one branch at run time, so a 3x3 candidate
    costs 9 depthwise taps and its own channels, an identity nothing; the program is compiled once for all v.
    Returns (y, candidate v's new BN row)."""
    branches = [lambda p, st, h, k=k, e=e: _own_size(space, lay, n, k, e, p, st, v, h, train, dw_impl)
                for k, e in _conv_classes(lay)]
    if any(OPS[i].is_identity for i in lay.valid):
        # the last branch: the identity's MBConv term is zero (identity is valid only where the shape is kept)
        branches.append(lambda p, st, h: (jnp.zeros_like(h), jax.tree_util.tree_map(lambda a: a[v], st)))
    if len(branches) == 1:
        y, new = branches[0](params_n, state_n, x)
    else:
        y, new = lax.switch(jnp.asarray(_class_of(lay))[v], branches, params_n, state_n, x)
    if space.layers[n].keeps_shape:
        y = jnp.asarray(lay.mbconv)[v] * y + jnp.asarray(lay.shortcut)[v] * x
    return y, new


def _candidate(space: SearchSpace, lay: _Layout, n: int, params_n, state_n, v, x, train, dw_impl):
    """Candidate at position v (traced) of layer n computed by one padded MBConv; returns (y, its new BN state).

    The gathered parameters are multiplied by the candidate's static kernel/channel masks, so padding never
    contributes to the output and receives zero gradient: the result equals the candidate's own computation.
    """
    cm, km = jnp.asarray(lay.cmask)[v], jnp.asarray(lay.kmask)[v]
    take = lambda t: jax.tree_util.tree_map(lambda a: a[v], t)
    w = 0 if is_shared(params_n) else v
    p = {"expand": params_n["expand"][w] * cm, "dw": params_n["dw"][w] * km * cm,
         "project": params_n["project"][w] * cm[:, None], "bn3": take(params_n["bn3"])}
    for name in ("bn1", "bn2"):
        p[name] = {k: a[v] * cm for k, a in params_n[name].items()}
    widest = OpSpec("padded", lay.kmax, 0, False)
    y, new = O.mbconv_apply(p, take(state_n), x, widest, space.layers[n].stride, train, dw_impl)
    if space.layers[n].keeps_shape:
        y = jnp.asarray(lay.mbconv)[v] * y + jnp.asarray(lay.shortcut)[v] * x
    return y, new


OWN_SIZE_MIN_ELEMENTS = 4096
CANDIDATE_IMPLS = ("auto", "own", "padded")


def candidate_impl(impl: str, x_shape, all_paths: bool = False) -> str:
    """How a layer computes its candidates: "own" (each at its own size) or "padded" (one program padded to the
    widest kernel and expansion, masked).

    "auto": "own" when every valid candidate is computed (``all_paths``: Gumbel-softmax and softmax gates), and for
    sampled paths when one image's layer input has at least ``OWN_SIZE_MIN_ELEMENTS`` values (H x W x C, e.g.
    8 x 8 x 64 or 16 x 16 x 16), else "padded". Padded computes each path at the widest size (7 x 7, expansion 6),
    own pays a fixed cost per layer (a ``lax.switch``, and compiling every (kernel, expansion) class), so own wins
    on large inputs. Measured on the 2-core CPU: at 32 x 32 inputs own-size candidates make a sampled weight step
    several times faster (a 3x3 candidate runs 9 depthwise taps instead of 49, an identity nothing); the benchmark's
    8 x 8 x 64 and 8 x 8 x 96 layers gave 1.41x / 1.17x PyTorch's two-path weight / architecture steps own against
    1.25x / 0.96x padded (batch 64, one run); the digits' 8 x 8 x 24 layers give a step about as fast either way
    (31.6 ms padded, 34.4 ms own) while compiling 2.5x longer, so they stay padded. With all paths, padded computes
    every candidate at the widest size (13 x 7x7, expansion 6) and stacks their activations: the digits' softmax
    architecture step takes 342 ms padded and 98 ms own (compile 5.0 s and 6.1 s), the 32 x 32 benchmark's Gumbel
    architecture step 1.9 s padded and 1.4 s own.
    """
    if impl not in CANDIDATE_IMPLS:
        raise ValueError(f"candidate impl must be one of {CANDIDATE_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "own" if all_paths or int(np.prod(x_shape[1:])) >= OWN_SIZE_MIN_ELEMENTS else "padded"


def mixed_op(space: SearchSpace, n: int, params_n, state_n, weights_n, paths_n, x, train: bool,
             dw_impl: str = "auto", impl: str = "auto"):
    """Layer n's output sum_k g[paths[k]] v_{paths[k]}(x); every valid candidate when paths_n is None.

    ``impl`` (``candidate_impl``): with "own", each sampled path (``paths_n``, K op indices, traced) is one
    ``lax.switch`` over the layer's (kernel, expansion) classes that executes only the sampled candidate at its
    own size, and without paths a static loop computes every valid candidate at its own size; with "padded" each
    path, or every candidate at once (vmapped), is one MBConv padded to the widest kernel and expansion with the
    candidate's masks. Both give the same values and gradients.
    """
    lay = layout(space, n)
    impl = candidate_impl(impl, x.shape, all_paths=paths_n is None)
    state_n = jax.tree_util.tree_map(jnp.asarray, state_n)  # NumPy leaves have no .at[] for the BN update
    put = lambda st, v, new: jax.tree_util.tree_map(lambda a, b: a.at[v].set(b), st, new)
    if paths_n is None and impl == "padded":
        vs = jnp.arange(len(lay.valid))
        ys, new = jax.vmap(lambda v: _candidate(space, lay, n, params_n, state_n, v, x, train, dw_impl))(vs)
        w = weights_n[jnp.asarray(lay.valid)]
        return jnp.tensordot(w, ys, axes=1), new if train else state_n
    out = 0.0
    if paths_n is None:
        new_state = state_n
        for v, i in enumerate(lay.valid):
            op = OPS[i]
            if op.is_identity:
                y = x
            else:
                y, new = _own_size(space, lay, n, op.kernel, op.expand, params_n, state_n, v, x, train, dw_impl)
                y = y + x if op.residual else y
                new_state = put(new_state, v, new) if train else new_state
            out = out + weights_n[i] * y
        return out, new_state
    compute = _sampled_candidate if impl == "own" else _candidate
    for k in range(paths_n.shape[0]):
        idx = paths_n[k]
        v = jnp.asarray(lay.position)[idx]
        y, new = compute(space, lay, n, params_n, state_n, v, x, train, dw_impl)
        state_n = put(state_n, v, new) if train else state_n
        out = out + weights_n[idx] * y
    return out, state_n


def _layer_inputs(space: SearchSpace, n: int, outputs: dict, stem_out):
    srcs = space.input_of(n)
    xs = [stem_out if j < 0 else outputs[j] for j in srcs]
    return xs[0] if len(xs) == 1 else sum(xs) / len(xs)  # mesh aggregator: mean of the branch outputs


def apply(space: SearchSpace, params, state, gates: Gates, x, *, train: bool, dw_impl: str = "auto",
          impl: str = "auto"):
    """Logits float32[B, classes] of the supernet under ``gates`` and the updated batch-norm state.

    ``impl``: how each layer computes its candidates ("auto", "own" or "padded"; see ``candidate_impl``)."""
    new_state = {}
    h, new_state["stem"] = O.conv_bn_apply(params["stem"], state["stem"], x, space.stem_stride, train)
    outputs, layer_states = {}, []
    for s in space.layers:
        inp = _layer_inputs(space, s.index, outputs, h)
        paths_n = None if gates.paths is None else gates.paths[s.index]
        y, st = mixed_op(space, s.index, params["layers"][s.index], state["layers"][s.index],
                         gates.weights[s.index], paths_n, inp, train, dw_impl, impl)
        outputs[s.index] = y
        layer_states.append(st)
    new_state["layers"] = tuple(layer_states)
    logits, new_state["head"] = O.head_apply(params["head"], state["head"], outputs[space.num_layers - 1], train)
    return logits, new_state


def _unpad(space: SearchSpace, n: int, params_n, state_n, i: int):
    """Candidate i's own (unpadded) parameters and state from layer n's stacks."""
    op, lay = OPS[i], layout(space, n)
    if op.is_identity:
        return {}, {}
    return _window(space, lay, n, params_n, state_n, op.kernel, op.expand, int(lay.position[i]))


def extract(space: SearchSpace, params, state, ops: Sequence[int]):
    """The compact network of architecture ``ops``: only the chosen candidates' parameters and state."""
    ops = [int(i) for i in np.asarray(ops)]
    space.validate_arch(ops)
    parts = [_unpad(space, n, params["layers"][n], state["layers"][n], i) for n, i in enumerate(ops)]
    cp = {"stem": params["stem"], "head": params["head"], "layers": tuple(p for p, _ in parts)}
    cs = {"stem": state["stem"], "head": state["head"], "layers": tuple(st for _, st in parts)}
    return cp, cs


def compact_apply(space: SearchSpace, ops: tuple, params, state, x, *, train: bool, dw_impl: str = "auto"):
    """Forward of the compact network ``ops`` (a static tuple of op indices) with params from ``extract``."""
    new_state = {}
    h, new_state["stem"] = O.conv_bn_apply(params["stem"], state["stem"], x, space.stem_stride, train)
    outputs, layer_states = {}, []
    for s, i in zip(space.layers, ops):
        inp = _layer_inputs(space, s.index, outputs, h)
        y, st = O.op_apply(params["layers"][s.index], state["layers"][s.index], inp, OPS[i], s.stride, train,
                           dw_impl)
        outputs[s.index] = y
        layer_states.append(st)
    new_state["layers"] = tuple(layer_states)
    logits, new_state["head"] = O.head_apply(params["head"], state["head"], outputs[space.num_layers - 1], train)
    return logits, new_state


def count_params(tree) -> int:
    """Number of scalars in a parameter pytree."""
    return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(tree)))


def device_parts(space: SearchSpace, compact_params, ops: Sequence[int], assignment=None) -> dict:
    """Per-device parts of a compact network: device name -> {"layers": [...], "params": subtree}.

    ``assignment`` (device index per layer) defaults to the space's D^m split. The stem goes with the first
    device in execution order, the head with the last.
    """
    devices = space.layer_devices() if assignment is None else np.asarray(assignment)
    topo = space.topology
    order = topo.path_order()
    parts = {topo.devices[m].name: {"layers": [], "ops": [], "params": {"layers": {}}} for m in order}
    for s, i, d in zip(space.layers, ops, devices):
        part = parts[topo.devices[int(d)].name]
        part["layers"].append(s.index)
        part["ops"].append(OPS[int(i)].name)
        part["params"]["layers"][str(s.index)] = compact_params["layers"][s.index]
    parts[topo.devices[order[0]].name]["params"]["stem"] = compact_params["stem"]
    parts[topo.devices[order[-1]].name]["params"]["head"] = compact_params["head"]
    return parts
