"""Depthwise convolution that is fast on XLA:CPU, with XLA's native grouped convolution kept for GPU/TPU.

XLA:CPU runs `lax.conv_general_dilated(..., feature_group_count=C)` at about 1 GFLOP/s (see DESIGN.md,
"Measured on this kind of machine"). The "shifted" implementation here writes the same operation as

* forward: a sum over the k*k taps of strided slices of the padded input times one weight vector per tap
  (XLA fuses it into one loop over the output);
* input gradient: the same kind of shifted sum of the cotangent with the flipped kernel; for stride 2 it is
  split into stride x stride polyphase components (each a shifted sum with a sub-kernel) that are interleaved,
  so no work is spent on the zeros of a dilated cotangent;
* weight gradient: a scan over the images that accumulates acc[i, j, w, c] += xpad[s*r + i, s*w + j, c] * g[r, w, c]
  over the rows r of an image in one fused elementwise step (the accumulator stays in cache), then sums
  over w. Each input and gradient element is read from memory once, instead of k*k times by one reduction per
  tap (about 20x faster for k = 7 on 64x32x32x96 on a 2-core CPU; a channel-batched matmul formulation
  with diagonal sums was about 4x slower than this scan).

Layouts: x is NHWC float[B, H, W, C]; the depthwise kernel is float[k, k, C] with odd k. Padding is "SAME" with
TF/XLA semantics: output size ceil(H / stride), total padding max((out - 1) * stride + k - H, 0), split
low = total // 2, high = total - low.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmsnas import native

IMPLS = ("auto", "xla", "shifted", "native")
STRIDES = (1, 2)


def same_padding(size: int, k: int, stride: int) -> tuple[int, int, int]:
    """SAME padding of one spatial axis: (low, high, out_size), all in elements."""
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2, total - total // 2, out


def resolve_impl(impl: str) -> str:
    """Map impl "auto" to "native" on the CPU backend ("shifted" when the native kernels cannot be built, with a
    warning naming the reason) and to "xla" elsewhere; check the name. "native" that cannot be built raises."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if jax.default_backend() != "cpu":
            return "xla"
        if native.load():
            return "native"
        if not _warned:
            _warned.append(True)
            warnings.warn(f"jmsnas: native depthwise kernels unavailable, using the XLA shifted-sum form "
                          f"(slower): {native.error()}", RuntimeWarning, stacklevel=3)
        return "shifted"
    if impl == "native":
        native.require()
    return impl


_warned: list = []


def _check(x, w, stride: int) -> None:
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride not in STRIDES:
        raise ValueError(f"stride must be 1 or 2, got {stride!r}")
    if np.ndim(x) != 4:
        raise ValueError(f"x must be rank 4 [B, H, W, C], got shape {np.shape(x)}")
    if np.ndim(w) != 3:
        raise ValueError(f"w must be rank 3 [k, k, C], got shape {np.shape(w)}")
    k0, k1, cw = np.shape(w)
    if k0 != k1 or k0 % 2 != 1:
        raise ValueError(f"kernel must be square with odd size, got {k0}x{k1}")
    if cw != np.shape(x)[3]:
        raise ValueError(f"w has {cw} channels but x has {np.shape(x)[3]}")


def depthwise_conv(x: jax.Array, w: jax.Array, stride: int = 1, impl: str = "auto") -> jax.Array:
    """Depthwise 2-D convolution with SAME padding.

    Args:
      x: float[B, H, W, C] input (NHWC).
      w: float[k, k, C] one k x k filter per channel, k odd.
      stride: 1 or 2, the same on both spatial axes.
      impl: "xla" (lax.conv_general_dilated with feature_group_count=C), "shifted" (sum of shifted slices with
        a custom VJP, in XLA), "native" (hand-written CPU kernels called through the XLA FFI, float32, with
        native gradient kernels; ``jmsnas.native``), or "auto" ("native" on the CPU backend, "shifted" there if
        the kernels cannot be compiled, "xla" on GPU/TPU). A static Python choice: it selects the traced program.
        "native" computes in float32 (other dtypes are cast to it and back).

    Returns:
      float[B, ceil(H / stride), ceil(W / stride), C].
    """
    _check(x, w, stride)
    impl = resolve_impl(impl)
    if impl == "xla":
        return _xla_depthwise(x, w, stride)
    if impl == "native":
        dtype = x.dtype
        return _native_depthwise(x.astype(jnp.float32), w.astype(jnp.float32), stride).astype(dtype)
    return _shifted_depthwise(x, w, stride)


MATMUL_IMPLS = ("auto", "xla", "native")
NATIVE_MATMUL_MIN_ROWS = 1024


def resolve_matmul_impl(impl: str, rows: int) -> str:
    """How a matrix product x[rows, K] @ w[K, N] with a trained w runs: "xla" (``jnp.dot``, its gradients too) or
    "native" (``jnp.dot`` forward and input gradient, the weight gradient x^T g by the ``jmsnas_matmul_tn`` CPU
    kernel). "auto": "native" on the CPU backend when the kernels build and rows >= ``NATIVE_MATMUL_MIN_ROWS``, else
    "xla". Measured on the 2-core EPYC: XLA:CPU runs x^T g through Eigen's contraction (YNNPACK takes only the
    row-major form); the kernel is 1.07-5.2x faster for the supernets' shapes (``benchmarks/bench_matmul_tn.py``,
    two runs: 65536x192^T @ 65536x32 13.0-13.6 vs 7.4-9.1 ms; the 4096-row shapes gain least, 1.05-1.15x) and
    mostly slower below about a thousand rows (1000x13^T @ 1000x10: 0.46x and 1.2x, at 0.05 ms; its fixed cost)."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if impl == "auto":
        native_ok = jax.default_backend() == "cpu" and rows >= NATIVE_MATMUL_MIN_ROWS and native.load()
        return "native" if native_ok else "xla"
    if impl == "native":
        native.require()
    return impl


def matmul(x: jax.Array, w: jax.Array, impl: str = "auto") -> jax.Array:
    """x[rows, K] @ w[K, N]; ``impl`` as in ``resolve_matmul_impl`` (the same values and gradients either way)."""
    if resolve_matmul_impl(impl, x.shape[0]) == "native":
        dtype = x.dtype
        return _native_matmul(x.astype(jnp.float32), w.astype(jnp.float32)).astype(dtype)
    return jnp.dot(x, w)


@jax.custom_vjp
def _native_matmul(x, w):
    return jnp.dot(x, w)


def _native_matmul_fwd(x, w):
    return jnp.dot(x, w), (x, w)


def _native_matmul_bwd(res, g):
    x, w = res
    return jnp.dot(g, w.T), native.call("jmsnas_matmul_tn", w.shape, x, g)


_native_matmul.defvjp(_native_matmul_fwd, _native_matmul_bwd)


def pointwise_conv(x: jax.Array, w: jax.Array, impl: str = "auto") -> jax.Array:
    """1x1 convolution as one matmul over channels.

    Args:
      x: float[B, H, W, Cin] input (NHWC).
      w: float[Cin, Cout] weights.
      impl: how the matmul and its weight gradient run (``resolve_matmul_impl``; "auto": the native weight-gradient
        kernel on CPU for at least ``NATIVE_MATMUL_MIN_ROWS`` pixels in the batch).

    Returns:
      float[B, H, W, Cout], equal to lax.conv_general_dilated with a [1, 1, Cin, Cout] kernel. On XLA:CPU the
      matmul's gradient is several times faster than the convolution's (see benchmarks/bench_dwconv.py).
    """
    if np.ndim(x) != 4:
        raise ValueError(f"x must be rank 4 [B, H, W, Cin], got shape {np.shape(x)}")
    if np.ndim(w) != 2:
        raise ValueError(f"w must be rank 2 [Cin, Cout], got shape {np.shape(w)}")
    if np.shape(w)[0] != np.shape(x)[3]:
        raise ValueError(f"w has {np.shape(w)[0]} input channels but x has {np.shape(x)[3]}")
    b, h, wd, cin = x.shape
    return matmul(x.reshape(b * h * wd, cin), w, impl).reshape(b, h, wd, w.shape[1])


def _xla_depthwise(x, w, stride: int):
    """Reference: XLA's grouped convolution; w float[k, k, C] becomes HWIO [k, k, 1, C]."""
    return lax.conv_general_dilated(
        x, w[:, :, None, :], (stride, stride), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=x.shape[3])


def pad_input(x, k: int, stride: int):
    """x zero-padded SAME-style: float[B, Hp, Wp, C] plus the output spatial size (oh, ow)."""
    lh, hh, oh = same_padding(x.shape[1], k, stride)
    lw, hw, ow = same_padding(x.shape[2], k, stride)
    return jnp.pad(x, ((0, 0), (lh, hh), (lw, hw), (0, 0))), oh, ow


def _shifted_sum(xp, w, stride: int, oh: int, ow: int):
    """sum_{i,j} xp[:, i + s*a, j + s*b, :] * w[i, j] for a < oh, b < ow; xp float[B, Hp, Wp, C]."""
    k0, k1 = w.shape[0], w.shape[1]
    out = None
    for i in range(k0):
        for j in range(k1):
            sl = xp[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride, :]
            term = sl * w[i, j]
            out = term if out is None else out + term
    return out


def _forward(x, w, stride: int):
    xp, oh, ow = pad_input(x, w.shape[0], stride)
    return _shifted_sum(xp, w, stride, oh, ow)


def _phase_plan(size: int, k: int, stride: int):
    """Per axis: padded-coordinate range [low, low + size) covered by phases m in [m0, m0 + count)."""
    low, _, out = same_padding(size, k, stride)
    m0 = low // stride
    count = -(-(low + size) // stride) - m0
    return low, out, m0, count


def _input_grad(g, w, x_shape, stride: int):
    """dL/dx float[B, H, W, C] of the depthwise conv given the cotangent g float[B, oh, ow, C].

    In padded coordinates p = s*m + r, dxp[p] = sum_a g[m - a] * w[r + s*a]: phase r is a stride-1 shifted
    sum of g with the sub-kernel w[r::s] flipped. Phases are interleaved and the padding is cropped.
    """
    k = w.shape[0]
    _, h, wd, _ = x_shape
    lh, oh, mh0, mh = _phase_plan(h, k, stride)
    lw, ow, mw0, mw = _phase_plan(wd, k, stride)
    rows = []
    for rh in range(stride):
        cols = []
        for rw in range(stride):
            sub = w[rh::stride, rw::stride][::-1, ::-1]
            ah, aw = sub.shape[0], sub.shape[1]
            gq = lax.pad(g, jnp.zeros((), g.dtype),
                         ((0, 0, 0), (ah - 1 - mh0, mh + mh0 - oh, 0),
                          (aw - 1 - mw0, mw + mw0 - ow, 0), (0, 0, 0)))
            cols.append(_shifted_sum(gq, sub, 1, mh, mw))
        rows.append(cols)
    if stride == 1:
        return rows[0][0]
    b, c = g.shape[0], g.shape[3]
    phases = jnp.stack([jnp.stack(cols, axis=3) for cols in rows], axis=2)  # [B, mh, s, mw, s, C]
    dxp = phases.reshape(b, mh * stride, mw * stride, c)
    oh0, ow0 = lh - stride * mh0, lw - stride * mw0
    return dxp[:, oh0:oh0 + h, ow0:ow0 + wd, :]


_ROWS_PER_STEP = 32  # output rows unrolled into one weight-gradient loop step


def _rows_into_taps(win, grows, k: int, stride: int):
    """sum_r win[s*r + i, s*w + j, c] * grows[r, w, c] as float[k, k, ow, C].

    win: float[>= s*(R-1)+k, Wp, C] padded input rows of one image; grows: float[R, ow, C] cotangent rows.
    """
    rows, ow, c = grows.shape
    acc = None
    for r in range(rows):
        taps = jnp.stack([
            lax.slice(win, (stride * r, j, 0), (stride * r + k, j + stride * (ow - 1) + 1, c),
                      None if stride == 1 else (1, stride, 1))
            for j in range(k)], axis=1)
        term = taps * grows[r]
        acc = term if acc is None else acc + term
    return acc


def _weight_grad(xp, g, k: int, stride: int):
    """dL/dw float[k, k, C] from the padded input xp float[B, Hp, Wp, C] and the cotangent g float[B, oh, ow, C].

    A scan over the images keeps an accumulator acc[i, j, w, c] = sum_{b, r} xp[b, s*r + i, s*w + j, c] *
    g[b, r, w, c] (float[k, k, ow, C], cache-resident); each step is one fused elementwise update over up to
    _ROWS_PER_STEP rows, so every input element is read from memory once. The last step sums over w.
    """
    _, oh, ow, c = g.shape
    acc0 = jnp.zeros((k, k, ow, c), jnp.float32)
    if oh <= _ROWS_PER_STEP:
        def image(acc, xg):
            return acc + _rows_into_taps(xg[0], xg[1], k, stride), None
    else:
        rows = _ROWS_PER_STEP
        nblk = -(-oh // rows)
        win_rows = stride * (rows - 1) + k
        g = jnp.pad(g, ((0, 0), (0, nblk * rows - oh), (0, 0), (0, 0)))
        xp = jnp.pad(xp, ((0, 0), (0, max(stride * (nblk * rows - 1) + k - xp.shape[1], 0)), (0, 0), (0, 0)))

        def image(acc, xg):
            def block(t, acc):
                win = lax.dynamic_slice_in_dim(xg[0], stride * rows * t, win_rows, axis=0)
                grows = lax.dynamic_slice_in_dim(xg[1], rows * t, rows, axis=0)
                return acc + _rows_into_taps(win, grows, k, stride)

            return lax.fori_loop(0, nblk, block, acc), None

    acc, _ = lax.scan(image, acc0, (xp, g))
    return acc.sum(axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _shifted_depthwise(x, w, stride: int):
    return _forward(x, w, stride)


def _shifted_fwd(x, w, stride: int):
    return _forward(x, w, stride), (x, w)


def _shifted_bwd(stride: int, res, g):
    x, w = res
    xp, _, _ = pad_input(x, w.shape[0], stride)
    dx = _input_grad(g, w, x.shape, stride)
    dw = _weight_grad(xp, g, w.shape[0], stride)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_shifted_depthwise.defvjp(_shifted_fwd, _shifted_bwd)


# ----- native CPU kernels (jmsnas/native/dwconv_cpu.cc) through the XLA FFI -----

def _ffi(target: str, shape, *args, stride: int):
    return native.call(target, shape, *args, stride=np.int64(stride))


def _native_forward(x, w, stride: int):
    b, h, wd, c = x.shape
    return _ffi("jmsnas_depthwise_forward", (b, -(-h // stride), -(-wd // stride), c), x, w, stride=stride)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _native_depthwise(x, w, stride: int):
    return _native_forward(x, w, stride)


def _native_fwd(x, w, stride: int):
    return _native_forward(x, w, stride), (x, w)


def _native_bwd(stride: int, res, g):
    x, w = res
    dx = _ffi("jmsnas_depthwise_input_grad", x.shape, g, w, stride=stride)
    dw = _ffi("jmsnas_depthwise_weight_grad", w.shape, x, g, stride=stride)
    return dx, dw


_native_depthwise.defvjp(_native_fwd, _native_bwd)
