"""``jmsnas search`` and ``jmsnas retrain``: the main job from a config file, with overrides."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import yaml


def load_config(path: str | None):
    """A ConfigDict from ``path`` (a .py file with get_config(), optionally ``file.py:arg``) or the default."""
    from jmsnas.configs import default_config
    if path is None:
        return default_config()
    file, _, arg = path.partition(":")
    if not os.path.isfile(file):
        raise ValueError(f"config file {file!r} does not exist")
    spec = importlib.util.spec_from_file_location("jmsnas_user_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {file!r} has no get_config()")
    return module.get_config(arg) if arg else module.get_config()


def apply_overrides(cfg, overrides):
    """``--config.a.b=value`` pairs (value parsed as YAML) applied to cfg; unknown keys are errors."""
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise ValueError(f"unrecognised argument {item!r}; overrides look like --config.search.epochs=3")
        key, value = item[len("--config."):].split("=", 1)
        node, *path = key.split(".")
        parent, name = cfg, key.split(".")[-1]
        for part in key.split(".")[:-1]:
            if part not in parent:
                raise ValueError(f"unknown config key {key!r}")
            parent = parent[part]
        if name not in parent:
            raise ValueError(f"unknown config key {key!r}")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, list):
            parsed = tuple(parsed)
        try:
            parent[name] = parsed
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad value {value!r} for config key {key!r}: {e}") from None
    return cfg


def add_parser(sub) -> None:
    for name, help_ in (("search", "run JMSNAS end to end: search, budget repair, retrain, report"),
                        ("retrain", "continue or redo stage 2 of a run in --workdir (same as search --resume)")):
        p = sub.add_parser(name, help=help_, epilog="Overrides: --config.KEY=VALUE, e.g. --config.t_const_ms=2.7; "
                                                     "--config.topology=FILE.yaml runs on your own devices "
                                                     "(docs/topology.md)")
        p.add_argument("--config", default=None, help="config file (.py with get_config()); default: built-in chain")
        p.add_argument("--workdir", required=True, help="where checkpoints, result.json, plots and parts go")
        if name == "search":
            p.add_argument("--resume", action="store_true", help="continue the run in --workdir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, extra=()) -> int:
    from jmsnas import pipeline, report
    from jmsnas.checkpoint import CheckpointError
    from jmsnas.data import DatasetError
    from jmsnas.topology import TopologyError
    try:
        cfg = apply_overrides(load_config(args.config), extra)
        resume = args.command == "retrain" or args.resume
        result = pipeline.search(cfg, args.workdir, resume=resume, progress=not args.no_progress)
    except (ValueError, CheckpointError, DatasetError, TopologyError) as e:
        print(f"jmsnas {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(report.format_summary(result))
    print(f"\nwrote {os.path.join(args.workdir, 'result.json')} and plots, parts/ and checkpoints/ there")
    return 0
