"""The split module (SplitNets, paper 000, section 3.1.3) and its split-aware initialisation (Table 3).

Single view: Conv-Reduce phi: R^{c x s x s} -> R^{d x s x s} runs on the sensor, Conv-Recover phi': d -> c on the
aggregator; the two are selected together by one gate. Multi-view: the V sensors' reduced features are concatenated
on the aggregator (View-Fuse, V*d channels) and a V*d -> c convolution (the fuse convolution) brings them back to c
channels for the on-aggregator network. The three are bias-free k x k convolutions without batch norm or activation
(a linear bottleneck), so their initial scale is what reaches the neighbouring layers, forward and backward.

Weights are shared across the searched reductions d (as a supernet shares channel widths): phi holds d_max output
channels and a candidate d uses the first d; phi' / fuse hold d_max input channels per view and read the first d.

Initialisation (weights ~ N(0, var), k = kernel size, ReLU gain 2):

* ``fan_in``  (Kaiming, forward-preserving):  var = 2 / (k^2 c_in)
* ``fan_out`` (Kaiming, backward-preserving): var = 2 / (k^2 c_out)
* ``geometric`` (SplitNets):                  var = 2 / (k^2 sqrt(c_in c_out))

For a regular layer c_in ~ c_out and the three agree; for phi (c >> d) and phi' (d << c) they differ by up to
sqrt(c/d) in standard deviation, which is the training instability the paper attributes to the compression layer.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

INITS = ("geometric", "fan_in", "fan_out")


def init_variance(kernel: int, c_in: int, c_out: int, mode: str = "geometric") -> float:
    """Weight variance of a k x k convolution c_in -> c_out under ``mode`` (Table 3, ReLU gain 2)."""
    for what, v in (("kernel", kernel), ("c_in", c_in), ("c_out", c_out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    if mode not in INITS:
        raise ValueError(f"unknown split-module init {mode!r}; expected one of {list(INITS)}")
    fan = {"fan_in": c_in, "fan_out": c_out, "geometric": math.sqrt(c_in * c_out)}[mode]
    return 2.0 / (kernel * kernel * fan)


def check_reduction(c: int, d: int, where: str = "split module") -> None:
    """Raises ValueError unless 1 <= d < c (a reduction must send fewer channels than it receives)."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"{where}: d must be a positive integer number of channels, got {d!r}")
    if d >= c:
        raise ValueError(f"{where}: d = {d} must be smaller than c = {c} (a Conv-Reduce sends fewer channels "
                         "than it receives)")


def _normal(key, shape, var):
    return jax.random.normal(key, shape, jnp.float32) * jnp.sqrt(jnp.float32(var))


def init(key, c: int, d_max: int, views: int = 1, kernel: int = 1, mode: str = "geometric") -> dict:
    """Parameters of one split module: ``reduce`` float32[k, k, c, d_max] and, on the aggregator, ``recover``
    float32[k, k, d_max, c] (views == 1) or ``fuse`` float32[k, k, views * d_max, c] (views > 1).

    The variance is computed for the widest module (d = d_max; fuse: c_in = views * d_max)."""
    check_reduction(c, d_max)
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be an integer >= 1, got {views!r}")
    k1, k2 = jax.random.split(key)
    p = {"reduce": _normal(k1, (kernel, kernel, c, d_max), init_variance(kernel, c, d_max, mode))}
    if views == 1:
        p["recover"] = _normal(k2, (kernel, kernel, d_max, c), init_variance(kernel, d_max, c, mode))
    else:
        p["fuse"] = _normal(k2, (kernel, kernel, views * d_max, c), init_variance(kernel, views * d_max, c, mode))
    return p


def _conv(x, w):
    """k x k convolution, stride 1, SAME padding, NHWC x HWIO."""
    if w.shape[0] == 1:
        return jnp.einsum("bhwc,cd->bhwd", x, w[0, 0])
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def channel_mask(d, d_max: int) -> jnp.ndarray:
    """float32[d_max]: 1 for the first d channels (d may be traced)."""
    return (jnp.arange(d_max) < d).astype(jnp.float32)


def reduce(params, x, d):
    """phi: x float32[B, s, s, c] -> float32[B, s, s, d_max] whose channels >= d are zero (only d are sent)."""
    w = params["reduce"]
    return _conv(x, w) * channel_mask(d, w.shape[-1])


def recover(params, z):
    """phi': z float32[B, s, s, d_max] (zero beyond d) -> float32[B, s, s, c]."""
    return _conv(z, params["recover"])


def fuse(params, z, views: int):
    """View-Fuse: z float32[B * V, s, s, d_max] (view-major within each example, zero beyond d) -> concatenation
    of the V views along channels [B, s, s, V * d_max] -> the fuse convolution -> float32[B, s, s, c]."""
    bv, h, w, dm = z.shape
    zz = z.reshape(bv // views, views, h, w, dm).transpose(0, 2, 3, 1, 4).reshape(bv // views, h, w, views * dm)
    return _conv(zz, params["fuse"])


def apply(params, x, d, views: int = 1):
    """The module end to end (sensor reduce, then recover or fuse): float32[B * V, s, s, c] -> [B, s, s, c]."""
    z = reduce(params, x, d)
    return recover(params, z) if views == 1 else fuse(params, z, views)
