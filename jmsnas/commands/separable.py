"""``jmsnas separable``: a separable network over G devices with a learned communication controller
(``jmsnas.separable.search``)."""
from __future__ import annotations

import os

from jmsnas.runcheck import path_flag


def add_parser(sub) -> None:
    p = sub.add_parser("separable", help="separable ResNeXt over G devices: LSTM controller vs random sampler for the "
                                         "communication decisions (paper 004)",
                       epilog="Overrides: --config.KEY=VALUE, e.g. --config.net.alpha=1 --config.search.rounds=3 "
                              "(every key, its default, unit and meaning: docs/configuration.md)")
    p.add_argument("--config", default=None, help="config file (.py with get_config()[:arg]); default: built-in "
                                                  "(jmsnas.separable.config.default_config), or with --resume the "
                                                  "one stored in --workdir")
    p.add_argument("--workdir", required=True, type=path_flag, help="where checkpoints, result.json, history.json and plots go")
    p.add_argument("--resume", action="store_true", help="continue the run in --workdir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def summary(result) -> str:
    n, lines = result["network"], []
    lines.append(f"separable network: G={n['G']} alpha={n['alpha']} K={n['K']} float16={n['float16']} "
                 f"({n['steps']} transmission steps, {n['search_space_size']:.3g} decision sequences)")
    for arm in ("controller", "random"):
        a = result[arm]
        c = a["cost"]
        lines.append(f"  {arm:10s} decisions {a['decisions']['perm_ids']} levels {a['decisions']['levels']}: "
                     f"test acc {100 * a['test_acc']:.2f}%, {c['bytes_per_image']} B/image "
                     f"({100 * c['bytes_ratio']:.1f}% of non-separated), latency {c['latency_ms']:.3f} ms "
                     f"(synchronous {c['synchronous_ms']:.3f} ms)")
    if "given" in result:
        g, c = result["given"], result["given"]["cost"]
        lines.append(f"  given decisions {g['decisions']['perm_ids']} levels {g['decisions']['levels']} (controller's "
                     f"weights): test acc {100 * g['test_acc']:.2f}%, {c['bytes_per_image']} B/image, latency "
                     f"{c['latency_ms']:.3f} ms (synchronous {c['synchronous_ms']:.3f} ms)")
    if "reference" in result:
        lines.append(f"  non-separated: test acc {100 * result['reference']['test_acc']:.2f}%, "
                     f"{result['reference']['bytes_per_image']} B/image (ring all-reduce)")
    rs = result["reward_summary"]
    lines.append(f"  mean validation reward over the search: controller {rs['controller']['mean_reward']:.4f}, "
                 f"random {rs['random']['mean_reward']:.4f}")
    return "\n".join(lines)


def run(args, extra=()) -> int:
    from jmsnas.checkpoint import CheckpointError
    from jmsnas.commands import fail
    from jmsnas.commands.search import run_config
    from jmsnas.data import DatasetError
    from jmsnas.separable import config, search
    from jmsnas.topology import TopologyError
    try:
        cfg = run_config(args, extra, default=config.default_config)  # --resume alone: the stored config
        result = search.search(cfg, args.workdir, resume=args.resume, progress=not args.no_progress)
    except (ValueError, CheckpointError, DatasetError, TopologyError) as e:
        return fail(args.command, e)
    print(summary(result))
    print(f"\nwrote {os.path.join(args.workdir, 'result.json')}, history.json, reward_curve.png, bytes_accuracy.png "
          "and checkpoints/ there")
    return 0
