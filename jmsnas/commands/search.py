"""``jmsnas search`` and ``jmsnas retrain``: the main job from a config file, with overrides."""
from __future__ import annotations

import json
import os
import sys

from jmsnas import configs, distributed, safeio
from jmsnas.runcheck import path_flag


def run_config(args, extra, with_defaults=None, default=configs.default_config):
    """The configuration of a run: --config (or ``default()``), or, when resuming a workdir without --config, the
    configuration stored there (``config.json``); then the overrides."""
    import ml_collections
    from jmsnas.run import directory
    resume = args.command == "retrain" or getattr(args, "resume", False)
    stored = directory.stored_config(args.workdir) if resume and args.config is None and os.path.isdir(
        args.workdir) else None
    if stored is not None:
        cfg = ml_collections.ConfigDict(directory.tuples(stored["config"]))
    else:
        cfg = configs.load_config(args.config, default)
        cfg = with_defaults(cfg) if with_defaults else cfg
    return configs.apply_overrides(cfg, extra)


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
                                                     "(docs/topology.md); every key, its default, unit and meaning: "
                                                     "docs/configuration.md")
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
    from jmsnas import pipeline

    def flow():
        cfg = run_config(args, extra)
        resume = args.command == "retrain" or args.resume
        if "fbnet" in cfg:  # the FBNet space (jmsnas.fbnet.flow): per-layer tables, supernet + evolution
            from jmsnas.fbnet import flow as fbnet_flow
            return fbnet_flow.run(cfg, args.workdir, resume=resume, progress=not args.no_progress, command="search")
        return pipeline.search(cfg, args.workdir, resume=resume, progress=not args.no_progress)

    result = run_training(args, flow, extra)
    return result if isinstance(result, int) else print_result(result, args.workdir, "plots, parts/")


def print_result(result: dict, workdir: str, files: str) -> int:
    """Prints the summary of a search/evolve run (any flow's result.json) and the files it wrote; returns 0."""
    from jmsnas import report
    if result.get("flow") == "fbnet":  # no plots or parts: the FBNet flow reports latencies from the tables
        from jmsnas.fbnet import flow as fbnet_flow
        print(fbnet_flow.summary(result))
        files = ""
    else:
        print(report.format_summary(result))
    print(f"\nwrote {os.path.join(workdir, 'result.json')}, {files + ', ' if files else ''}checkpoints/ there")
    return 0
