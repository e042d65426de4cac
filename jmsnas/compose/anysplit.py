"""The composed repair over every split: the most probable configuration and split together (exact, slow)."""
from __future__ import annotations

import itertools

import numpy as np

from jmsnas.compose.choices import ChoiceProbs, Choices, probs_from_logits
from jmsnas.compose.repair import check_logits, repair
from jmsnas.compose.terms import Terms
from jmsnas.cost.latency import mesh_segments
from jmsnas.limits import DeviceLimits, LimitsError


def splits(space, send_input: bool = False):
    """Every split of the family ``compose.cost.best_assignment`` searches, int32[N] each: a chain's contiguous
    ranges along the chain (a device may take no layer), a mesh's ``cost.latency.MeshSegments`` family. With
    ``send_input`` (a chain), int32[N + 1] each: the stem one more item before the layers, its device last
    (``compose.cost.split_devices``)."""
    topo = space.topology

    def contiguous(devices, n):
        for cuts in itertools.combinations_with_replacement(range(n + 1), len(devices) - 1):
            yield np.repeat(np.asarray(devices), np.diff((0,) + cuts + (n,)))

    if topo.kind == "chain":
        for a in contiguous(list(topo.pre), space.num_layers + bool(send_input)):
            yield (np.append(a[1:], a[:1]) if send_input else a).astype(np.int32)
        return
    seg, dev = mesh_segments(space), space.layer_devices()
    for a in contiguous(list(seg.prefix_devices), seg.prefix):
        for b in contiguous(list(seg.post), space.num_layers - seg.suffix_start):
            yield np.concatenate([a, dev[seg.prefix:seg.suffix_start], b]).astype(np.int32)


def repair_any_split(space, table, terms: Terms, choices: Choices, logits: ChoiceProbs, t_const_ms: float,
                     limits: DeviceLimits | None = None) -> tuple:
    """(ComposedRepair, split int32[N]): the most probable configuration and split together, T <= t_const_ms and
    every device within ``limits``, exact: ``repair`` under every split of ``splits`` (C(N + M - 1, M - 1) of them
    on an M-device chain of N layers: 165 for the main job's; 220 where ``choices.send_input`` moves the stem
    too), the least -log P kept (the shorter T on a tie).
    When no split meets T_const: the fastest configuration of any split. ``LimitsError`` when no split keeps every
    device within its limits."""
    best, fastest, errors = None, None, []
    check_logits(logits)
    probs = probs_from_logits(space, choices, logits)
    for a in splits(space, choices.send_input):
        try:
            fix = repair(space, table, terms, choices, logits, t_const_ms, a, limits, probs)
        except LimitsError as e:
            errors.append(e)
            continue
        if fix.feasible and (best is None or (fix.logprob_loss, fix.latency_ms) < (best[0].logprob_loss,
                                                                                   best[0].latency_ms)):
            best = (fix, a)
        if fastest is None or fix.min_latency_ms < fastest[0].min_latency_ms:
            fastest = (fix, a)
    if fastest is None:
        raise LimitsError("no configuration of the composed space keeps every device within its memory and energy "
                          "limits under any split")
    if best is not None:
        return best[0]._replace(min_latency_ms=fastest[0].min_latency_ms), best[1]
    return fastest
