"""``jmsnas modularize``, ``jmsnas load`` and ``jmsnas finetune``: a trained network as children that load in
parallel (paper 002).

    jmsnas modularize --model NAME|RUN_DIR|pkg.module:factory --children K|auto --out DIR [--strategy exact|qlearning|equal]
                      [--load-model FILE] [--threads N] [--config FILE] [--json]
    jmsnas load DIR [--parallel N] [--infer] [--batch B] [--cold] [--json]
    jmsnas finetune DIR --steps N [--lr LR]          (children of a jmsnas run: its validation split)

``modularize`` measures the loading-time model on this machine (cold reads, a few seconds; ``--load-model`` reuses
a saved one, ``--save-load-model`` writes it), splits the blocks into K balanced contiguous children (``auto``: the
K in 1..8 with the smallest predicted load time on ``--threads`` threads) and writes each child as an orbax
checkpoint plus a manifest. ``load`` restores them with N threads; ``--infer`` runs child i as soon as children
1..i are loaded. Both print a JSON report with ``--json``. Bad arguments print one ``jmsnas <command>: error: ...``
line to stderr, exit with 2 and leave nothing half-written.
"""
from __future__ import annotations

import json
import sys

from jmsnas.runcheck import number_flag, path_flag
from jmsnas.commands import fail


def add_parser(sub) -> None:
    p = sub.add_parser("modularize", help="split a trained network into children balanced for parallel loading",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="zoo network name, a jmsnas search run directory or a model "
                   "reference pkg.module:factory (docs/your_model.md)")
    p.add_argument("--children", required=True, help="number of children K, or 'auto'")
    p.add_argument("--out", required=True, type=path_flag, help="new directory for the children and manifest.json")
    p.add_argument("--strategy", default="exact", help="exact | qlearning | equal (default exact)")
    p.add_argument("--load-model", default=None, type=path_flag, help="JSON load model to use instead of measuring one now")
    p.add_argument("--save-load-model", default=None, type=path_flag, help="also write the measured load model to this JSON file")
    p.add_argument("--threads", type=number_flag(int, 1, 1024), default=None, help="loading threads assumed by --children auto "
                   "(default: this machine's hardware threads)")
    p.add_argument("--config", default=None, help="the run's config file, for runs without config.json")
    p.add_argument("--seed", type=number_flag(int, 0, 2**32 - 1), default=0, help="seed of zoo networks' random weights and the agent")
    p.add_argument("--inference-time", action="store_true", help="also measure each block's inference time")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress display")

    p = sub.add_parser("load", help="load modularized children in parallel (and run inference while loading)")
    p.add_argument("directory", type=path_flag, help="directory written by jmsnas modularize")
    p.add_argument("--parallel", type=number_flag(int, 1, 1024), default=None, help="loading threads (default and cap: the hardware "
                   "threads and the number of children)")
    p.add_argument("--infer", action="store_true", help="run inference on a random batch while loading")
    p.add_argument("--batch", type=number_flag(int, 1, 4096), default=1, help="batch size of --infer (default 1)")
    p.add_argument("--cold", action="store_true", help="drop the children from the page cache first")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress display")

    p = sub.add_parser("finetune", help="train only the last child of a modularized jmsnas run on its dataset")
    p.add_argument("directory", type=path_flag, help="directory written by jmsnas modularize from a run directory")
    p.add_argument("--steps", type=number_flag(int, 1, 10**6), default=20, help="Adam steps (default 20)")
    p.add_argument("--lr", type=number_flag(float, 0, 10, low_open=True), default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--batch", type=number_flag(int, 1, 4096), default=64, help="batch size (default 64)")
    p.add_argument("--json", action="store_true", help="print the JSON report")


def _children_arg(value: str):
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        k = None
    if k is None or k < 1:
        raise ValueError(f"--children must be an integer >= 1 or 'auto', got {value!r}")
    return k


def run(args) -> int:
    from jmsnas.modular.blocks import ModularError
    cmd = args.command
    try:
        return {"modularize": _modularize, "load": _load, "finetune": _finetune}[cmd](args)
    except (ModularError, ValueError) as e:
        return fail(cmd, str(e))


def _modularize(args) -> int:
    from jmsnas.modular import api
    from jmsnas.modular.partition import STRATEGIES
    k = _children_arg(args.children)
    if args.strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {list(STRATEGIES)}, got {args.strategy!r}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    config = None
    if args.config is not None:
        from jmsnas.configs import load_config
        config = load_config(args.config)
    say = (lambda msg: None) if args.no_progress or args.json else (lambda msg: print(msg, file=sys.stderr))
    report = api.modularize(args.model, k, args.out, strategy=args.strategy, load_model=args.load_model,
                            save_load_model=args.save_load_model, threads=args.threads, config=config,
                            seed=args.seed, inference_time=args.inference_time, say=say)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(api.format_modularize(report))
    return 0


def _load(args) -> int:
    from jmsnas.modular import api
    say = (lambda msg: None) if args.no_progress or args.json else (lambda msg: print(msg, file=sys.stderr))
    report = api.load(args.directory, parallel=args.parallel, infer=args.infer, batch=args.batch, cold=args.cold,
                      say=say)
    print(json.dumps(report, indent=2) if args.json else api.format_load(report))
    return 0


def _finetune(args) -> int:
    from jmsnas.modular import api
    report = api.finetune(args.directory, steps=args.steps, lr=args.lr, batch=args.batch)
    print(json.dumps(report, indent=2) if args.json else
          f"fine-tuned the last child of {args.directory} for {report['steps']} steps: loss "
          f"{report['loss_first']:.4f} -> {report['loss_last']:.4f}, accuracy "
          f"{100 * report['accuracy_before']:.2f}% -> {100 * report['accuracy_after']:.2f}% on the validation split; "
          f"saved as {report['child_dir']} (the other children are unchanged)")
    return 0
