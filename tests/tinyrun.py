"""A finished tiny `jmsnas search` run made without training (random weights through the main job's own
``pipeline.write_parts``), for tests of the commands that read a run: export, pipeline, modularize, autosplit."""
import json
import os

import jax
import numpy as np

from jmsnas import configs, ops as O, pipeline
from jmsnas import space as S
from jmsnas.run import workdir as W
from jmsnas.cost.latency import arch_latency, breakdown_dict
from jmsnas.space import OP_NAMES, OPS


def make(workdir: str, seed: int = 0) -> str:
    """Writes parts/, result.json and config.json of a tiny chain run into ``workdir``; returns it."""
    cfg = configs.tiny(configs.default_config())
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    mask = space.mask()
    rng = np.random.default_rng(seed)
    ops = tuple(int(rng.choice(np.flatnonzero(mask[n]))) for n in range(space.num_layers))
    key = jax.random.PRNGKey(seed)  # shapes from the initialisers (eval_shape: nothing compiles), values drawn here
    layers = [jax.eval_shape(lambda i=i, s=s: O.op_init(key, OPS[i], s.in_ch, s.out_ch))
              for i, s in zip(ops, space.layers)]
    stem = jax.eval_shape(lambda: O.conv_bn_init(key, 3, space.in_channels, space.stem_channels))
    head = jax.eval_shape(lambda: O.head_init(key, space.layers[-1].out_ch, space.head_channels, space.num_classes))
    draw = lambda path, a: {"var": np.abs(rng.normal(1.0, 0.3, a.shape)) + 0.1}.get(
        str(getattr(path[-1], "key", "")), rng.normal(0.0, 0.3, a.shape)).astype(np.float32)
    fill = lambda t: jax.tree_util.tree_map_with_path(draw, t)
    cp = fill({"stem": stem[0], "head": head[0], "layers": tuple(p for p, _ in layers)})
    cs = fill({"stem": stem[1], "head": head[1], "layers": tuple(st for _, st in layers)})
    os.makedirs(workdir, exist_ok=True)
    pipeline.write_parts(space, cp, cs, ops, workdir)
    topo = space.topology
    result = {"topology": cfg.topology, "dataset": cfg.dataset, "seed": cfg.seed, "space": S.to_dict(space),
              "architecture": [{"layer": s.index, "device": topo.device_names[d], "op": OP_NAMES[i]}
                               for s, i, d in zip(space.layers, ops, space.layer_devices())],
              "latency_ms": breakdown_dict(space, arch_latency(space, table, np.asarray(ops)))}
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(result, f)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"command": "search", "config": W.plain(cfg)}, f)
    return workdir


def digest(path) -> dict:
    """{relative path: bytes} of every file (and "dir/": None of every folder) under ``path``."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = None
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def assert_common_top_level(result: dict, flow: str) -> None:
    """The top level every flow's result.json has (docs/run_directory.md, ``run.directory.RESULT_KEYS``)."""
    from jmsnas.run import directory
    assert set(directory.RESULT_KEYS) <= set(result), sorted(set(directory.RESULT_KEYS) - set(result))
    assert result["flow"] == flow and flow in directory.FLOWS
    assert isinstance(result["topology"], str) and isinstance(result["seed"], int)
    assert result["dataset"] is None or isinstance(result["dataset"], str)
    assert set(result["time"]) >= {"compile", "run", "total"} and result["time"]["total"]["wall_s"] >= 0
