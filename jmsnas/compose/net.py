"""The composed supernet: the JMSNAS supernet (``jmsnas.supernet``) with a gate over every layer's weight bit width
and, at every cut between devices, a gate over the split module and one over the transmitted tensor's bit width.

Parameters are the supernet's (``stem``, ``layers``, ``head``) plus ``modules``: a dict keyed by the boundary index
``str(j)`` (j = 0 the stem's output, j = n + 1 layer n's output, j = N + 1 the input image where
``Choices.send_input``; ``module_boundaries``) of one
``jmsnas.splitnets.module.init(key, c_j, d_max=max(1, c_j // min(modules)))`` each (one view, 1x1, split-aware
geometric initialisation). A module of reduction r at boundary j runs ``module.reduce(p, x, d)`` and
``module.recover(p, z)`` with d = max(1, c_j // r) (``terms.module_channels``); its weights belong to the boundary,
so every reduction shares them (the first d channels) and a link that crosses boundary j under another split uses
the same weights.

Fake quantization, with a straight-through estimator (the forward quantizes, the gradient is the identity):

* weights at b bits: ``jmsnas.quant.quantizers.fake_quant_weight``, symmetric per output channel (the last axis);
  32 = float32 unchanged, 16 = float16 round trip. In the supernet a layer's stacked superkernel is quantized per
  output channel over the whole stack (one scale serves every candidate's window); the derived network quantizes
  its own compact weights (``compact_apply``). Only the searched layers' convolutions (expand, depthwise, project)
  quantize; the stem, the head and batch norm stay float32;
* a transmitted tensor at a bits: asymmetric over the range [min, max] of the tensor's sent channels in the
  current batch (``fake_quant_act``; 1..8 bits: codes in [0, 2^a - 1]; 16: float16; 32: unchanged), the scale and
  zero point a sender computes for the batch it sends.

Gates: every group is a ``jmsnas.gates.Gates`` over its candidates, sampled as the ops are (one path in a weight
step; two paths, Gumbel-softmax or the softmax in an architecture step). Mixing is exact where the quantity is
linear: the transmitted bits mix the fake-quantized tensors before the (linear) Conv-Recover; the weight bits mix
the fake-quantized weights (with binary gates the forward is exactly the active width, and the inactive one's
gradient is its first-order effect through the weights, as EdMIPS mixes quantized weights).

The current split is data, not structure: ``assignment`` (int32[N], the device of every layer) gives each link's
boundary (``compose.cost.link_boundaries``) and each layer's quantizing device; a link transform runs under a
``lax.cond`` at every boundary it may cross, so one compiled step serves every split.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas import gates as G
from jmsnas import ops as O
from jmsnas import supernet
from jmsnas.compose.choices import FLOAT_BITS, Choices, Config
from jmsnas.compose.cost import link_boundaries
from jmsnas.compose.network import composed_apply, link_path
from jmsnas.compose.terms import boundary_shapes, module_channels, reduces
from jmsnas.cost.latency import mesh_segments
from jmsnas.quant import quantizers as Q
from jmsnas.splitnets import module as M

QUANTIZED = ("expand", "dw", "project")  # the convolution weights of an MBConv layer that take the weight bits
# quantized at the sampled width in the forward, but passing no gradient to the weight-bit gates: the depthwise
# kernel's weight gradient (one reduction per tap) would make the architecture step, which otherwise computes no
# weight gradient, about twice as long on the CPU; the gates learn the width's effect through the two pointwise
# convolutions (and the costs through every term)
GATE_HELD = ("dw",)


class ComposedGates(NamedTuple):
    """The gates of the composed groups: weight_bits over [N, Bw], module over [L, K], act_bits over [L, Ba]."""

    weight_bits: G.Gates
    module: G.Gates
    act_bits: G.Gates


def _ste(x, q):
    """q forward, identity backward."""
    return x + lax.stop_gradient(q - x)


def fake_quant_weight(w, bits):
    """w fake-quantized at ``bits`` (traced int; 32: unchanged) per output channel, straight-through gradient."""
    b = jnp.asarray(bits, jnp.int32)
    return _ste(w, Q.fake_quant_weight(w, jnp.where(b == FLOAT_BITS, Q.FLOAT, b)))


def fake_quant_act(x, bits, valid=None):
    """x fake-quantized at ``bits`` (traced int; 32: unchanged, 16: float16) over the batch's [min, max] of the
    entries where ``valid`` (broadcast to x; default all), straight-through gradient. Entries outside ``valid``
    come back as 0 (they are not sent)."""
    b = jnp.asarray(bits, jnp.int32)
    if valid is None:
        lo, hi = jnp.min(x), jnp.max(x)
    else:
        lo, hi = jnp.min(jnp.where(valid > 0, x, jnp.inf)), jnp.max(jnp.where(valid > 0, x, -jnp.inf))
    lo, hi = lax.stop_gradient(lo), lax.stop_gradient(hi)
    q = _ste(x, Q.fake_quant_act(x, lo, hi, jnp.where(b == FLOAT_BITS, Q.FLOAT, b)))
    return q if valid is None else q * valid


def module_boundaries(space, split: str, send_input: bool = False) -> tuple:
    """The boundaries j where a cut can fall: D^m's under the fixed split, every j = 0..N when it is searched
    (and N + 1, the input image, with ``send_input``)."""
    if split == "fixed":
        with jax.ensure_compile_time_eval():  # constants, also when called under a trace
            return tuple(sorted({int(j) for j in np.asarray(link_boundaries(space))}))
    return tuple(range(space.num_layers + 1 + bool(send_input)))


def init_modules(key, space, choices: Choices, split: str) -> dict:
    """``{str(j): jmsnas.splitnets.module.init(...)}`` for every boundary of ``module_boundaries`` ({} without
    modules)."""
    if not choices.modules:
        return {}
    shapes = boundary_shapes(space, choices.send_input)
    js = module_boundaries(space, split, choices.send_input)
    r_min = min(choices.modules)
    return {str(j): M.init(k, shapes[j][1], module_channels(shapes[j][1], r_min))
            for j, k in zip(js, jax.random.split(key, len(js))) if reduces(shapes[j][1], r_min)}


def _group_paths(g: G.Gates, row: int, num: int):
    """(indices, gate values) of the candidates a group's row computes: its sampled paths, or all ``num``."""
    idx = jnp.arange(num) if g.paths is None else g.paths[row]
    return [(idx[k], g.weights[row, idx[k]]) for k in range(idx.shape[0])]


def _quantize_layer(params_n, g: G.Gates, n: int, quantizes, bits: tuple):
    """Layer n's stacked parameters with its convolutions fake-quantized at the mixture of its sampled weight bits
    where ``quantizes`` (a bool, or traced under a searched split), unchanged elsewhere."""
    table = jnp.asarray(bits, jnp.int32)
    out = dict(params_n)
    for name in QUANTIZED:
        w = params_n[name]
        hold = (lambda v: lax.stop_gradient(v)) if name in GATE_HELD else (lambda v: v)
        mixed = sum(hold(gv) * jax.vmap(lambda wi, b=table[i]: fake_quant_weight(wi, b))(w)
                    for i, gv in _group_paths(g, n, len(bits)))
        out[name] = (mixed if quantizes else w) if isinstance(quantizes, (bool, np.bool_)) else \
            jnp.where(quantizes, mixed, w)
    return out


def _link(choices: Choices, params_j, c: int, cg: ComposedGates, l: int, h):
    """The tensor h after link l's sampled module(s) and transmitted bit width(s) (mixed by their gates)."""
    abits = jnp.asarray(choices.act_bits, jnp.int32)

    def send(z, valid=None):
        return sum(gv * fake_quant_act(z, abits[a], valid) for a, gv in _group_paths(cg.act_bits, l, len(abits)))

    none = send(h)
    if not choices.modules or params_j is None:  # no module, or none that reduces here (``terms.reduces``)
        return none
    d_max = params_j["reduce"].shape[-1]
    d_of = jnp.asarray([d_max] + [module_channels(c, r) for r in choices.modules], jnp.int32)
    out = 0.0
    for k, gv in _group_paths(cg.module, l, choices.num_modules):
        d = d_of[k]
        moved = M.recover(params_j, send(M.reduce(params_j, h, d), M.channel_mask(d, d_max)))
        out = out + gv * jnp.where(k == 0, none, moved)
    return out


def links_active(choices: Choices) -> bool:
    """True if a cut transforms the tensor (a module or a transmitted bit width other than float32)."""
    return bool(choices.modules) or choices.act_bits != (FLOAT_BITS,)


def _cuts(space, choices: Choices, modules: dict, cg: ComposedGates, bounds, js: tuple, j: int, h, links=None):
    """h at boundary j after every link crossing it (in link order; a relay device without layers puts two links
    on one boundary; ``links``: only these, default all): where ``bounds`` is a NumPy array (the fixed split) the
    links crossing j are known when tracing; where it is traced (a searched split) each link runs under a
    ``lax.cond`` on its boundary."""
    if not links_active(choices) or j not in js:
        return h
    c = boundary_shapes(space, True)[j][1]
    p = modules.get(str(j))
    for l in (range(len(space.topology.links)) if links is None else links):
        if isinstance(bounds, np.ndarray):
            h = _link(choices, p, c, cg, l, h) if bounds[l] == j else h
        else:
            h = lax.cond(bounds[l] == j, lambda x, l=l: _link(choices, p, c, cg, l, x), lambda x: x, h)
    return h


def _mesh_deliver(space, choices: Choices, modules: dict, cg: ComposedGates, a: np.ndarray, bounds: np.ndarray,
                  outputs: dict):
    """``deliver(src, dev)``: layer src's output (-1: the stem's) as device ``dev`` holds it on a mesh under the
    fixed split, every link on the way from src's device applied in path order (``_link``), each (src, receiving
    device) computed once: a fork's branches each receive the root's tensor through their own link (its module and
    bits), as ``compose.network.composed_apply`` routes the derived network."""
    topo, shapes, held = space.topology, boundary_shapes(space), {}
    first = topo.path_order()[0]
    names = topo.device_names

    def deliver(src: int, dev: int):
        y = outputs[src]
        if not links_active(choices):
            return y
        for l in link_path(topo, first if src < 0 else int(a[src]), dev):
            j = src + 1
            assert int(bounds[l]) == j, (l, int(bounds[l]), j)  # the fixed split D^m: every link carries its own
            key = (src, names.index(topo.links[l].dst))
            if key not in held:
                held[key] = _link(choices, modules.get(str(j)), shapes[j][1], cg, l, y)
            y = held[key]
        return y
    return deliver


def _mesh_searched(space, choices: Choices, modules: dict, cg: ComposedGates, bounds, js: tuple):
    """(inputs(n, outputs), after(n, y)) on a mesh under a searched split (``cost.latency.MeshSegments``): the
    chains before the fork and after the merge re-split, so their links (traced boundaries) apply where the tensor
    leaves a boundary (``after``: layer n's output, -1 the stem's, as the next device holds it, as on a chain; a
    branch's layers keep theirs); the fork and merge links carry fixed boundaries and apply per branch
    (``inputs``): a branch's first layer receives the root's tensor through its own fork link, the first
    layer after the merge the average of the branches' tensors, each through its merge link, then every link after
    the aggregator that carries the merged tensor (a relay: the aggregator averages once, then sends), as
    ``compose.network.composed_apply`` routes the derived network and the parts run it."""
    topo, shapes = space.topology, boundary_shapes(space)
    seg = mesh_segments(space)
    chain = [topo.link_index(d[p], d[p + 1]) for d in (seg.prefix_devices, seg.post) for p in range(len(d) - 1)]
    static = np.asarray(space.layer_devices())
    forks, merges, held = {}, {}, {}
    for b in topo.branches:
        forks[b], merges[b] = topo.link_index(topo.root, b), topo.link_index(b, topo.post[0])

    def through(l, j, y, key):
        if not links_active(choices):
            return y
        if key not in held:
            held[key] = _link(choices, modules.get(str(j)), shapes[j][1], cg, l, y)
        return held[key]

    def leave(j, h):
        return _cuts(space, choices, modules, cg, bounds, js, j, h, chain)

    def after(n, y):
        return y if seg.prefix <= n < seg.suffix_start else leave(n + 1, y)

    def inputs(n, outputs):
        srcs = space.input_of(n)
        if seg.prefix <= n < seg.suffix_start and all(i < seg.prefix for i in srcs):  # a branch's first layer
            b = int(static[n])
            return [through(forks[b], i + 1, outputs[i], ("fork", i, b)) for i in srcs]
        if n == seg.suffix_start and seg.suffix_start < space.num_layers:  # the merge
            ys = [through(merges[int(static[i])], i + 1, outputs[i], ("merge", i)) for i in srcs]
            return [leave(seg.suffix_start, ys[0] if len(ys) == 1 else sum(ys) / len(ys))]
        return [outputs[i] for i in srcs]
    return inputs, after


def apply(space, choices: Choices, split: str, params, state, gates: G.Gates, cg: ComposedGates, assignment, x, *,
          train: bool, dw_impl: str = "auto", impl: str = "auto"):
    """Logits float32[B, classes] and the new batch-norm state of the composed supernet under the op gates
    ``gates``, the composed gates ``cg`` and the split ``assignment`` (int32[N], or [N + 1] with the stem's device
    last where the choices send the input; may be traced; ignored under the fixed split, D^m). A chain: every
    link's module and bits apply at the boundary it crosses (in link order, as the tensor travels); a mesh under
    the fixed split: every layer receives each of its inputs through the links from the input's device to its own
    (``_mesh_deliver``); a mesh under a searched split: the chains before the fork and after the merge as a chain,
    the fork and merge links per branch (``_mesh_searched``)."""
    mesh = space.topology.kind != "chain"
    searched_mesh = mesh and split != "fixed"
    if split == "fixed":  # known when tracing: no conditional per link, no select per layer
        a = np.asarray(space.layer_devices(), np.int32)
        quantizes = np.asarray(choices.quantize)[a]
        with jax.ensure_compile_time_eval():
            bounds = np.asarray(link_boundaries(space, a))
    else:
        a = jnp.asarray(assignment, jnp.int32)
        quantizes = jnp.asarray(choices.quantize)[a[:space.num_layers]]
        bounds = link_boundaries(space, a)
    js = module_boundaries(space, split, choices.send_input)
    qbits = choices.weight_bits != (FLOAT_BITS,) and any(choices.quantize)
    new_state = {}
    if choices.send_input and split != "fixed":  # the links before the stem's device carry the image
        x = _cuts(space, choices, params["modules"], cg, bounds, js, space.num_layers + 1, x)
    h, new_state["stem"] = O.conv_bn_apply(params["stem"], state["stem"], x, space.stem_stride, train)
    outputs, layer_states = {-1: h}, []
    if searched_mesh:
        inputs, after = _mesh_searched(space, choices, params["modules"], cg, bounds, js)
        outputs[-1] = after(-1, h)
    elif mesh:
        deliver = _mesh_deliver(space, choices, params["modules"], cg, a, bounds, outputs)
    else:
        outputs[-1] = _cuts(space, choices, params["modules"], cg, bounds, js, 0, h)
        deliver = lambda src, dev: outputs[src]  # noqa: E731 - a chain's links apply where the tensor leaves
    for s in space.layers:
        n = s.index
        if searched_mesh:
            srcs = inputs(n, outputs)
        else:
            srcs = [deliver(i, int(a[n]) if mesh else None) for i in space.input_of(n)]
        inp = srcs[0] if len(srcs) == 1 else sum(srcs) / len(srcs)
        p_n = _quantize_layer(params["layers"][n], cg.weight_bits, n, quantizes[n], choices.weight_bits) \
            if qbits else params["layers"][n]
        paths_n = None if gates.paths is None else gates.paths[n]
        y, st = supernet.mixed_op(space, n, p_n, state["layers"][n], gates.weights[n], paths_n, inp, train,
                                  dw_impl, impl)
        if searched_mesh:
            outputs[n] = after(n, y)
        else:
            outputs[n] = y if mesh else _cuts(space, choices, params["modules"], cg, bounds, js, n + 1, y)
        layer_states.append(st)
    new_state["layers"] = tuple(layer_states)
    last = space.num_layers - 1
    logits, new_state["head"] = O.head_apply(params["head"], state["head"],
                                             deliver(last, space.topology.path_order()[-1])
                                             if mesh and not searched_mesh else outputs[last],
                                             train)
    return logits, new_state


# ------------------------------------------------------------------------------------------------ the gates

def weight_gates(key, logits, choices: Choices) -> ComposedGates:
    """One sampled candidate per row of every composed group (a weight step), from logits (weight_bits, module,
    act_bits) over their valid candidates (``Choices.row_masks``)."""
    keys = jax.random.split(key, 3)
    return ComposedGates(*(G.single_path_gates(k, a, m) for k, a, m in zip(keys, logits, choices.row_masks(logits))))


def arch_gates(mode: str, key, logits, choices: Choices, tau=1.0) -> ComposedGates:
    """The gates of an architecture step in the ops' gate mode (``jmsnas.gates.arch_gates``) over every group's
    valid candidates (``Choices.row_masks``); a group with one valid candidate has that one, with gate 1."""
    keys = jax.random.split(key, 3)
    out = []
    for k, a, m, rows in zip(keys, logits, choices.group_masks(), choices.row_masks(logits)):
        if m.sum() == 1:
            col = int(np.flatnonzero(m)[0])
            out.append(G.Gates(jax.nn.one_hot(jnp.full(a.shape[:-1], col), a.shape[-1], dtype=a.dtype),
                               jnp.full(a.shape[:-1] + (1,), col, jnp.int32)))
        else:
            out.append(G.arch_gates(mode, k, a, rows, tau))
    return ComposedGates(*out)


def onehot_gates(choices: Choices, config: Config) -> ComposedGates:
    """The gates of one discrete configuration (only the chosen candidate computed, gate 1)."""
    sizes = (len(choices.weight_bits), choices.num_modules, len(choices.act_bits))
    return ComposedGates(*(G.onehot_gates(idx, k) for idx, k in zip(config[1:], sizes)))


# ------------------------------------------------------------------------------------------- the derived network

class Derived(NamedTuple):
    """The static description of a derived composed network (hashable): ops, the weight bits each layer runs at
    (32 where its device does not quantize), and per link (topology order) its boundary, reduction r (0: none)
    and transmitted bits; ``choices``, ``config`` (``Config`` as tuples) and ``assignment`` are what
    ``compose.network.composed_apply`` computes it from."""

    ops: tuple
    weight_bits: tuple
    bounds: tuple
    reductions: tuple
    act_bits: tuple
    choices: Choices
    config: tuple
    assignment: tuple


def derived(space, choices: Choices, config: Config, assignment) -> Derived:
    """The ``Derived`` network of ``config`` under the split ``assignment`` (None: D^m)."""
    a = np.asarray(space.layer_devices() if assignment is None else assignment)
    wb = tuple(choices.weight_bits[int(b)] if choices.quantize[int(d)] else FLOAT_BITS
               for b, d in zip(config.weight_bits, a))
    bounds = tuple(int(j) for j in np.asarray(link_boundaries(space, a)))
    shapes = boundary_shapes(space, True)
    red = tuple(0 if int(k) == 0 or not reduces(shapes[j][1], choices.modules[int(k) - 1])
                else choices.modules[int(k) - 1] for k, j in zip(config.module, bounds))
    return Derived(tuple(int(i) for i in config.ops), wb, bounds, red,
                   tuple(choices.act_bits[int(b)] for b in config.act_bits), choices,
                   tuple(tuple(int(v) for v in np.asarray(g)) for g in config), tuple(int(d) for d in a))


def extract(space, params, state, net: Derived):
    """The compact parameters (``supernet.extract``) plus the modules of the cuts that have one."""
    cp, cs = supernet.extract(space, params, state, net.ops)
    cp = dict(cp)
    cp["modules"] = {str(j): params["modules"][str(j)] for j, r in zip(net.bounds, net.reductions) if r}
    return cp, cs


def compact_apply(space, net: Derived, params, state, x, *, train: bool, dw_impl: str = "auto"):
    """Forward of the derived network (``extract``'s parameters, modules included): the deployed network,
    ``compose.network.composed_apply`` (its ops with weights fake-quantized at their bits, and on every link its
    module, reduce -> transmitted tensor at its bits -> recover, or the tensor at its bits), so stage 2 trains
    exactly what the parts compute."""
    config = Config(*(np.asarray(g, np.int64) for g in net.config))
    return composed_apply(space, net.choices, config, np.asarray(net.assignment), params, state, params["modules"],
                          x, train, dw_impl)
