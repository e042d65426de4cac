"""The composed search against the papers' mechanisms one at a time, on the paper's chain with Table I links.

``get_config("METHOD:T_CONST:SEED[:ue80k]")``, e.g. ``get_config("composed:1.2:0")``. Everything but the method's
switches, ``t_const_ms``, ``seed`` and (with ``ue80k``) the topology is the README's main job
(``jmsnas.configs.default_config``: the chain preset, embedded digits, split fixed at D^m, the default epochs).

Methods (``experiments/composed.py`` runs them all and adds "JMSNAS then Auto-Split", which searches nothing new):

* ``jmsnas``: JMSNAS alone (every ``compose`` switch off: the main job's code path);
* ``module``: JMSNAS with a fixed split module at every cut: SplitNets' Conv-Reduce/Conv-Recover with reduction
  r = 4 on every link (``compose.modules=[4]``, ``compose.module_optional=False``), trained with the ops;
* ``composed``: the composed search: ops, the split (``split="searched"``, the input image sendable:
  ``compose.send_input``), modules r in {2, 4, 8} or none at every cut, weight bits {4, 6, 8, 32} per layer on the
  quantizing devices (every device but the cloud), transmitted bits {4, 6, 8, 32} at every cut.

``ue80k``: the topology ``experiments/topologies/ue_memory_80k.yaml`` (the same chain with 80,000 bytes of UE
memory, below the 112,928 bytes the main job's result needs there).

Run one with the main command:
  jmsnas search --config experiments/configs/composed.py:composed:1.2:0 --workdir runs/composed/composed_1.2_s0
"""
from __future__ import annotations

import os

from jmsnas.configs import default_config

METHODS = {
    "jmsnas": dict(modules=(), weight_bits=(), activation_bits=(), module_optional=True),
    "module": dict(modules=(4,), weight_bits=(), activation_bits=(), module_optional=False),
    "composed": dict(modules=(2, 4, 8), weight_bits=(4, 6, 8, 32), activation_bits=(4, 6, 8, 32),
                     module_optional=True, send_input=True),
}
SPLIT = {"jmsnas": "fixed", "module": "fixed", "composed": "searched"}
UE80K = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "topologies",
                     "ue_memory_80k.yaml")


def parse_arg(arg: str) -> tuple:
    """"composed:1.2:0[:ue80k]" -> ("composed", 1.2, 0, False); ValueError naming the bad part."""
    parts = str(arg).split(":")
    usage = (f"composed config argument must be METHOD:T_CONST:SEED[:ue80k] with METHOD in {list(METHODS)}, "
             f"T_CONST > 0 in ms and SEED an integer >= 0, got {arg!r}")
    if len(parts) not in (3, 4) or parts[0] not in METHODS or (len(parts) == 4 and parts[3] != "ue80k"):
        raise ValueError(usage)
    try:
        t_const, seed = float(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(usage) from None
    if not t_const > 0 or seed < 0:
        raise ValueError(usage)
    return parts[0], t_const, seed, len(parts) == 4


def get_config(arg: str = "composed:2.8:0"):
    method, t_const, seed, ue80k = parse_arg(arg)
    cfg = default_config()
    cfg.t_const_ms = t_const
    cfg.seed = seed
    for key, value in METHODS[method].items():
        cfg.compose[key] = value
    cfg.split = SPLIT[method]
    if ue80k:
        cfg.topology = UE80K
    return cfg
