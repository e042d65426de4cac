"""Candidate operations as pure functions over explicit parameter and batch-norm state dicts (NHWC).

An MBConv is: 1x1 expand conv -> BN -> ReLU6 -> k x k depthwise conv (stride) -> BN -> ReLU6 -> 1x1 project conv
-> BN, plus the input when it has a shortcut. Pointwise convolutions are matrix products over the channel axis;
the depthwise convolution comes from ``jmsnas.dwconv`` so the backend picks the fast implementation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmsnas.dwconv import depthwise_conv
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


def batch_norm(params, state, x, train: bool):
    """Batch norm over all axes but the last; in training uses batch statistics and returns updated running ones."""
    if train:
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axes)
        var = jnp.mean(jnp.square(x - mean), axes)
        new_state = {"mean": BN_MOMENTUM * state["mean"] + (1 - BN_MOMENTUM) * lax.stop_gradient(mean),
                     "var": BN_MOMENTUM * state["var"] + (1 - BN_MOMENTUM) * lax.stop_gradient(var)}
    else:
        mean, var, new_state = state["mean"], state["var"], state
    y = (x - mean) * lax.rsqrt(var + BN_EPS) * params["scale"] + params["bias"]
    return y, new_state


def pointwise(x, w):
    """1x1 convolution: x[B,H,W,Cin] @ w[Cin,Cout]."""
    return jnp.dot(x, w)


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
