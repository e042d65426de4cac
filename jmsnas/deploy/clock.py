"""Clock offsets between the coordinator and a worker from four-timestamp exchanges, as NTP does.

Every process reads its own CLOCK_MONOTONIC; on another machine that clock has another origin (and a small rate
error), so a worker's times become the coordinator's only through an estimated offset. One exchange: the
coordinator sends at t1 (its clock), the worker receives at t2 and answers at t3 (its clock), the coordinator
receives at t4. With theta = worker clock - coordinator clock and one-way delays d1, d2 >= 0:

    t2 = t1 + theta + d1,  t4 = t3 - theta + d2
    offset  = ((t2 - t1) + (t3 - t4)) / 2 = theta + (d1 - d2) / 2
    delay   = (t4 - t1) - (t3 - t2)       = d1 + d2

so |offset - theta| <= delay / 2 whatever the split of the round trip: the exchange with the smallest delay gives
the estimate and its uncertainty (half that delay). A worker time t maps to the coordinator's clock as t - theta.
"""
from __future__ import annotations

from typing import NamedTuple


class Offset(NamedTuple):
    """A worker clock's offset from the coordinator's (worker - coordinator), its bound and the round trip (s)."""

    offset_s: float
    uncertainty_s: float
    delay_s: float
    exchanges: int


def estimate_offset(exchanges) -> Offset:
    """The offset from (t1, t2, t3, t4) exchanges (seconds; t1, t4 coordinator, t2, t3 worker clock): the one with
    the smallest round-trip delay, uncertainty = that delay / 2 (the true offset lies within offset +- it)."""
    ex = [tuple(float(t) for t in e) for e in exchanges]
    if not ex:
        raise ValueError("no clock exchanges to estimate an offset from")
    best = min(ex, key=lambda e: (e[3] - e[0]) - (e[2] - e[1]))
    t1, t2, t3, t4 = best
    delay = max(0.0, (t4 - t1) - (t3 - t2))
    return Offset(((t2 - t1) + (t3 - t4)) / 2.0, delay / 2.0, delay, len(ex))


def to_coordinator(t: float, offset: Offset | float) -> float:
    """A worker time (s, its clock) on the coordinator's clock."""
    return t - (offset.offset_s if isinstance(offset, Offset) else float(offset))
