"""Your own model (``jmsnas.traced``) as a chain of blocks for modularization (paper 002).

``from_traced(model)`` cuts the traced layer graph at its cut points (``blocks.zoo_cut_points``: places where
exactly one tensor is live, so a residual block with its skip stays whole) and makes every run of layers between
two of them a block. A block's spec holds its forward as a serialized ``jax.export`` program with a symbolic batch
dimension (base64, JSON-safe), so a child on disk runs without the model's code, at any batch size; its
parameters are the layer range's leaves (``p0``, ``p1``, ... in the spec's ``args`` order; ``leaves`` names them
as in the model, e.g. ``params/conv1/kernel``). The load-time balance then works from each block's bytes and
arrays exactly as for zoo networks and runs, as do parallel loading and inference while loading.
"""
from __future__ import annotations

import base64

import jax
import numpy as np
from jax import export as jax_export

from jmsnas.modular.blocks import Block, ModularError, Network, zoo_cut_points


def _platforms() -> tuple:
    here = jax.default_backend()
    here = "cuda" if here == "gpu" else here
    return tuple(dict.fromkeys(("cpu", here)))


def from_traced(model) -> Network:
    """Blocks of a model reference or ``traced.ref.UserModel`` (see the module docstring)."""
    from jmsnas.traced import run
    from jmsnas.traced.trace import trace
    t = trace(model)
    leaves = run.leaves_dict(t)
    (bdim,) = jax_export.symbolic_shape("b")
    blocks, start = [], 0
    for cut in zoo_cut_points(t.net):
        a, b = start, cut + 1
        ids = run.segment_leaves(t, a, b)
        seg = run.segment(t, a, b)
        shape, dtype = t.avals[t.live[a][0]]

        def fn(*args, ids=ids, seg=seg):
            return seg(dict(zip(ids, args[:-1])), args[-1])[0]
        specs = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in ids]
        specs.append(jax.ShapeDtypeStruct((bdim,) + run.batch_shape(shape, 1)[1:], np.dtype(dtype)))
        try:
            exp = jax_export.export(jax.jit(fn), platforms=_platforms())(*specs)
        except Exception as e:  # noqa: BLE001 - an op without a batching rule for a symbolic batch, ...
            raise ModularError(f"model {t.model.name!r}: layers {a}..{b - 1} cannot be exported as a block: "
                               f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        names = [t.net.layers[k].name for k in (a, b - 1)]
        label = names[0] if a == b - 1 else f"{names[0]}..{names[1]}"
        spec = {"kind": "traced", "program": base64.b64encode(bytes(exp.serialize())).decode("ascii"),
                "args": [f"p{j}" for j in range(len(ids))], "leaves": [t.leaf_names[i] for i in ids],
                "layers": [a, b]}
        blocks.append(Block(label, spec, {f"p{j}": np.asarray(leaves[i], np.float32 if leaves[i].dtype ==
                                                               np.float32 else leaves[i].dtype)
                                          for j, i in enumerate(ids)}))
        start = b
    return Network(f"traced:{t.model.name}", tuple(t.model.input_shape), tuple(blocks))
