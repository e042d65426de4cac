"""Timing FBNet networks on this JAX backend: whole networks (what ``jmsnas validate`` and adaptation read) and a
per-layer table (``profile_table``).

Each network or block is jitted once in inference mode (batch-norm running statistics) with fixed weights and
input and timed by ``jmsnas.cost.profile.time_rounds``: every timed call follows an untimed call of the same
function, items in a shuffled order per round, so a burst of load hits all of them alike; the median of the
rounds is kept.

``profile_table``: the entry of op o at layer l is the median, over rounds, of the time of that block alone on the
layer's input minus that of a near-empty call with the same arguments in the same round (the per-call overhead,
which a whole network pays once); layers with equal shapes share their measurement. The fixed term is the stem
and head run as one call (overhead included). ``jmsnas validate`` reports how well the sum predicts whole
networks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.cost import layertable as LT
from jmsnas.cost.profile import backend_info, time_rounds
from jmsnas.fbnet import net
from jmsnas.fbnet.space import FBNetSpace

_KEY = 0  # weight values do not change timings


def _fill(shapes):
    """Weights for timing (values do not change timings, but must stay normal floats: denormals are slow)."""
    return net.numpy_init(shapes, _KEY)


def network_call(space: FBNetSpace, arch, batch: int = 1, dw_impl: str = "auto"):
    """(jitted fn, args): the inference forward of network ``arch`` on a batch of ``batch`` images."""
    arch = tuple(int(i) for i in arch)
    params, state = _fill(jax.eval_shape(lambda: net.init(jax.random.PRNGKey(_KEY), space, arch)))
    x = jnp.ones((batch, space.image_size, space.image_size, space.in_channels), jnp.float32)
    fn = jax.jit(lambda p, s, x: net.apply(space, arch, p, s, x, train=False, dw_impl=dw_impl)[0])
    return fn, (params, state, x)


def export_network(space: FBNetSpace, arch, batch: int = 1) -> bytes:
    """Network ``arch`` as a serialised ``jax.export`` program of its input only (weights are constants), for a
    ``jmsnas worker`` on another machine (``jmsnas.deploy.timer``). Its depthwise convolutions are the "shifted" XLA form
    (``jmsnas.dwconv``): a program holds no jmsnas custom call (the native CPU kernels are not exportable)."""
    from jax import export
    fn, (params, state, x) = network_call(space, arch, batch, dw_impl="shifted")
    prog = export.export(jax.jit(lambda x: fn(params, state, x)))(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return bytes(prog.serialize())


def measure_networks(space: FBNetSpace, archs, *, batch: int = 1, reps: int = 20, warmup: int = 2,
                     seed: int = 0) -> np.ndarray:
    """float64[K]: median ms of each whole network in ``archs`` (int[K, 22])."""
    calls = [network_call(space, a, batch) for a in np.asarray(archs, np.int64)]
    samples = time_rounds([[c] for c in calls], reps, warmup, seed)
    return np.array([float(np.median(s[0])) for s in samples])


def _block_call(space: FBNetSpace, n: int, i: int, batch: int):
    lay, b = space.layers[n], space.blocks[i]
    p, s = _fill(jax.eval_shape(lambda: net.block_init(jax.random.PRNGKey(_KEY), b, lay)))
    x = jnp.ones((batch, lay.in_hw, lay.in_hw, lay.in_ch), jnp.float32)
    return jax.jit(lambda p, s, x: net.block_apply(p, s, x, b, lay, train=False)[0]), (p, s, x)


def _reference(call):
    """A jitted near-empty call taking the same arguments as ``call`` (the per-call overhead)."""
    fn, args = call
    return jax.jit(lambda p, s, x: x[:1, :1, :1, :1] + 1.0), args


def _stem_head_call(space: FBNetSpace, batch: int):
    params, state = _fill(jax.eval_shape(lambda: net._stem_head_init(jax.random.PRNGKey(_KEY), space)))
    x = jnp.ones((batch, space.image_size, space.image_size, space.in_channels), jnp.float32)
    last = space.layers[-1]

    def f(p, s, x):
        h, _ = net._stem(p["stem"], s["stem"], x, False)
        h = jnp.zeros((x.shape[0], last.out_hw, last.out_hw, last.out_ch), h.dtype) + jnp.mean(h)
        return net._head(p["head"], s["head"], h, False)[0]
    return jax.jit(f), (params, state, x)


def profile_table(space: FBNetSpace, *, device: str, batch: int = 1, reps: int = 20, warmup: int = 2,
                  seed: int = 0) -> LT.LayerTable:
    """A LayerTable of ``space`` measured here (module docstring)."""
    shape = lambda l: (l.in_ch, l.out_ch, l.in_hw, l.stride)
    reps_of = {}
    for lay in space.layers:
        reps_of.setdefault(shape(lay), lay.index)
    items = [(n, i) for n in reps_of.values() for i in range(len(space.blocks))]
    groups = [[c, _reference(c)] for c in [_block_call(space, n, i, batch) for n, i in items]]
    samples = time_rounds(groups + [[_stem_head_call(space, batch)]], reps, warmup, seed)
    # a block's entry: its call minus a near-empty call with the same arguments, timed in the same rounds
    # (the per-call overhead is paid once by a whole network: the fixed term's call carries it)
    ms = [max(float(np.median(s[0] - s[1])), 0.0) for s in samples[:-1]] + [float(np.median(samples[-1][0]))]
    got = dict(zip(items, ms[:-1]))
    entry = np.array([[got[(reps_of[shape(l)], i)] for i in range(len(space.blocks))] for l in space.layers])
    info = backend_info()
    return LT.make(ms[-1], entry, space.op_names, space=space.name, device=device,
                   source=f"profiled here ({info['cpu']}, {info['backend']}, XLA_FLAGS={info['xla_flags']!r}, "
                          f"batch {batch}, {reps} rounds)")
