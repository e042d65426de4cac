"""``jmsnas search`` and ``jmsnas retrain``: the main job from a config file, with overrides."""
from __future__ import annotations

import json
import os
import sys

from jmsnas import distributed, safeio
from jmsnas.runcheck import path_flag


def load_config(path: str | None):
    """A ConfigDict from ``path`` (a .py file with get_config(), optionally ``file.py:arg``) or the default."""
    from jmsnas.configs import default_config
    if path is None:
        return default_config()
    file, _, arg = path.partition(":")
    module = safeio.import_file(file, "config file", "jmsnas_user_config")
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {file!r} has no get_config()")
    args = (arg,) if arg else ()
    cfg = safeio.call_user(module.get_config, f"config file {file!r}: get_config()", *args)
    if not hasattr(cfg, "to_dict"):
        raise ValueError(f"config file {file!r}: get_config() returned {type(cfg).__name__}, expected a ConfigDict")
    return cfg


def run_config(args, extra, with_defaults=None):
    """The configuration of a run: --config (or the default), or, when resuming a workdir without --config, the
    configuration stored there (``config.json``); then the overrides."""
    import ml_collections
    from jmsnas.run import directory
    resume = args.command == "retrain" or getattr(args, "resume", False)
    stored = directory.stored_config(args.workdir) if resume and args.config is None and os.path.isdir(
        args.workdir) else None
    if stored is not None:
        cfg = ml_collections.ConfigDict(directory.tuples(stored["config"]))
    else:
        cfg = load_config(args.config)
        cfg = with_defaults(cfg) if with_defaults else cfg
    return apply_overrides(cfg, extra)


def _parse_value(key: str, value: str, old):
    """The YAML value of an override, checked against the type of the value it replaces."""
    try:
        parsed = safeio.load_yaml(value, f"value of --config.{key}", max_bytes=1 << 20, max_depth=8)
    except ValueError as e:
        raise ValueError(f"bad value {safeio.short(value)} for config key {key!r}: {e}") from None
    if isinstance(old, float) and isinstance(parsed, str):
        try:  # YAML 1.1 reads 2e-3 (no dot) as a string; the built-in configs write it
            parsed = float(parsed)
        except ValueError:
            pass
    if isinstance(parsed, list):
        parsed = tuple(parsed)
    want = None
    if isinstance(old, bool) and not isinstance(parsed, bool):
        want = "true or false"
    elif not isinstance(old, bool) and isinstance(old, (int, float)) and (
            isinstance(parsed, bool) or not isinstance(parsed, (int, float))):
        want = "a number"
    elif isinstance(old, int) and not isinstance(old, bool) and isinstance(parsed, float):
        want = "an integer"
    elif isinstance(old, str) and not isinstance(parsed, str):
        parsed = value  # e.g. --config.topology=123 is the name "123"
    elif isinstance(old, tuple) and not isinstance(parsed, tuple):
        want = "a list, e.g. [1, 2]"
    elif hasattr(old, "keys"):
        want = f"keys of its own (--config.{key}.NAME=VALUE)"
    if want:
        raise ValueError(f"bad value {safeio.short(value)} for config key {key!r}: expected {want} "
                         f"(current value {safeio.short(old)})")
    return parsed


def apply_overrides(cfg, overrides):
    """``--config.a.b=value`` pairs (value parsed as YAML) applied to cfg; unknown keys are errors."""
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise ValueError(f"unrecognised argument {safeio.short(item)}; overrides look like "
                             "--config.search.epochs=3")
        key, value = item[len("--config."):].split("=", 1)
        parent, name = cfg, key.split(".")[-1]
        for part in key.split(".")[:-1]:
            if not hasattr(parent, "keys") or part not in parent:
                raise ValueError(f"unknown config key {safeio.short(key)}")
            parent = parent[part]
        if not hasattr(parent, "keys") or name not in parent:
            raise ValueError(f"unknown config key {safeio.short(key)}")
        parsed = _parse_value(key, value, parent[name])
        try:
            parent[name] = parsed
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad value {safeio.short(value)} for config key {key!r}: {safeio.clip(e)}") from None
    return cfg


def lost_peer(command: str, e: BaseException) -> int:
    """Exit 1 with one line when another process of a multi-process run stopped; re-raise anything else."""
    line = distributed.lost_peer_message(e) if distributed.collective_failure(e) else None
    if line is None:
        raise e
    print(f"jmsnas {command}: error: {line}", file=sys.stderr, flush=True)
    return distributed.leave(1)


def add_parser(sub) -> None:
    for name, help_ in (("search", "run JMSNAS end to end: search, budget repair, retrain, report"),
                        ("retrain", "continue or redo stage 2 of a run in --workdir (same as search --resume)")):
        p = sub.add_parser(name, help=help_, epilog="Overrides: --config.KEY=VALUE, e.g. --config.t_const_ms=2.7; "
                                                     "--config.topology=FILE.yaml runs on your own devices "
                                                     "(docs/topology.md)")
        p.add_argument("--config", default=None, help="config file (.py with get_config()); default: built-in "
                       "chain, or with --resume/retrain the one stored in --workdir")
        p.add_argument("--workdir", required=True, type=path_flag, help="where checkpoints, result.json, plots and parts go")
        if name == "search":
            p.add_argument("--resume", action="store_true", help="continue the run in --workdir")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        distributed.add_flags(p)


def command_fingerprint(args, extra) -> str:
    """A hash of what makes one process's run the same as another's: the command, --resume, the config file's
    bytes (and its ``:arg``), the overrides and the number of processes (compared when the processes join)."""
    import hashlib
    h = hashlib.sha256()
    resume = args.command == "retrain" or getattr(args, "resume", False)
    h.update(json.dumps([args.command, resume, list(extra), args.num_processes]).encode())
    if args.config:
        file, _, arg = args.config.partition(":")
        h.update(arg.encode())
        try:
            with open(file, "rb") as f:
                h.update(f.read(1 << 24))
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def run_training(args, flow, extra=()):
    """Joins the processes of the run, then ``flow()``; its failures become the command's exit code: bad input one
    line and 2, a lost peer of a multi-process run one line and 1. Returns flow's result, or that exit code."""
    from jmsnas.checkpoint import CheckpointError
    from jmsnas.data import DatasetError
    from jmsnas.topology import TopologyError
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               command_fingerprint(args, extra))
        return flow()
    except (ValueError, CheckpointError, DatasetError, TopologyError) as e:
        if distributed.collective_failure(e):  # a lost peer, wrapped in one of these types on its way up
            return lost_peer(args.command, e)
        print(f"jmsnas {args.command}: error: {safeio.clip(e, 600)}", file=sys.stderr)
        return distributed.leave(2)
    except Exception as e:  # noqa: BLE001 - only a lost peer of a multi-process run is reported here
        return lost_peer(args.command, e)


def run(args, extra=()) -> int:
    from jmsnas import pipeline, report

    def flow():
        cfg = run_config(args, extra)
        resume = args.command == "retrain" or args.resume
        if "fbnet" in cfg:  # the FBNet space (jmsnas.fbnet.flow): per-layer tables, supernet + evolution
            from jmsnas.fbnet import flow as fbnet_flow
            return fbnet_flow.run(cfg, args.workdir, resume=resume, progress=not args.no_progress)
        return pipeline.search(cfg, args.workdir, resume=resume, progress=not args.no_progress)

    result = run_training(args, flow, extra)
    if isinstance(result, int):
        return result
    print(report.format_summary(result))
    print(f"\nwrote {os.path.join(args.workdir, 'result.json')} and plots, parts/ and checkpoints/ there")
    return 0
