"""Candidate operations as pure functions over explicit parameter and batch-norm state dicts (NHWC).

An MBConv is: 1x1 expand conv -> BN -> ReLU6 -> k x k depthwise conv (stride) -> BN -> ReLU6 -> 1x1 project conv
-> BN, plus the input when it has a shortcut. Pointwise convolutions are matrix products over the channel axis;
the depthwise convolution comes from ``jmsnas.dwconv`` so the backend picks the fast implementation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmsnas.dwconv import depthwise_conv, pointwise_conv
from jmsnas.space import OpSpec

BN_MOMENTUM = 0.9
BN_EPS = 1e-5


def _he(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) * jnp.sqrt(2.0 / fan_in)


def bn_init(ch: int):
    """Batch-norm parameters and running statistics for ``ch`` channels."""
    params = {"scale": jnp.ones((ch,), jnp.float32), "bias": jnp.zeros((ch,), jnp.float32)}
    state = {"mean": jnp.zeros((ch,), jnp.float32), "var": jnp.ones((ch,), jnp.float32)}
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


def batch_norm(params, state, x, train: bool):
    """Batch norm over all axes but the last; in training uses batch statistics and returns updated running ones."""
    if train:
        y, mean, var = _train_norm(x, params["scale"], params["bias"])
        new_state = {"mean": BN_MOMENTUM * state["mean"] + (1 - BN_MOMENTUM) * lax.stop_gradient(mean),
                     "var": BN_MOMENTUM * state["var"] + (1 - BN_MOMENTUM) * lax.stop_gradient(var)}
        return y, new_state
    y = (x - state["mean"]) * lax.rsqrt(state["var"] + BN_EPS) * params["scale"] + params["bias"]
    return y, state


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
    h, new["bn1"] = batch_norm(params["bn1"], state["bn1"], h, train)
    h = jax.nn.relu6(h)
    h = depthwise_conv(h, params["dw"], stride, impl=dw_impl)
    h, new["bn2"] = batch_norm(params["bn2"], state["bn2"], h, train)
    h = jax.nn.relu6(h)
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


def conv_bn_apply(params, state, x, stride: int, train: bool):
    y = lax.conv_general_dilated(x, params["w"], (stride, stride), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y, bn = batch_norm(params["bn"], state["bn"], y, train)
    return jax.nn.relu6(y), {"bn": bn}


def head_init(key, in_ch: int, head_ch: int, num_classes: int):
    """1x1 conv -> BN -> ReLU6 -> global average pool -> dense classifier."""
    k1, k2 = jax.random.split(key)
    params = {"conv": _he(k1, (in_ch, head_ch), in_ch),
              "dense_w": jax.random.normal(k2, (head_ch, num_classes), jnp.float32) * jnp.sqrt(1.0 / head_ch),
              "dense_b": jnp.zeros((num_classes,), jnp.float32)}
    params["bn"], bn = bn_init(head_ch)
    return params, {"bn": bn}


def head_apply(params, state, x, train: bool):
    h = pointwise(x, params["conv"])
    h, bn = batch_norm(params["bn"], state["bn"], h, train)
    h = jnp.mean(jax.nn.relu6(h), axis=(1, 2))
    return h @ params["dense_w"] + params["dense_b"], {"bn": bn}
