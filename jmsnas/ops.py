"""Candidate operations as pure functions over explicit parameter and batch-norm state dicts (NHWC).

An MBConv is: 1x1 expand conv -> BN -> ReLU6 -> k x k depthwise conv (stride) -> BN -> ReLU6 -> 1x1 project conv
-> BN, plus the input when it has a shortcut. Pointwise convolutions are matrix products over the channel axis;
the depthwise convolution comes from ``jmsnas.dwconv`` so the backend picks the fast implementation.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas import native
from jmsnas.dwconv import depthwise_conv, matmul, pad_input, pointwise_conv
from jmsnas.space import OpSpec

BN_MOMENTUM = 0.9
BN_EPS = 1e-5
NORM_IMPLS = ("auto", "xla", "native")


def _scaled_normal(key, shape, scale: float):
    """float32 N(0, 1) draws times sqrt(``scale``). Called eagerly, the product is taken in NumPy (float32,
    correctly rounded) and placed with device_put, so initialising a network compiles one executable per shape (the
    draws) instead of three (draws, multiply, constant); under a trace (jit, eval_shape) it is the same product
    behind an optimization barrier (so XLA neither fuses nor reassociates it with the draw: the same bits as the
    eager product), and inside :func:`one_draw` the draws come from that function's one batched draw."""
    factor = np.sqrt(np.float32(scale))
    plan = getattr(_DRAWS, "plan", None)
    if plan is not None:
        return plan(key, tuple(shape)) * factor
    z = jax.random.normal(key, shape, jnp.float32)
    if isinstance(z, jax.core.Tracer):
        return lax.optimization_barrier(z) * factor
    return jax.device_put(np.asarray(z) * factor)


_DRAWS = threading.local()  # .plan: where _scaled_normal takes its N(0, 1) draws inside one_draw


@contextlib.contextmanager
def _planned(plan):
    before = getattr(_DRAWS, "plan", None)
    _DRAWS.plan = plan
    try:
        yield
    finally:
        _DRAWS.plan = before


def one_draw(init):
    """``init(key, *args)`` (an initialisation that draws through this module's ``_scaled_normal``) as a function to
    trace, e.g. under ``jax.jit``, that takes all its N(0, 1) draws at once: one threefry per power-of-two size
    (``jax.vmap`` of ``jax.random.normal`` over the draws' keys, each cut to its size) instead of one per draw. A
    program with one threefry per weight shape took XLA:CPU about as long to compile as the whole supernet's
    eager initialisation (27 draws, ~9 s CPU on a loaded 2-core machine); batched, one threefry compiles in well
    under a second. The bits are the same as each ``jax.random.normal(key, shape)``: with partitionable threefry
    (JAX's default) element i of a draw depends only on its key and i, so a longer draw cut to ``prod(shape)``
    elements and reshaped is that draw (``tests/test_supernet.py`` checks it). With non-partitionable threefry the
    draws are taken one by one (still in the one program)."""
    def traced(key, *args):
        if not jax.config.jax_threefry_partitionable:
            return init(key, *args)
        requests = []
        with _planned(lambda k, shape: requests.append((k, shape)) or jnp.zeros(shape, jnp.float32)):
            init(key, *args)  # traced once only to learn the draws' keys and shapes (its outputs are dropped)
        by_size = {}
        for j, (_, shape) in enumerate(requests):
            by_size.setdefault(_bucket(math.prod(shape)), []).append(j)
        flat = {}
        for n, js in by_size.items():
            z = jax.vmap(lambda k, n=n: jax.random.normal(k, (n,), jnp.float32))(jnp.stack([requests[j][0] for j in js]))
            z = lax.optimization_barrier(z)  # drawn once: else XLA fuses the draw into every cut, one copy per draw
            for row, j in enumerate(js):
                flat[j] = z[row]
        order = iter(range(len(requests)))

        def replay(k, shape):
            z = flat[next(order)]
            return z[:math.prod(shape)].reshape(shape)

        with _planned(replay):
            return init(key, *args)
    return traced


def _bucket(n: int) -> int:
    """The power of two >= n (at least 1): the length of the batched draw a draw of n elements is cut from."""
    return 1 << max(0, int(n) - 1).bit_length()


def _he(key, shape, fan_in):
    return _scaled_normal(key, shape, 2.0 / fan_in)


def _filled(ch: int, value: float):
    return jax.device_put(np.full((ch,), value, np.float32))


def bn_init(ch: int):
    """Batch-norm parameters and running statistics for ``ch`` channels (placed, not computed: no executable)."""
    params = {"scale": _filled(ch, 1.0), "bias": _filled(ch, 0.0)}
    state = {"mean": _filled(ch, 0.0), "var": _filled(ch, 1.0)}
    return params, state


def _channel_rows(x):
    """x as float[rows, C] (the channel axis last): reductions and matmuls over a 2-D view are the fast forms on
    XLA:CPU (over the 4-D NHWC array the transposed products in the gradients ran 5-7x slower, measured)."""
    return x.reshape(-1, x.shape[-1])


@jax.custom_vjp
def _train_norm(x, scale, bias):
    """Training-mode batch norm over all axes but the last: (y, batch mean, biased batch variance)."""
    return _train_norm_fwd(x, scale, bias)[0]


def _train_norm_fwd(x, scale, bias):
    x2 = _channel_rows(x)
    mean = jnp.mean(x2, 0)
    var = jnp.mean(jnp.square(x2 - mean), 0)
    inv = lax.rsqrt(var + BN_EPS)
    xhat = (x2 - mean) * inv
    return ((xhat * scale + bias).reshape(x.shape), mean, var), (xhat, inv, scale)


def _train_norm_bwd(res, cts):
    """The exact VJP in the usual closed form, from x-hat and 1/sigma (two channel sums, one elementwise pass),
    including the cotangents of the returned mean and variance."""
    xhat, inv, scale = res
    g, g_mean, g_var = cts
    g2 = _channel_rows(g)
    n = g2.shape[0]
    d_bias = jnp.sum(g2, 0)
    d_scale = jnp.sum(g2 * xhat, 0)
    dx = (scale * inv) * (g2 - d_bias / n - xhat * (d_scale / n))
    dx = dx + g_mean / n + xhat * (2.0 * g_var / (n * inv))
    return dx.reshape(g.shape), d_scale, d_bias


_train_norm.defvjp(_train_norm_fwd, _train_norm_bwd)


def resolve_norm_impl(impl: str) -> str:
    """How training-mode batch norm runs: "xla" (``_train_norm``, then the activation, as XLA ops) or "native"
    (``jmsnas.native`` fused batch norm + activation kernels, forward and backward; CPU only). "auto": "native" on
    the CPU backend when the kernels build, else "xla"."""
    if impl not in NORM_IMPLS:
        raise ValueError(f"norm impl must be one of {NORM_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "native" if jax.default_backend() == "cpu" and native.load() else "xla"
    if impl == "native":
        native.require()
    return impl


_ACTS = {None: 0, "relu6": 1}


def _norm_act_call(target: str, shapes, *args, act: int):
    return native.call(target, shapes, *args, act=np.int64(act), eps=np.float32(BN_EPS))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _native_norm_act(x2, scale, bias, act: int):
    """Fused training batch norm + activation on float32[rows, C]: (y, batch mean, biased batch variance)."""
    return _native_norm_act_fwd(x2, scale, bias, act)[0]


def _native_norm_act_fwd(x2, scale, bias, act: int):
    c = x2.shape[1]
    y, mean, var = _norm_act_call("jmsnas_batch_norm_act_forward", [x2.shape, (c,), (c,)], x2, scale, bias,
                                  act=act)
    return (y, mean, var), (x2, scale, bias, mean, var)


def _native_norm_act_bwd(act: int, res, cts):
    x2, scale, bias, mean, var = res
    g, g_mean, g_var = cts
    c = x2.shape[1]
    return tuple(_norm_act_call("jmsnas_batch_norm_act_backward", [x2.shape, (c,), (c,)], x2, scale, bias, mean,
                                var, g, g_mean, g_var, act=act))


_native_norm_act.defvjp(_native_norm_act_fwd, _native_norm_act_bwd)


def _running(state, mean, var):
    return {"mean": BN_MOMENTUM * state["mean"] + (1 - BN_MOMENTUM) * lax.stop_gradient(mean),
            "var": BN_MOMENTUM * state["var"] + (1 - BN_MOMENTUM) * lax.stop_gradient(var)}


def batch_norm_act(params, state, x, train: bool, act: str | None = None, impl: str = "auto"):
    """Batch norm over all axes but the last followed by ``act`` (None or "relu6"); returns (y, new state).

    In training it normalises with the batch statistics and returns updated running ones; with ``impl`` "native"
    (the CPU default, ``resolve_norm_impl``) normalisation and activation run as one fused kernel pair, otherwise
    as XLA ops. Both give the same values and gradients (tests)."""
    if act not in _ACTS:
        raise ValueError(f"act must be one of {tuple(_ACTS)}, got {act!r}")
    if train and resolve_norm_impl(impl) == "native":
        dtype = x.dtype
        y, mean, var = _native_norm_act(_channel_rows(x).astype(jnp.float32), params["scale"].astype(jnp.float32),
                                        params["bias"].astype(jnp.float32), _ACTS[act])
        return y.reshape(x.shape).astype(dtype), _running(state, mean, var)
    if train:
        y, mean, var = _train_norm(x, params["scale"], params["bias"])
        new_state = _running(state, mean, var)
    else:
        y = (x - state["mean"]) * lax.rsqrt(state["var"] + BN_EPS) * params["scale"] + params["bias"]
        new_state = state
    return (jax.nn.relu6(y) if act == "relu6" else y), new_state


def batch_norm(params, state, x, train: bool, impl: str = "auto"):
    """Batch norm over all axes but the last; in training uses batch statistics and returns updated running ones."""
    return batch_norm_act(params, state, x, train, None, impl)


def pointwise(x, w):
    """1x1 convolution x[B, H, W, Cin] @ w[Cin, Cout] (``dwconv.pointwise_conv``: one matmul on the 2-D view)."""
    return pointwise_conv(x, w)


def mbconv_init(key, op: OpSpec, in_ch: int, out_ch: int):
    """Parameters and BN state of one MBConv candidate."""
    mid = in_ch * op.expand
    k1, k2, k3 = jax.random.split(key, 3)
    params, state = {}, {}
    params["expand"] = _he(k1, (in_ch, mid), in_ch)
    params["dw"] = _he(k2, (op.kernel, op.kernel, mid), op.kernel * op.kernel)
    params["project"] = _he(k3, (mid, out_ch), mid)
    for name, ch in (("bn1", mid), ("bn2", mid), ("bn3", out_ch)):
        params[name], state[name] = bn_init(ch)
    return params, state


def mbconv_apply(params, state, x, op: OpSpec, stride: int, train: bool, dw_impl: str = "auto"):
    """Applies an MBConv candidate; returns (y, new_state)."""
    new = {}
    h = pointwise(x, params["expand"])
    h, new["bn1"] = batch_norm_act(params["bn1"], state["bn1"], h, train, "relu6")
    h = depthwise_conv(h, params["dw"], stride, impl=dw_impl)
    h, new["bn2"] = batch_norm_act(params["bn2"], state["bn2"], h, train, "relu6")
    h = pointwise(h, params["project"])
    h, new["bn3"] = batch_norm(params["bn3"], state["bn3"], h, train)
    if op.residual:
        h = h + x
    return h, new


def op_init(key, op: OpSpec, in_ch: int, out_ch: int):
    """Parameters and state of any candidate (identity has none)."""
    if op.is_identity:
        return {}, {}
    return mbconv_init(key, op, in_ch, out_ch)


def op_apply(params, state, x, op: OpSpec, stride: int, train: bool, dw_impl: str = "auto"):
    if op.is_identity:
        return x, state
    return mbconv_apply(params, state, x, op, stride, train, dw_impl)


def conv_bn_init(key, k: int, in_ch: int, out_ch: int):
    """A full k x k convolution (the stem) with batch norm."""
    params = {"w": _he(key, (k, k, in_ch, out_ch), k * k * in_ch)}
    params["bn"], state = bn_init(out_ch)
    return params, {"bn": state}


CONV_IMPLS = ("auto", "xla", "patches")


def conv_patches(x, w, stride: int):
    """The k x k convolution of x (NHWC) with w (HWIO), "SAME" padding, as one matrix product: the k*k shifted,
    strided views of the padded input side by side (channel order (i, j, c), w's row order) times w as a
    (k*k*Cin, Cout) matrix. Equal to ``lax.conv_general_dilated`` in values and gradients (tests); on XLA:CPU the
    stem's convolution (Cin = 3) and its weight gradient ran as slow direct convolutions, this form as matmuls."""
    k, _, cin, cout = w.shape
    n = x.shape[0]
    xp, oh, ow = pad_input(x, k, stride)
    views = [xp[:, i:i + (oh - 1) * stride + 1:stride, j:j + (ow - 1) * stride + 1:stride, :]
             for i in range(k) for j in range(k)]
    patches = jnp.concatenate(views, axis=-1).reshape(n * oh * ow, k * k * cin)
    return matmul(patches, w.reshape(k * k * cin, cout)).reshape(n, oh, ow, cout)


def resolve_conv_impl(impl: str) -> str:
    """"auto" -> "patches" on the CPU backend, "xla" (XLA's convolution) elsewhere; checks the name."""
    if impl not in CONV_IMPLS:
        raise ValueError(f"conv impl must be one of {CONV_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "patches" if jax.default_backend() == "cpu" else "xla"
    return impl


def full_conv(x, w, stride: int, impl: str = "auto"):
    """A k x k convolution, "SAME" padding, NHWC x HWIO; impl "auto" / "xla" / "patches" (resolve_conv_impl)."""
    if resolve_conv_impl(impl) == "patches":
        return conv_patches(x, w, stride)
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_bn_apply(params, state, x, stride: int, train: bool, impl: str = "auto"):
    y = full_conv(x, params["w"], stride, impl)
    y, bn = batch_norm_act(params["bn"], state["bn"], y, train, "relu6")
    return y, {"bn": bn}


def head_init(key, in_ch: int, head_ch: int, num_classes: int):
    """1x1 conv -> BN -> ReLU6 -> global average pool -> dense classifier."""
    k1, k2 = jax.random.split(key)
    params = {"conv": _he(k1, (in_ch, head_ch), in_ch),
              "dense_w": _scaled_normal(k2, (head_ch, num_classes), 1.0 / head_ch),
              "dense_b": _filled(num_classes, 0.0)}
    params["bn"], bn = bn_init(head_ch)
    return params, {"bn": bn}


def head_apply(params, state, x, train: bool):
    h = pointwise(x, params["conv"])
    h, bn = batch_norm_act(params["bn"], state["bn"], h, train, "relu6")
    h = jnp.mean(h, axis=(1, 2))
    return h @ params["dense_w"] + params["dense_b"], {"bn": bn}
