"""Running a traced model (``trace.Traced``) by layer ranges: the pieces parts, blocks and quantization are made of.

``segment(t, start, stop)`` returns ``f(leaves, *xs) -> ys``: layers ``start .. stop-1`` of the traced program
for a batch, ``xs`` the values crossing the cut before ``start`` (``t.live[start]``; the image for 0) and ``ys``
those crossing the cut before ``stop`` (the model's output for N). ``leaves`` maps leaf ids to arrays (only the
leaves the segment reads, ``segment_leaves``). The program was traced for one example; a batch runs it per
example under ``jax.vmap``, so a value of shape (1, ...) for one example is (B, ...) for B (any other per-example
shape gains a leading B). Static values (computed from parameters alone) are recomputed in every segment that
reads them.

Quantization on the traced graph (Auto-Split): with ``wbits``/``abits``/``ranges`` (int32[N], int32[N],
float32[N, 2]; 0 bits = float, traced arrays so one compilation serves every assignment) a layer's kernels
(``t.kernels``) are fake-quantized at its weight bits and its outputs at its activation bits over its range.
``pack``/``unpack`` turn several values crossing one cut into one float32[B, elements] tensor and back (one
transfer per link, as the deploy format sends one tensor per part).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.quant.quantizers import fake_quant_act, fake_quant_weight
from jmsnas.traced.trace import Traced


def _bind(op, args) -> list:
    got = op.prim.get_bind_params(op.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)  # older jax: (subfuns, params)
    out = op.prim.bind(*subfuns, *args, **params)
    return list(out) if op.prim.multiple_results else [out]


def _static_producers(t: Traced) -> dict:
    return {o: op for op, k in zip(t.ops, t.layer_of_op) if k < 0 for o in op.outs}


def segment_ops(t: Traced, start: int, stop: int) -> list:
    """Indices of the ops a segment evaluates: its layers' ops and the static ops they need."""
    prod = {o: i for i, (op, k) in enumerate(zip(t.ops, t.layer_of_op)) if k < 0 for o in op.outs}
    need, idx = set(), []
    for i, (op, k) in enumerate(zip(t.ops, t.layer_of_op)):
        if start <= k < stop:
            idx.append(i)
            need.update(op.ins)
    stack = [v for v in need if v in prod]
    seen = set()
    while stack:
        v = stack.pop()
        i = prod[v]
        if i in seen:
            continue
        seen.add(i)
        for j in t.ops[i].ins:
            if j in prod:
                stack.append(j)
    return sorted(set(idx) | seen)


def segment_leaves(t: Traced, start: int, stop: int) -> list:
    """Leaf ids a segment reads (directly or through static ops)."""
    n = len(t.leaf_names)
    return sorted({i for j in segment_ops(t, start, stop) for i in t.ops[j].ins if i < n})


def run_example(t: Traced, leaves: dict, start: int, stop: int, xs, wbits=None, abits=None, ranges=None,
                collect: bool = False):
    """Values of ``t.live[stop]`` for one example (batch-1 shapes) from those of ``t.live[start]``; with
    ``collect`` also every layer's outputs (a list over layers start..stop-1 of lists of arrays)."""
    env = dict(zip(t.live[start], xs))
    leaves = dict(leaves)
    if wbits is not None:
        for k in range(start, stop):
            for l in t.kernels[k]:
                if l in leaves:
                    leaves[l] = fake_quant_weight(leaves[l], wbits[k])
    env.update(leaves)
    producers = _static_producers(t)

    def get(i):
        if i in env:
            return env[i]
        if i in t.consts:
            env[i] = jnp.asarray(t.consts[i])
            return env[i]
        op = producers[i]
        env.update(zip(op.outs, _bind(op, [get(j) for j in op.ins])))
        return env[i]

    outs_of = {v: k for k, vs in enumerate(t.layer_outs) for v in vs}
    collected = [[] for _ in range(start, stop)]
    for op, k in zip(t.ops, t.layer_of_op):
        if not start <= k < stop:
            continue
        for v, y in zip(op.outs, _bind(op, [get(i) for i in op.ins])):
            if outs_of.get(v) == k:
                if abits is not None and jnp.issubdtype(y.dtype, jnp.floating):  # not a cond's predicate or index
                    y = fake_quant_act(y, ranges[k, 0], ranges[k, 1], abits[k])
                if collect:
                    collected[k - start].append(y)
            env[v] = y
    ys = [env[v] for v in t.live[stop]]
    return (ys, collected) if collect else ys


def example_shape(t: Traced, v: int) -> tuple:
    return t.avals[v][0]


def batch_shape(shape: tuple, batch: int) -> tuple:
    """Shape of a value for ``batch`` examples given its one-example shape."""
    shape = tuple(shape)
    return (batch,) + (shape[1:] if shape and shape[0] == 1 else shape)


def _to_example(x, shape):
    return x[None] if shape and shape[0] == 1 else x


def _from_example(y, shape):
    return y[0] if shape and shape[0] == 1 else y


def segment(t: Traced, start: int, stop: int, quant: bool = False):
    """f(leaves: dict, *xs) -> list of batched values of ``t.live[stop]`` (see the module docstring); with
    ``quant`` f(leaves, wbits, abits, ranges, *xs)."""
    in_shapes = [example_shape(t, v) for v in t.live[start]]
    out_shapes = [example_shape(t, v) for v in t.live[stop]]

    def one(leaves, q, xs):
        ys = run_example(t, leaves, start, stop, [_to_example(x, s) for x, s in zip(xs, in_shapes)], *q)
        return [_from_example(y, s) for y, s in zip(ys, out_shapes)]

    if quant:
        return lambda leaves, wbits, abits, ranges, *xs: jax.vmap(
            lambda *e: one(leaves, (wbits, abits, ranges), e))(*xs)
    return lambda leaves, *xs: jax.vmap(lambda *e: one(leaves, (), e))(*xs)


def layer_outputs(t: Traced):
    """f(leaves, x) -> list over layers of float32[B, elements]: every layer's outputs (flattened, concatenated)."""
    n = len(t.net.layers)

    def one(leaves, x):
        _, col = run_example(t, leaves, 0, n, [_to_example(x, example_shape(t, t.input_id))], collect=True)
        return [jnp.concatenate([jnp.reshape(y, (-1,)).astype(jnp.float32) for y in ys]) for ys in col]
    return lambda leaves, x: jax.vmap(lambda e: one(leaves, e))(x)


def leaves_dict(t: Traced, params=None) -> dict:
    """{leaf id: array} of the model's parameters (or of ``params`` with the same structure)."""
    flat = jax.tree_util.tree_leaves(t.model.params if params is None else params)
    return {i: jnp.asarray(l) for i, l in enumerate(flat)}


def pack(ys, batch: int):
    """One tensor for the values of a cut: the value itself when there is one, else float32[B, elements]."""
    if len(ys) == 1:
        return ys[0]
    return jnp.concatenate([jnp.reshape(y, (batch, -1)).astype(jnp.float32) for y in ys], axis=1)


def unpack(t: Traced, cut: int, packed, batch: int) -> list:
    """The values of ``t.live[cut]`` from ``pack``'s tensor."""
    vs = t.live[cut]
    if len(vs) == 1:
        return [packed]
    out, at = [], 0
    for v in vs:
        shape, dtype = t.avals[v]
        bs = batch_shape(shape, batch)
        size = math.prod(bs[1:])
        out.append(jnp.reshape(packed[:, at:at + size], bs).astype(dtype))
        at += size
    return out


def packed_shape(t: Traced, cut: int, batch: int) -> tuple:
    """(shape, dtype) of ``pack``'s tensor at a cut."""
    vs = t.live[cut]
    if len(vs) == 1:
        shape, dtype = t.avals[vs[0]]
        return batch_shape(shape, batch), dtype
    return (batch, sum(math.prod(batch_shape(t.avals[v][0], 1)[1:]) for v in vs)), "float32"


def forward(t: Traced):
    """Jitted f(leaves, x) -> the model's output for a batch x, through the traced program (all layers)."""
    seg = segment(t, 0, len(t.net.layers))
    return jax.jit(lambda leaves, x: seg(leaves, x)[0])


def quant_forward(t: Traced):
    """Jitted f(leaves, x, wbits, abits, ranges) -> output with layer k's kernels at wbits[k] and its outputs at
    abits[k] over ranges[k] (0 = float)."""
    seg = segment(t, 0, len(t.net.layers), quant=True)
    return jax.jit(lambda leaves, x, wbits, abits, ranges: seg(leaves, wbits, abits, ranges, x)[0])


def float_bits(t: Traced):
    n = len(t.net.layers)
    return np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros((n, 2), np.float32)
