"""Sharing a population's evaluation out among the JAX processes of a multi-process run."""
from __future__ import annotations

import jax
import numpy as np


def spread(fn, params, bn, ops: np.ndarray) -> np.ndarray:
    """float64[P] = ``fn(params, bn, ops)`` with the P rows of ``ops`` shared out among the JAX processes.

    One process: ``fn`` on every row. N processes: process i evaluates rows [i q, (i + 1) q) (q = ceil(P / N), the
    last row repeated to fill N q) on its own devices, with a host copy of the (replicated) supernet, and the N
    results are gathered so that every process returns the whole population's values, in row order. Each row's
    value depends on that row only, so the result is the one-process result.
    """
    n = jax.process_count()
    if n == 1:
        return np.asarray(fn(params, bn, ops), np.float64)
    from jax.experimental import multihost_utils
    q = -(-ops.shape[0] // n)
    padded = np.concatenate([ops, np.repeat(ops[-1:], n * q - ops.shape[0], 0)])
    mine = padded[jax.process_index() * q:(jax.process_index() + 1) * q]
    local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)) if isinstance(a, jax.Array) else a, (params, bn))
    part = np.asarray(fn(*local, mine), np.float32)
    gathered = np.asarray(multihost_utils.process_allgather(part, tiled=False))  # [N, q]
    return gathered.reshape(-1)[:ops.shape[0]].astype(np.float64)
