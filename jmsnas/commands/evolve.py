"""``jmsnas evolve``: sandwich-rule supernet training, then evolution under T <= T_const (``jmsnas.evolve``)."""
from __future__ import annotations

from jmsnas import distributed
from jmsnas.commands.search import print_result, run_config, run_training
from jmsnas.runcheck import path_flag


def add_parser(sub) -> None:
    p = sub.add_parser("evolve", help="two-stage weight sharing: supernet (sandwich rule), evolution under "
                                      "T <= T_const, retrain; same outputs as search",
                       epilog="Overrides: --config.KEY=VALUE, e.g. --config.evolve.population=128 "
                              "(every key, its default, unit and meaning: docs/configuration.md)")
    p.add_argument("--config", default=None, help="config file (.py with get_config()); default: built-in chain")
    p.add_argument("--workdir", required=True, type=path_flag, help="where checkpoints, result.json, plots and parts go")
    p.add_argument("--resume", action="store_true", help="continue the run in --workdir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    distributed.add_flags(p)


def run(args, extra=()) -> int:
    from jmsnas import evolve

    def flow():
        cfg = run_config(args, extra, evolve.with_defaults)
        if "fbnet" in cfg:  # the FBNet space (jmsnas.fbnet.flow): per-layer tables, supernet + evolution
            from jmsnas.fbnet import flow as fbnet_flow
            return fbnet_flow.run(cfg, args.workdir, resume=args.resume, progress=not args.no_progress,
                                  command="evolve")
        if "splitnets" in cfg:  # SplitNets' system (jmsnas.splitnets.search): split module, views, shared bus
            from jmsnas.splitnets import search as splitnets_search
            return splitnets_search.evolve(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)
        return evolve.evolve(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)

    result = run_training(args, flow, extra)
    return result if isinstance(result, int) else print_result(result, args.workdir, "evolution.json, plots, parts/")
