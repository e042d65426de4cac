"""Communication decisions of a separable network (paper 004, section 3.2-3.3, Tables 3 and 4).

A run has S transmission steps. At every step each of the G nodes sends its features to exactly one node and
receives from exactly one: the decision is a permutation ``perm`` of 0..G-1 where ``perm[i]`` is the destination of
node i (Table 3's reading). A node with ``perm[i] == i`` keeps its features: it sends nothing and adds nothing.
Permutation ids follow Table 3: the lexicographic order of ``itertools.permutations(range(G))`` (id 7 of G = 4
is ``(1, 0, 3, 2)``).

Optionally a sparsity level k in 0..K-1 per step sets how many channels are sent, eq. (10) with the K levels of
Table 4 spread evenly from P_min % to 100 %: ``N_send = floor(N_total * (P_min + k * (100 - P_min) / (K - 1)) / 100)``
(K = 1: always 100 %). The first N_send channels are sent.

The controller sees the decisions as one sequence of categorical choices: per step a permutation id (G! choices)
and, when K > 1, a sparsity level (K choices), interleaved ``[perm_0, level_0, perm_1, level_1, ...]``; ``mask()``
is the validity mask of that sequence for ``jmsnas.strategies.reinforce`` (rows padded to max(G!, K) choices).
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from jmsnas.runcheck import ConfigError
from jmsnas.strategies.base import check_int


def permutation_table(num_groups: int) -> np.ndarray:
    """int32[G!, G]: row r is the permutation with id r (Table 3's order); G >= 2."""
    g = check_int("G (number of groups/nodes)", num_groups, 2)
    return np.asarray(list(itertools.permutations(range(g))), np.int32)


def check_permutation(perm, num_groups: int, where: str = "decision") -> np.ndarray:
    """``perm`` as int32[G] if it is a permutation of 0..G-1 (every node sends to one node and receives from
    one), else ConfigError naming it."""
    p = np.asarray(perm)
    if p.shape != (num_groups,) or not np.issubdtype(p.dtype, np.integer) \
            or sorted(p.tolist()) != list(range(num_groups)):
        raise ConfigError(f"{where} {np.asarray(perm).tolist()!r} is not a permutation of 0..{num_groups - 1} "
                            "(every node must send to exactly one node and receive from exactly one)")
    return p.astype(np.int32)


def permutation_id(perm, num_groups: int) -> int:
    """Table 3 id of a permutation (validated)."""
    p = check_permutation(perm, num_groups)
    ids = 0
    rest = list(range(num_groups))
    for i, v in enumerate(p.tolist()):
        pos = rest.index(v)
        ids += pos * math.factorial(num_groups - 1 - i)
        rest.pop(pos)
    return ids


def is_intensive(perm) -> bool:
    """True when every node sends to another node (no fixed point): the 'communication-intensive' decisions."""
    p = np.asarray(perm)
    return bool(np.all(p != np.arange(p.size)))


def send_fraction(level: int, num_levels: int, p_min: float) -> Fraction:
    """Fraction of channels sent at sparsity ``level`` of K = ``num_levels`` levels from ``p_min`` % to 100 %."""
    k = check_int("K (sparsity levels)", num_levels, 1)
    if k == 1:
        return Fraction(1)
    pm = Fraction(p_min).limit_denominator(10**6)
    return (pm + level * (100 - pm) / (k - 1)) / 100


def n_send(total_channels: int, level: int, num_levels: int, p_min: float) -> int:
    """eq. (10): channels sent out of ``total_channels`` at ``level`` (exact rational arithmetic, then floor)."""
    if not 0 <= level < num_levels:
        raise ConfigError(f"sparsity level must be in 0..{num_levels - 1}, got {level!r}")
    return int(math.floor(total_channels * send_fraction(level, num_levels, p_min)))


class DecisionSpace(NamedTuple):
    """G nodes, S transmission steps, K sparsity levels from ``p_min`` % (K = 1: no sparsity decisions)."""

    num_groups: int
    num_steps: int
    num_levels: int = 1
    p_min: float = 50.0

    @property
    def num_perms(self) -> int:
        return math.factorial(self.num_groups)

    @property
    def tokens_per_step(self) -> int:
        return 2 if self.num_levels > 1 else 1

    def mask(self) -> np.ndarray:
        """bool[S * tokens_per_step, max(G!, K)]: the valid choices of each token of the controller's sequence."""
        width = max(self.num_perms, self.num_levels)
        m = np.zeros((self.num_steps * self.tokens_per_step, width), bool)
        m[::self.tokens_per_step, :self.num_perms] = True
        if self.num_levels > 1:
            m[1::2, :self.num_levels] = True
        return m

    def decode(self, tokens):
        """tokens int[..., S * tokens_per_step] -> (perm_ids int32[..., S], levels int32[..., S]); levels are
        K - 1 (100 %) when there are no sparsity decisions."""
        t = np.asarray(tokens, np.int32)
        if self.num_levels > 1:
            return t[..., 0::2], t[..., 1::2]
        return t, np.full(t.shape, self.num_levels - 1, np.int32)

    def encode(self, perm_ids, levels=None) -> np.ndarray:
        """Inverse of ``decode``: int32[..., S * tokens_per_step]."""
        p = np.asarray(perm_ids, np.int32)
        if self.num_levels == 1:
            return p
        lv = np.asarray(levels, np.int32)
        out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.int32)
        out[..., 0::2], out[..., 1::2] = p, lv
        return out


def make_space(num_groups, num_steps, num_levels=1, p_min=50.0) -> DecisionSpace:
    """A validated DecisionSpace (G >= 2, S >= 1, K >= 1, 0 < p_min <= 100)."""
    g = check_int("G (number of groups/nodes)", num_groups, 2)
    s = check_int("number of transmission steps", num_steps, 1)
    k = check_int("K (sparsity levels)", num_levels, 1)
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 < p_min <= 100:
        raise ConfigError(f"p_min must be a percentage in (0, 100], got {p_min!r}")
    return DecisionSpace(g, s, k, float(p_min))


def from_permutations(space: DecisionSpace, perms, levels=None) -> tuple[np.ndarray, np.ndarray]:
    """A user-given decision sequence (S permutations, optionally S levels) validated and turned into
    (perm_ids int32[S], levels int32[S])."""
    perms = list(perms)
    if len(perms) != space.num_steps:
        raise ConfigError(f"a decision sequence needs {space.num_steps} permutations (one per transmission step), "
                            f"got {len(perms)}")
    ids = np.asarray([permutation_id(check_permutation(p, space.num_groups, f"decision at step {s}"),
                                     space.num_groups) for s, p in enumerate(perms)], np.int32)
    if levels is None:
        lv = np.full(space.num_steps, space.num_levels - 1, np.int32)
    else:
        lv = np.asarray(levels)
        if lv.shape != (space.num_steps,) or not np.issubdtype(lv.dtype, np.integer) \
                or lv.min() < 0 or lv.max() >= space.num_levels:
            raise ConfigError(f"sparsity levels must be {space.num_steps} integers in 0..{space.num_levels - 1}, "
                                f"got {np.asarray(levels).tolist()!r}")
        lv = lv.astype(np.int32)
    return ids, lv
