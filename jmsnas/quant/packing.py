"""Sub-byte packing of quantized tensors for transmission (Auto-Split, paper 001, section 4.3 and appendix A).

``pack(codes, bits)`` puts n codes of ``bits`` bits each (1..8) into ceil(n * bits / 8) bytes, little-endian
within the stream: code j occupies stream bits [j * bits, (j + 1) * bits), least significant bit first, and
stream bit t is bit t % 8 of byte t // 8; the tail of the last byte is zero. ``unpack`` inverts it exactly.
Both are pure jnp on the last axis (leading axes are batch axes; ``jax.vmap`` and ``jax.jit`` apply, with
``bits`` and n static). The cost model charges exactly ``packed_bytes(n, bits)``.

A tensor quantized over its own range (the composed network's transmitted tensors: asymmetric over [min, max] of
each batch sent) travels with that range: ``RANGE_BYTES`` (lo, hi as two float32) ahead of its codes,
``frame_bytes`` in all.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

PACK_BITS = tuple(range(1, 9))
RANGE_BYTES = 8  # lo and hi (float32 each) of a tensor quantized over its own range


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in PACK_BITS:
        raise ValueError(f"bits must be an integer in 1..8 to pack, got {bits!r}")
    return int(bits)


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that n codes of ``bits`` bits take once packed: ceil(n * bits / 8) (16 bits: 2 bytes each)."""
    return -(-int(n) * int(bits) // 8)


def pack(codes, bits: int):
    """uint8[..., n] codes (each < 2^bits) -> uint8[..., ceil(n * bits / 8)] packed bytes."""
    b = _check_bits(bits)
    codes = jnp.asarray(codes)
    if not isinstance(codes, jnp.ndarray) or codes.ndim < 1:
        raise ValueError(f"codes must be an array with a last axis to pack, got shape {np.shape(codes)}")
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes must be integers, got dtype {codes.dtype}")
    try:
        high = int(np.max(np.asarray(codes))) if codes.size else 0
        low = int(np.min(np.asarray(codes))) if codes.size else 0
    except Exception:  # traced values: checked by the caller that produced them
        high = low = 0
    if low < 0 or high >= 2 ** b:
        raise ValueError(f"codes must lie in [0, {2 ** b - 1}] for {b}-bit packing, got values in [{low}, {high}]")
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    stream = (codes.astype(jnp.uint8)[..., :, None] >> jnp.arange(b, dtype=jnp.uint8)) & 1  # [..., n, b]
    stream = stream.reshape(lead + (n * b,))
    stream = jnp.pad(stream, [(0, 0)] * len(lead) + [(0, packed_bytes(n, b) * 8 - n * b)])
    octets = stream.reshape(lead + (-1, 8)) << jnp.arange(8, dtype=jnp.uint8)
    return jnp.sum(octets, axis=-1, dtype=jnp.uint8)  # disjoint bits: the sum is the OR


def unpack(packed, bits: int, n: int):
    """uint8[..., ceil(n * bits / 8)] -> the n uint8 codes ``pack`` stored."""
    b = _check_bits(bits)
    packed = jnp.asarray(packed, jnp.uint8)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if packed.shape[-1] != packed_bytes(n, b):
        raise ValueError(f"{n} codes of {b} bits take {packed_bytes(n, b)} bytes, got {packed.shape[-1]}")
    lead = packed.shape[:-1]
    stream = (packed[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    stream = stream.reshape(lead + (-1,))[..., : n * b].reshape(lead + (n, b))
    return jnp.sum(stream << jnp.arange(b, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def transmitted_bytes(elems: int, bits: int) -> int:
    """Bytes of a tensor of ``elems`` values sent at ``bits``: packed for 1..8, raw for 16 or 32."""
    return packed_bytes(elems, bits) if bits <= 8 else int(elems) * math.ceil(bits / 8)


def frame_bytes(elems: int, bits: int, batch: int = 1) -> int:
    """Bytes of one transfer of ``batch`` tensors of ``elems`` values quantized over the batch's own range: each
    tensor packed at ``bits`` (``transmitted_bytes``) plus, for 1..8 bits, the range (``RANGE_BYTES``) once."""
    return int(batch) * transmitted_bytes(elems, bits) + (RANGE_BYTES if bits <= 8 else 0)
