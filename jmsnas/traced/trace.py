"""A user model's traced program (``jax.make_jaxpr`` at batch 1) as jmsnas's layer graph (``graph.NetSpec``).

Tracing: ``apply(params, x)`` is traced once with one example; calls (jit, custom_jvp/vjp, remat) are inlined so
the program is a flat list of primitive ops over numbered values, and ops that do not reach the output are
dropped. A value is an *activation* when it depends on the input ``x``, *static* otherwise (parameters,
constants and what is computed from them alone, e.g. batch norm's ``scale * rsqrt(var + eps)``).

Layers (the zoo's conventions, ``split.zoo``): an *anchor* op starts a layer: a convolution (``conv``, or
``dwconv`` when every group has one input channel), a ``dot_general`` (``fc`` with a static operand, ``matmul``
between two activations), a reduction or pooling window (``pool``), an op reading two or more activations
(``add`` for add/sub, ``mul``, ``concat``, ...) and any op with several results. Every other op (element-wise,
reshapes, broadcasts with constants) joins the layer of its one activation input when that input is the layer's
current output and nothing else reads it, so a convolution with its bias, batch norm and activation is one layer
and a residual sum with its ReLU another; otherwise it starts an ``act`` layer.

Per layer: ``macs`` = multiply-accumulates of its convolutions and dot products (per example; element-wise work,
pooling and sums count 0), ``params`` = elements of the parameter leaves (``ref.counted``) its ops read (a
leaf read by several layers counts in the first), ``out_shape`` = its output without the batch dimension and
``inputs`` = the layers whose outputs it reads. The cut before layer k carries every activation made before k and
read at or after k (``live``), skip connections included, which is what ``split.solvers.cut_bytes`` charges for
the same edges. Layer names come from flax's module scopes (``Net/layer1_0/conv1`` -> ``layer1_0.conv1``), else
from the path of the layer's first parameter, else ``<kind><index>``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.traced.ref import ModelRefError, UserModel, counted, leaf_names, resolve

_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "checkpoint", "remat", "remat2", "custom_lin")
_POOL = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
         "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window", "cumsum", "cummax",
         "cumprod", "cummin", "sort", "top_k")
_UNTRACEABLE = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError,
                jax.errors.UnexpectedTracerError)


class Op(NamedTuple):
    """One primitive application: ``outs = prim.bind(*ins, **params)`` over value ids."""

    prim: object
    params: dict
    ins: tuple
    outs: tuple
    scope: str


class Traced(NamedTuple):
    """A traced model (one example; ``run.py`` evaluates it for any batch).

    Value ids: ``0 .. len(leaf_names)-1`` are the parameter leaves (flattening order of ``model.params``),
    ``input_id`` the example, ``consts`` maps constant ids to arrays; ``avals`` maps every id to (shape, dtype).
    ``ops`` are in program order; ``layer_of_op[i]`` is op i's layer (-1 for a static op). ``layer_outs[k]``: the
    ids layer k hands on; ``live[k]``: the ids crossing the cut before layer k (``live[0] == (input_id,)``,
    ``live[N] == (output_id,)``); ``layer_leaves[k]``: leaf ids counted in layer k; ``kernels[k]``: leaf ids
    of its anchor's weights with 2+ dimensions (what weight quantization acts on).
    """

    model: UserModel
    net: NetSpec
    leaf_names: tuple
    input_id: int
    output_id: int
    output_shape: tuple
    consts: dict
    avals: dict
    ops: tuple
    layer_of_op: tuple
    layer_outs: tuple
    live: tuple
    layer_leaves: tuple
    kernels: tuple
    treedef: object


class _Flat:
    def __init__(self):
        self.ops, self.consts, self.avals = [], {}, {}
        self.next = 0

    def new(self, aval) -> int:
        i = self.next
        self.next += 1
        self.avals[i] = (tuple(int(d) for d in aval.shape), str(aval.dtype))
        return i

    def const(self, value, aval) -> int:
        """A constant of the program (a literal or a closed-over array) with the dtype its use was traced with."""
        if not isinstance(value, jax.Array):
            value = np.asarray(value, dtype=aval.dtype)
        i = self.new(aval)
        self.consts[i] = value
        return i

    def inline(self, jaxpr, const_ids, in_ids, scope: str) -> list:
        env = dict(zip(jaxpr.constvars, const_ids))
        env.update(zip(jaxpr.invars, in_ids))
        read = lambda v: self.const(v.val, v.aval) if isinstance(v, jcore.Literal) else env[v]
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            inner = " ".join(str(eqn.source_info.name_stack).split())
            where = "/".join(s for s in (scope, inner) if s)
            sub = _sub_jaxpr(eqn)
            if sub is not None:
                sj, consts = sub
                outs = self.inline(sj, [self.const(c, v.aval) for c, v in zip(consts, sj.constvars)], ins, where)
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.ops.append(Op(eqn.primitive, dict(eqn.params), tuple(ins), tuple(outs), where))
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def _sub_jaxpr(eqn):
    """(jaxpr, consts) of a call-like op to inline, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is None:
            continue
        if hasattr(j, "jaxpr") and hasattr(j, "consts"):
            return j.jaxpr, list(j.consts)
        if hasattr(j, "eqns"):
            return j, []
    return None


def _trace_error(name: str, x_desc: str, e: BaseException) -> ModelRefError:
    text = " ".join(str(e).split())
    text = text[:300] + ("..." if len(text) > 300 else "")
    if isinstance(e, _UNTRACEABLE):
        return ModelRefError(f"model {name!r}: apply(params, x) cannot be traced with jax.make_jaxpr "
                             f"({type(e).__name__}: {text.split('. ')[0]}); expected a function of jax operations "
                             "without Python control flow on array values")
    return ModelRefError(f"model {name!r}: the parameters do not match the apply function: apply(params, "
                         f"{x_desc}) raised {type(e).__name__}: {text}")


def _jaxpr(model: UserModel):
    leaves, treedef = jax.tree_util.tree_flatten(model.params)
    bad = [n for n, l in zip(leaf_names(model.params), leaves) if not hasattr(l, "shape") or not hasattr(l, "dtype")]
    if bad:
        raise ModelRefError(f"model {model.name!r}: parameter leaves {bad[:3]} are not arrays")
    x = jax.ShapeDtypeStruct((1,) + tuple(model.input_shape), np.dtype(model.input_dtype))
    x_desc = f"x {model.input_dtype}[1, {', '.join(map(str, model.input_shape))}]"
    specs = [jax.ShapeDtypeStruct(tuple(l.shape), l.dtype) for l in leaves]
    try:
        closed, out_shape = jax.make_jaxpr(lambda ls, x: model.apply(jax.tree_util.tree_unflatten(treedef, ls), x),
                                           return_shape=True)(specs, x)
    except ModelRefError:
        raise
    except Exception as e:  # noqa: BLE001 - anything the user's function raises while tracing
        raise _trace_error(model.name, x_desc, e) from None
    outs = jax.tree_util.tree_leaves(out_shape)
    if len(outs) != 1:
        raise ModelRefError(f"model {model.name!r}: apply(params, x) returns {len(outs)} arrays; expected one "
                            "(the logits)")
    return closed, treedef, len(leaves), tuple(outs[0].shape)


def _act_flags(flat: _Flat, input_id: int):
    act = {input_id}
    for op in flat.ops:
        if any(i in act for i in op.ins):
            act.update(op.outs)
    return act


def _live_ops(ops, output_id: int) -> list:
    need, keep = {output_id}, []
    for i in range(len(ops) - 1, -1, -1):
        if any(o in need for o in ops[i].outs):
            keep.append(i)
            need.update(ops[i].ins)
    return sorted(keep)


def _kind(op: Op, acts: list, avals: dict) -> str:
    name = op.prim.name
    if name == "conv_general_dilated":
        lhs = avals[op.ins[0]][0]
        dn = op.params["dimension_numbers"]
        cin = lhs[dn.lhs_spec[1]]
        g = int(op.params.get("feature_group_count", 1))
        return "dwconv" if g > 1 and g == cin else "conv"
    if name == "dot_general":
        return "matmul" if len(acts) > 1 else "fc"
    if name in _POOL:
        return "pool"
    if len(acts) > 1:
        return {"add": "add", "sub": "add", "add_any": "add", "mul": "mul", "concatenate": "concat"}.get(name, name)
    return name if len(op.outs) > 1 else "act"


def _macs(op: Op, avals: dict) -> int:
    name = op.prim.name
    out = math.prod(avals[op.outs[0]][0])
    if name == "conv_general_dilated":
        rhs = avals[op.ins[1]][0]
        return out * math.prod(rhs) // rhs[op.params["dimension_numbers"].rhs_spec[0]]
    if name == "dot_general":
        (lc, _), _ = op.params["dimension_numbers"]
        lhs = avals[op.ins[0]][0]
        return out * math.prod(lhs[d] for d in lc)
    return 0


def _per_example(shape: tuple) -> tuple:
    return tuple(shape[1:]) if len(shape) > 1 else (tuple(shape) or (1,))


def trace(model) -> Traced:
    """The traced program and layer graph of a ``UserModel`` or a reference (``ref.resolve``)."""
    model = resolve(model)
    closed, treedef, n_leaves, out_shape = _jaxpr(model)
    flat = _Flat()
    leaf_ids = [flat.new(v.aval) for v in closed.jaxpr.invars[:n_leaves]]
    input_id = flat.new(closed.jaxpr.invars[n_leaves].aval)
    consts = [flat.const(c, v.aval) for c, v in zip(closed.consts, closed.jaxpr.constvars)]
    (output_id,) = flat.inline(closed.jaxpr, consts, leaf_ids + [input_id], "")
    act = _act_flags(flat, input_id)
    if output_id not in act or output_id == input_id:
        raise ModelRefError(f"model {model.name!r}: the output of apply(params, x) does not depend on x through "
                            "any operation")
    keep = _live_ops(flat.ops, output_id)
    ops = [flat.ops[i] for i in keep]
    avals = flat.avals
    consumers: dict = {}
    for op in ops:
        if any(i in act for i in op.outs):
            for i in set(op.ins):
                consumers[i] = consumers.get(i, 0) + 1
    consumers[output_id] = consumers.get(output_id, 0) + 1
    producer_of_static = {o: op for op in ops for o in op.outs if o not in act}

    names_all = leaf_names(model.params)
    is_counted = counted(model.params)
    collections = isinstance(model.params, dict) and "params" in model.params
    leaf_memo: dict = {}

    def leaves_of(i) -> tuple:
        if i < n_leaves:
            return (i,)
        if i not in producer_of_static:
            return ()
        if i not in leaf_memo:
            leaf_memo[i] = tuple(dict.fromkeys(l for j in producer_of_static[i].ins for l in leaves_of(j)))
        return leaf_memo[i]

    layer_of_value = {input_id: -1}
    layer_of_op, tails, kinds, macs, inputs, anchors, outs_of = [], [], [], [], [], [], []
    for op in ops:
        if not any(i in act for i in op.ins):
            layer_of_op.append(-1)
            continue
        acts = list(dict.fromkeys(i for i in op.ins if i in act))
        anchor = (op.prim.name in ("conv_general_dilated", "dot_general") or op.prim.name in _POOL
                  or len(acts) > 1 or len(op.outs) > 1)
        if not anchor:
            a = acts[0]
            k = layer_of_value[a]
            if k >= 0 and tails[k] == a and consumers.get(a, 0) == 1:
                layer_of_op.append(k)
                tails[k] = op.outs[0]
                outs_of[k] = [op.outs[0]]
                layer_of_value[op.outs[0]] = k
                continue
        k = len(tails)
        layer_of_op.append(k)
        tails.append(op.outs[0] if len(op.outs) == 1 else None)
        outs_of.append(list(op.outs))
        kinds.append(_kind(op, acts, avals))
        macs.append(_macs(op, avals))
        inputs.append(tuple(dict.fromkeys(layer_of_value[a] for a in acts if layer_of_value[a] >= 0)))
        anchors.append(op)
        for o in op.outs:
            layer_of_value[o] = k
    n = len(tails)

    # leaves per layer (first reader), kernels of anchors
    owner: dict = {}
    for op, k in zip(ops, layer_of_op):
        if k < 0:
            continue
        for i in op.ins:
            if i not in act:
                for l in leaves_of(i):
                    owner.setdefault(l, k)
    layer_leaves = [[] for _ in range(n)]
    for l, k in owner.items():
        layer_leaves[k].append(l)
    kernels = []
    for k, op in enumerate(anchors):
        ks = [l for i in op.ins if i not in act for l in leaves_of(i)
              if owner.get(l) == k and len(avals[l][0]) >= 2]
        kernels.append(tuple(dict.fromkeys(ks)))

    # live values at every cut
    last_read: dict = {}
    for op, k in zip(ops, layer_of_op):
        if k >= 0:
            for i in op.ins:
                if i in act:
                    last_read[i] = max(last_read.get(i, -1), k)
    live = []
    for c in range(n + 1):
        if c == n:
            live.append((output_id,))
            continue
        live.append(tuple(v for v, k in layer_of_value.items() if k < c and last_read.get(v, -1) >= c))
    # a layer's outputs: its values read by a later layer (or the network output)
    layer_outs = []
    for k in range(n):
        vs = [v for v in outs_of[k] if last_read.get(v, -1) > k or v == output_id]
        if not vs:  # multi-result op whose outputs are read inside the layer only cannot happen; keep shape
            vs = outs_of[k][:1]
        layer_outs.append(tuple(vs))

    # names
    scopes = [op.scope for op in anchors]
    roots = {s.split("/")[0] for s in scopes if s}
    strip = len(roots) == 1 and all("/" in s or s in roots for s in scopes if s)
    used, layers = set(), []
    for k, op in enumerate(anchors):
        s = scopes[k]
        if strip and s:
            s = s.split("/", 1)[1] if "/" in s else ""
        base = s.replace("/", ".")
        if not base and layer_leaves[k]:
            mine = list(kernels[k]) or [l for l in layer_leaves[k] if is_counted[l]] or layer_leaves[k]
            path = names_all[min(mine)].split("/")[:-1]  # without the leaf ("kernel")
            base = ".".join(path[1:] if collections else path)
        if kinds[k] not in ("conv", "dwconv", "fc") or not base:
            base = f"{base}.{kinds[k]}" if base else kinds[k]
        name, j = base, 1
        while name in used:
            j += 1
            name = f"{base}#{j}"
        used.add(name)
        outs = layer_outs[k]
        shape = _per_example(avals[outs[0]][0]) if len(outs) == 1 else (sum(math.prod(avals[v][0]) for v in outs),)
        params = sum(math.prod(avals[l][0]) for l in layer_leaves[k] if is_counted[l])
        layers.append(LayerSpec(name, kinds[k], int(macs[k]), int(params), shape, inputs[k]))
    net = NetSpec(model.name, tuple(model.input_shape), tuple(layers))
    net.validate()
    return Traced(model, net, tuple(names_all), input_id, output_id, out_shape, flat.consts, avals, tuple(ops),
                  tuple(layer_of_op), tuple(layer_outs), tuple(live), tuple(tuple(sorted(l)) for l in layer_leaves),
                  tuple(kernels), treedef)


def net_spec(model) -> NetSpec:
    """The layer graph of a model or reference (``trace(model).net``)."""
    return trace(model).net


def live_elems(t: Traced) -> list:
    """Elements per example crossing every cut 0..N (what ``solvers.cut_bytes`` charges, divided by the bytes per
    element)."""
    return [sum(math.prod(t.avals[v][0]) for v in vs) for vs in t.live]
