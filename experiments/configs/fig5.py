"""Fig. 5 of the JMSNAS paper at our scale: the first-stage search on the chain and on the mesh, three T_const each.

``get_config("chain:tight")`` ... ``get_config("mesh:loose")``. Everything but ``t_const_ms`` is the README's main
job (``jmsnas.configs.default_config`` / ``mesh_config``: embedded digits, the default epochs).

The three budgets are placed inside the range of latencies the space can actually reach, so every level is
meetable and none is slack: ``T_const = T_min + f * (T_max - T_min)`` with f = 0.25 (tight), 0.5 (mid) and
0.85 (loose). T_min and T_max are computed here from the same cost table the search uses. With the split fixed
(D^m layers per device), T is non-decreasing in every layer's compute latency (eq. (1) is a sum, eq. (2) a sum
plus a max over branches, and the communicated tensors' shapes do not depend on the ops), so T_min is the
architecture that takes the fastest valid op at every layer and T_max the one that takes the slowest.

Run one level with the main command:
  jmsnas search --config experiments/configs/fig5.py:mesh:tight --workdir runs/fig5/mesh_tight
or all six with ``python experiments/fig5.py``.
"""
from __future__ import annotations

import functools

import ml_collections
import numpy as np

from jmsnas.configs import default_config, mesh_config

TOPOLOGIES = {"chain": default_config, "mesh": mesh_config}
LEVELS = {"tight": 0.25, "mid": 0.5, "loose": 0.85}  # fraction of the way from T_min to T_max


def parse_arg(arg: str) -> tuple[str, str]:
    """"chain:tight" -> ("chain", "tight"); raises ValueError naming the bad part."""
    topo, sep, level = str(arg).partition(":")
    if not sep or topo not in TOPOLOGIES or level not in LEVELS:
        raise ValueError(f"fig5 config argument must be <topology>:<level> with topology in {list(TOPOLOGIES)} "
                         f"and level in {list(LEVELS)}, got {arg!r}")
    return topo, level


def reachable_range(cfg: ml_collections.ConfigDict) -> tuple[float, float]:
    """(T_min, T_max) in ms: the derived latency of the fastest and of the slowest architecture of cfg's space.

    Builds the space exactly as ``jmsnas.pipeline.search`` does (the dataset fixes image size, channels and
    classes; digits is embedded and loads in well under a second).
    """
    from jmsnas import pipeline
    from jmsnas.cost.latency import arch_latency

    cfg = ml_collections.ConfigDict(cfg.to_dict())
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    dev = space.layer_devices()
    lat = np.asarray(table.compute_ms, np.float64)[dev, np.arange(space.num_layers)]  # [N, R] on own device
    valid = space.mask()
    fastest = np.argmin(np.where(valid, lat, np.inf), axis=1).astype(np.int32)
    slowest = np.argmax(np.where(valid, lat, -np.inf), axis=1).astype(np.int32)
    t = lambda ops: float(arch_latency(space, table, ops).total)
    return t(fastest), t(slowest)


@functools.lru_cache(maxsize=None)
def _topology_range(topo: str) -> tuple[float, float]:
    return reachable_range(TOPOLOGIES[topo]())


def get_config(arg: str = "chain:mid") -> ml_collections.ConfigDict:
    """The main job's config for ``arg`` = "<chain|mesh>:<tight|mid|loose>" with T_const set from the range."""
    topo, level = parse_arg(arg)
    c = TOPOLOGIES[topo]()
    t_min, t_max = _topology_range(topo)
    frac = LEVELS[level]
    c.t_const_ms = round(t_min + frac * (t_max - t_min), 4)
    c.experiment = ml_collections.ConfigDict(dict(
        name="fig5", topology=topo, level=level, fraction=frac, reachable_min_ms=t_min, reachable_max_ms=t_max))
    return c
