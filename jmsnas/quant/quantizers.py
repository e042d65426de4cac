"""Post-training quantizers as small pure functions (Auto-Split, paper 001, sections 3.1 and 4.2).

Bit widths are per layer and may be traced (one compiled forward serves every bit assignment):

* ``0``: no quantization (float32, the reference);
* ``2 .. 8``: integers. Weights are symmetric per output channel (the last axis of every jmsnas weight layout:
  pointwise [Cin, Cout], depthwise [k, k, C], convolution [k, k, Cin, Cout], dense [Cin, Cout]):
  scale_c = max|w_c| / (2^(b-1) - 1), codes in [-(2^(b-1) - 1), 2^(b-1) - 1]. Activations are asymmetric over a
  range [lo, hi] calibrated on real batches: scale = (hi - lo) / (2^b - 1), codes in [0, 2^b - 1], the value
  lo + code * scale (the paper's transmission API sends scale and zero point, Table 5);
* ``16``: IEEE float16 (the paper takes the original network to be 16-bit; its cloud runs FP16, "CLOUD16").

The distortion of a tensor at b bits is the paper's MSE(x(ref), x(b)), the mean over its elements.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8, 16)
FLOAT = 0  # bit width meaning "not quantized"


def check_bit_set(bits) -> tuple:
    """The candidate set B as a sorted tuple of ints; ValueError (naming the value) if empty or unsupported."""
    try:
        vals = [int(b) for b in bits]
        if any(float(b) != int(b) for b in bits):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"bit set {bits!r} must be integers from {list(SUPPORTED_BITS)}") from None
    if not vals:
        raise ValueError(f"the bit set is empty; expected a non-empty subset of {list(SUPPORTED_BITS)}")
    bad = sorted({b for b in vals if b not in SUPPORTED_BITS})
    if bad:
        raise ValueError(f"unsupported bit width(s) {bad}; expected a subset of {list(SUPPORTED_BITS)}")
    return tuple(sorted(set(vals)))


def weight_scale(w, bits):
    """Per-output-channel scale of w float[..., C] at ``bits`` (2..8): float[C] (1 for an all-zero channel)."""
    qmax = jnp.maximum(2.0 ** (jnp.asarray(bits, jnp.float32) - 1) - 1, 1.0)
    amax = jnp.max(jnp.abs(w), axis=tuple(range(w.ndim - 1)))
    return jnp.where(amax > 0, amax / qmax, 1.0), qmax


def weight_codes(w, bits):
    """(int32 codes shaped like w, scale float[C]) of the symmetric per-channel quantization at ``bits``."""
    scale, qmax = weight_scale(w, bits)
    return jnp.clip(jnp.round(w / scale), -qmax, qmax).astype(jnp.int32), scale


def fake_quant_weight(w, bits):
    """w quantized at ``bits`` (0: unchanged, 16: float16, 2..8: per-channel symmetric) and dequantized."""
    b = jnp.asarray(bits, jnp.int32)
    codes, scale = weight_codes(w, jnp.clip(b, 2, 8))
    q = codes.astype(w.dtype) * scale
    return jnp.where(b == FLOAT, w, jnp.where(b >= 16, w.astype(jnp.float16).astype(w.dtype), q))


def act_scale(lo, hi, bits):
    """Step of the asymmetric activation quantizer over [lo, hi] at ``bits`` (2..8), and the top code."""
    top = 2.0 ** jnp.asarray(bits, jnp.float32) - 1
    return jnp.where(hi > lo, (hi - lo) / top, 1.0), top


def act_codes(x, lo, hi, bits):
    """Codes of x at ``bits`` (1..8) over the calibrated range [lo, hi]: uint8 in [0, 2^bits - 1]."""
    scale, top = act_scale(lo, hi, bits)
    return jnp.clip(jnp.round((x - lo) / scale), 0, top).astype(jnp.uint8)


def act_dequant(codes, lo, hi, bits):
    """Values of activation codes: lo + code * scale (float32)."""
    scale, _ = act_scale(lo, hi, bits)
    return codes.astype(jnp.float32) * scale + lo


def fake_quant_act(x, lo, hi, bits):
    """x quantized at ``bits`` (0: unchanged, 16: float16, 1..8: asymmetric over [lo, hi]) and dequantized.
    Equal, bit for bit, to ``act_dequant(act_codes(...))``: what the receiving side of a split computes."""
    b = jnp.asarray(bits, jnp.int32)
    bq = jnp.clip(b, 1, 8)
    q = act_dequant(act_codes(x, lo, hi, bq), lo, hi, bq)
    return jnp.where(b == FLOAT, x, jnp.where(b >= 16, x.astype(jnp.float16).astype(x.dtype), q))


@jax.jit
def _weight_mse(ws, counts, bits):
    """float[U, K]: MSE of each zero-padded weight matrix ws[u] (float[R, C]) over its counts[u] real elements."""
    one = lambda w, c: jax.vmap(lambda b: jnp.sum(jnp.square(fake_quant_weight(w, b) - w)) / c)(bits)
    return jax.vmap(one)(ws, counts)


@jax.jit
def _act_mse(xs, counts, ranges, bits):
    """float[U, K]: MSE of each activation row xs[u] (padded with its lo, which quantizes to itself exactly)."""
    one = lambda x, c, r: jax.vmap(lambda b: jnp.sum(jnp.square(fake_quant_act(x, r[0], r[1], b) - x)) / c)(bits)
    return jax.vmap(one)(xs, counts, ranges)


def weight_distortion(weights, bit_set) -> np.ndarray:
    """float[U, K]: D^w_u(b) = MSE(w_u, Q_b(w_u)) for a list of weight arrays (output channels last) and every b
    of the bit set, in one compiled call (the arrays are zero-padded to a common [rows, channels] matrix; a zero
    quantizes to zero, so padding adds no error)."""
    mats = [np.asarray(w, np.float32).reshape(-1, np.shape(w)[-1]) for w in weights]
    r, c = max(m.shape[0] for m in mats), max(m.shape[1] for m in mats)
    ws = np.zeros((len(mats), r, c), np.float32)
    for u, m in enumerate(mats):
        ws[u, : m.shape[0], : m.shape[1]] = m
    counts = np.array([max(1, m.size) for m in mats], np.float32)
    return np.asarray(_weight_mse(ws, counts, jnp.asarray(bit_set, jnp.int32)), np.float64)


def act_distortion(acts, ranges, bit_set) -> np.ndarray:
    """float[U, K]: D^a_u(b) = MSE(a_u, Q_b(a_u)) over the calibrated ranges[u] = (lo, hi), for a list of arrays."""
    flat = [np.asarray(a, np.float32).reshape(-1) for a in acts]
    rg = np.asarray(ranges, np.float32).reshape(len(flat), 2)
    xs = np.repeat(rg[:, :1], max(f.size for f in flat), axis=1)
    for u, f in enumerate(flat):
        xs[u, : f.size] = f
    counts = np.array([max(1, f.size) for f in flat], np.float32)
    return np.asarray(_act_mse(xs, counts, rg, jnp.asarray(bit_set, jnp.int32)), np.float64)
