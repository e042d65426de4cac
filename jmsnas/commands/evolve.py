"""``jmsnas evolve``: sandwich-rule supernet training, then evolution under T <= T_const (``jmsnas.evolve``)."""
from __future__ import annotations

import os
import sys

from jmsnas import distributed, safeio
from jmsnas.commands.search import lost_peer, run_config


def add_parser(sub) -> None:
    p = sub.add_parser("evolve", help="two-stage weight sharing: supernet (sandwich rule), evolution under "
                                      "T <= T_const, retrain; same outputs as search",
                       epilog="Overrides: --config.KEY=VALUE, e.g. --config.evolve.population=128 "
                              "(evolve settings: see jmsnas.evolve.DEFAULTS)")
    p.add_argument("--config", default=None, help="config file (.py with get_config()); default: built-in chain")
    p.add_argument("--workdir", required=True, help="where checkpoints, result.json, plots and parts go")
    p.add_argument("--resume", action="store_true", help="continue the run in --workdir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    distributed.add_flags(p)


def run(args, extra=()) -> int:
    from jmsnas import evolve, report
    from jmsnas.checkpoint import CheckpointError
    from jmsnas.data import DatasetError
    from jmsnas.topology import TopologyError
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        cfg = run_config(args, extra, evolve.with_defaults)
        if "splitnets" in cfg:  # SplitNets' system (jmsnas.splitnets.search): split module, views, shared bus
            from jmsnas.splitnets import search as splitnets_search
            flow = splitnets_search.evolve
        else:
            flow = evolve.evolve
        result = flow(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)
    except (ValueError, CheckpointError, DatasetError, TopologyError) as e:
        if distributed.collective_failure(e):  # a lost peer, wrapped in one of these types on its way up
            return lost_peer(args.command, e)
        print(f"jmsnas {args.command}: error: {safeio.clip(e, 600)}", file=sys.stderr)
        return distributed.leave(2)
    except Exception as e:  # noqa: BLE001 - only a lost peer of a multi-process run is reported here
        return lost_peer(args.command, e)
    print(report.format_summary(result))
    print(f"\nwrote {os.path.join(args.workdir, 'result.json')}, evolution.json and plots, parts/"
          + ("" if result.get("flow") == "splitnets" else " and checkpoints/") + " there")
    return 0
