"""The configuration reference: every key of every built-in configuration, its default, its unit and its meaning.

``docs/configuration.md`` is this module's output (``python -m jmsnas.commands.configref docs/configuration.md``);
``tests/repo/test_configref.py`` checks that the page is up to date, that every key of the configurations has an
entry here and that no entry names a key that does not exist. The ``--help`` of ``search``, ``retrain``,
``evolve`` and ``separable`` points to the page."""
from __future__ import annotations

import sys

PAGE = "docs/configuration.md"

# (unit, meaning) per key; unit "" for names, switches and counts. Keys the configurations share mean the same.
MAIN = {
    "seed": ("", "PRNG seed of the supernet's initialisation, the gates' sampling and the data order"),
    "topology": ("", "the devices and links: a preset (`chain`, `mesh`, a device name) or a topology file "
                     "([your own devices](topology.md))"),
    "layers_per_device": ("layers", "searchable layers on each device of the topology, in device order (D^m)"),
    "dataset": ("", "`digits` (embedded, nothing to download), `cifar10`, `cifar100` or `imagenet2012`"),
    "data_dir": ("path", "a prepared tensorflow-datasets folder for the datasets other than digits"),
    "val_fraction": ("fraction", "share of the training images held out for validation (the architecture steps "
                                 "and the reported validation accuracy)"),
    "image_size": ("pixels", "resize the images to this side; None keeps the dataset's size"),
    "max_train": ("images", "use at most this many training images; None: all"),
    "max_eval": ("images", "use at most this many images of the validation and of the test split; None: all"),
    "space.device_channels": ("channels", "output channels of the layers on each device"),
    "space.device_strides": ("", "stride of the first layer on each device"),
    "space.stem_channels": ("channels", "output channels of the stem convolution"),
    "space.stem_stride": ("", "stride of the stem convolution"),
    "space.head_channels": ("channels", "channels of the 1x1 convolution before pooling and the classifier"),
    "cost.activation_bits": ("bits", "width of a transmitted activation value: the bytes every link carries"),
    "cost.tables": ("", "per-device latency sources replacing the roofline, e.g. `{ue: {kind: measured, path: "
                        "ue.yaml}}` with a `jmsnas profile` table ([profiling](profile.md)); kinds in jmsnas.cost.build"),
    "t_const_ms": ("ms", "the latency budget T_const of the penalty and of the repair of the derived network"),
    "shared_weights": ("", "true: one superkernel per layer shared by its candidates; false: every candidate "
                           "its own weights (ProxylessNAS)"),
    "split": ("", "`fixed`: layers_per_device decides the devices; `searched`: the best chain split of the "
                  "current expected latencies in every architecture step"),
    "search.warmup_epochs": ("epochs", "weight-only epochs before the architecture steps start"),
    "search.epochs": ("epochs", "epochs of the first stage (weights and architecture) after the warm-up"),
    "search.batch_size": ("images", "batch of a weight step and of an architecture step"),
    "search.arch_every": ("steps", "one architecture step after every this many weight steps"),
    "search.weight_lr": ("", "Adam learning rate of the supernet's weights"),
    "search.arch_lr": ("", "Adam learning rate of the architecture logits alpha"),
    "search.lambda1": ("", "weight of the L2 term of eq. (4)"),
    "search.lambda2": ("1/ms²", "weight of the latency term of eq. (4), lambda2 (E[T] - T_const)²"),
    "search.lambda_limits": ("", "weight of the devices' memory and energy hinge (jmsnas.limits), built only "
                                 "where a limit can bind"),
    "search.penalty": ("", "`two_sided`: (E[T] - T_const)² as eq. (4); `one_sided`: only above T_const"),
    "search.gate_mode": ("", "how the architecture step samples: `two_path` (the paper's binary gates), "
                             "`gumbel_soft`, `gumbel_hard`, `softmax` (all paths weighted)"),
    "search.tau0": ("", "Gumbel temperature at the first step (gumbel modes only)"),
    "search.tau_min": ("", "lowest Gumbel temperature"),
    "search.tau_decay": ("per step", "factor the Gumbel temperature is multiplied by each architecture step"),
    "compose.modules": ("", "the composed search's split modules: reductions r >= 2 a SplitNets Conv-Reduce/"
                            "Conv-Recover pair may apply at every cut (sending c // r of c channels), e.g. "
                            "`[2, 4, 8]`; `[]`: no modules ([composed search](composed.md))"),
    "compose.weight_bits": ("bits", "candidate weight bit widths of every layer on a device that quantizes (topology "
                                    "field `quantize`), from 2..8, 16, 32 (float); `[]`: float weights"),
    "compose.activation_bits": ("bits", "candidate bit widths of the tensor every cut transmits, from 1..8, 16, "
                                        "32 (float); `[]`: float32 on the wire"),
    "compose.module_optional": ("", "whether a cut may carry no split module; `false`: every cut carries one of "
                                    "`compose.modules` (one reduction there: a fixed module at every cut)"),
    "compose.send_input": ("", "with `split=\"searched\"` on a chain: a split may send the input image itself, the "
                               "stem moving to the device that runs it ([composed search](composed.md#the-choices))"),
    "retrain.epochs": ("epochs", "second stage: training the derived network from scratch"),
    "retrain.lr": ("", "Adam learning rate of the second stage"),
    "eval_batch_size": ("images", "batch of the evaluations"),
    "checkpoint_every": ("steps", "mid-epoch checkpoint after this many batches"),
    "checkpoint_min_interval_s": ("s", "epoch-end checkpoints at most this often, and after each stage's last "
                                       "epoch; 0: after every epoch"),
    "dw_impl": ("", "depthwise convolution: `auto`, `xla`, `shifted` (sum of shifted slices) or `native` (the "
                    "C++ CPU kernel)"),
    "candidate_impl": ("", "how a layer computes its candidates: `own` size, `padded` to the widest, or `auto`"),
    "tensorboard": ("", "write TensorBoard logs under WORKDIR/tensorboard"),
}

EVOLVE = {
    "evolve.epochs": ("epochs", "supernet training epochs (sandwich rule) before the evolution"),
    "evolve.num_random": ("", "random sub-networks per step besides the largest and the smallest"),
    "evolve.population": ("", "candidates per generation (SplitNets: 512)"),
    "evolve.generations": ("", "generations of the evolution (SplitNets: 20)"),
    "evolve.parent_ratio": ("fraction", "parents are drawn from the feasible members among this top share"),
    "evolve.mutation_prob": ("probability", "chance that a mutated child resamples each layer's choice"),
    "evolve.mutation_ratio": ("fraction", "share of the children made by mutation (the rest by uniform crossover)"),
    "evolve.fitness_examples": ("images", "validation images the fitness is measured on"),
    "evolve.bn_batches": ("batches", "training batches that recalibrate batch norm per candidate (0: running "
                                     "statistics)"),
    "evolve.bn_batch_size": ("images", "size of a recalibration batch"),
    "evolve.chunk": ("networks", "candidates evaluated together (memory grows with it)"),
    "evolve.evaluator": ("", "`batched`: the population in chunks; `loop`: one evaluation per candidate"),
}

SPLITNETS = {
    "splitnets.views": ("sensors", "camera sensors V, each sending its reduced features over the bus"),
    "splitnets.view_size": ("pixels", "side of the crop each sensor sees"),
    "splitnets.stem_channels": ("channels", "output channels of the sensors' stem"),
    "splitnets.phase_channels": ("channels", "output channels of each phase of blocks"),
    "splitnets.phase_strides": ("", "stride of each phase's first block"),
    "splitnets.max_depth": ("blocks", "most blocks per phase"),
    "splitnets.kernels": ("", "candidate kernel sizes"),
    "splitnets.expands": ("", "candidate expansion ratios"),
    "splitnets.reductions": ("", "candidate reductions r of the split module: it sends c // r of c channels"),
    "splitnets.split_kernel": ("", "kernel size of the split module's convolutions"),
    "splitnets.head_channels": ("channels", "channels before the classifier"),
    "splitnets.init": ("", "initialisation of the split module (`geometric`: SplitNets' geometric mean)"),
    "splitnets.extra_modules": ("probability", "single view: chance that a random sub-network of the supernet step "
                                              "carries extra Reduce/Recover pairs in the other phases"),
    "splitnets.topology": ("path", "a topology file with one shared bus, replacing bus_mbps and the presets"),
    "splitnets.bus_mbps": ("Mbit/s", "bandwidth of the bus the sensors share"),
    "splitnets.sensor_memory_bytes": ("bytes", "peak memory limit of a sensor (the hard constraint)"),
}

FBNET = {
    "fbnet.width": ("", "multiplier of the trained network's channels (the tables keep the published space's)"),
    "fbnet.tables": ("", "per device a latency table file or HELP's `file:DEVICE`"),
    "fbnet.fitness": ("", "`supernet`: accuracy with the supernet's weights; `flops`: the network's FLOPs"),
    "fbnet.supernet_epochs": ("epochs", "single-path supernet training"),
    "fbnet.batch_size": ("images", "batch of the supernet training"),
    "fbnet.lr": ("", "Adam learning rate of the supernet training"),
    "fbnet.population": ("", "candidates per generation"),
    "fbnet.generations": ("", "generations of the evolution"),
    "fbnet.fitness_examples": ("images", "validation images the fitness is measured on"),
    "fbnet.seed": ("", "PRNG seed of the supernet's initialisation, its training and the evolution"),
}

SEPARABLE = {
    "seed": MAIN["seed"], "dataset": MAIN["dataset"], "data_dir": MAIN["data_dir"],
    "val_fraction": MAIN["val_fraction"], "max_train": MAIN["max_train"],
    "eval_batch_size": MAIN["eval_batch_size"], "tensorboard": MAIN["tensorboard"],
    "net.num_groups": ("groups", "G: groups of the separable ResNeXt, one per node"),
    "net.stem_channels": ("channels", "output channels of the stem"),
    "net.stage_channels": ("channels", "output channels of each stage"),
    "net.stage_blocks": ("blocks", "blocks per stage"),
    "net.stage_strides": ("", "stride of each stage's first block"),
    "net.cardinality": ("paths", "ResNeXt paths per block"),
    "net.path_width": ("channels", "channels of each path"),
    "net.alpha": ("blocks", "staleness alpha: blocks per window between two transmissions (1: synchronous)"),
    "net.num_levels": ("", "sparsity levels K the controller chooses from (1: none)"),
    "net.p_min": ("%", "the sparsest level: share of the features sent"),
    "net.float16": ("", "send the features as float16"),
    "net.output_group": ("", "the group whose node computes the classifier"),
    "cluster.num_devices": ("devices", "nodes of the cluster; None: G"),
    "cluster.peak_gflops": ("GFLOP/s", "a node's compute rate (a number, or one per node)"),
    "cluster.efficiency": ("fraction", "share of the peak rate reached"),
    "cluster.bandwidth_mbps": ("Mbit/s", "link bandwidth (a number, or a G x G matrix)"),
    "cluster.link_latency_ms": ("ms", "fixed latency of every transfer"),
    "cluster.input_device": ("", "the node that holds the input image"),
    "cluster.topology": ("path", "a topology file linking every pair of nodes, replacing the numbers above"),
    "search.rounds": ("", "rounds of network training then controller training"),
    "search.net_steps": ("steps", "network training steps per round"),
    "search.decisions_per_step": ("", "decisions sampled per network step (Monte Carlo over eq. (9))"),
    "search.batch_size": ("images", "training batch"),
    "search.lr": ("", "Adam learning rate of the network"),
    "search.ctrl_steps": ("steps", "controller (REINFORCE) steps per round"),
    "search.population": ("", "decisions sampled per controller step"),
    "search.ctrl_lr": ("", "Adam learning rate of the LSTM controller"),
    "search.hidden": ("units", "LSTM hidden size"),
    "search.entropy_coef": ("", "weight of the controller's entropy bonus"),
    "search.comm_cost": ("", "reward minus this times the bytes sent relative to the non-separated network"),
    "search.final_samples": ("", "decisions sampled from the trained controller at the end"),
    "search.finetune_steps": ("steps", "fine-tuning of the network on the chosen decision"),
    "search.finetune_lr": ("", "learning rate of the fine-tuning"),
    "search.baseline_decay": ("", "REINFORCE baseline decay d (0: the step's own mean reward)"),
    "search.augment_shift": ("pixels", "random shift of the training images (0: none)"),
    "decisions": ("", "a decision sequence to report as well (S permutations)"),
    "levels": ("", "its sparsity levels (None: 100 %)"),
    "reference": ("", "also train the non-separated network for the same number of steps"),
    "fast_compile": ("", "compile without XLA's optimisation passes (faster compiles, slower steps)"),
}


def _sections():
    """[(title, commands, config, {key: (unit, meaning)})]: the built-in configurations and their documentation."""
    import ml_collections

    from jmsnas import configs, evolve
    from jmsnas.fbnet import flow
    from jmsnas.separable import config as sep
    from jmsnas.splitnets import search as sn
    main = configs.default_config()
    evo = evolve.with_defaults(configs.default_config())
    split = ml_collections.ConfigDict({"splitnets": dict(sn.DEFAULTS)}, type_safe=False)
    fb = ml_collections.ConfigDict({"fbnet": dict(flow.DEFAULTS)}, type_safe=False)
    return [
        ("The main job", "`jmsnas search`, `jmsnas retrain`, `jmsnas evolve` (jmsnas.configs.default_config; "
                         "the mesh preset: jmsnas.configs.mesh_config)", main, MAIN),
        ("Evolution", "`jmsnas evolve` (jmsnas.evolve.DEFAULTS, added to the main job's keys)", evo,
         {**MAIN, **EVOLVE}),
        ("SplitNets", "`jmsnas evolve` with a `splitnets` block (jmsnas.splitnets.search.DEFAULTS; "
                      "experiments/configs/splitnets_single.py)", split, SPLITNETS),
        ("The FBNet space", "`jmsnas search` or `evolve` with an `fbnet` block (jmsnas.fbnet.flow.DEFAULTS; "
                            "experiments/configs/fbnet_raspi4.py)", fb, FBNET),
        ("Separable networks", "`jmsnas separable` (jmsnas.separable.config.default_config)",
         sep.default_config(), SEPARABLE),
    ]


def flat(cfg, prefix: str = "") -> dict:
    """{"a.b": value} of every leaf of a ConfigDict (a dict-valued key such as cost.tables is a leaf)."""
    out = {}
    for k, v in cfg.items():
        if hasattr(v, "items") and len(v):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.to_dict() if hasattr(v, "to_dict") else v
    return out


def all_keys() -> set:
    """Every key of every built-in configuration (and every section prefix, e.g. ``search``)."""
    keys = set()
    for _, _, cfg, _ in _sections():
        for k in flat(cfg):
            parts = k.split(".")
            keys |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return keys


def undocumented() -> list:
    """Keys of a configuration without an entry, and entries naming no key of their configuration."""
    bad = []
    for title, _, cfg, docs in _sections():
        keys = set(flat(cfg))
        bad += [f"{title}: {k} has no entry" for k in sorted(keys - set(docs))]
        bad += [f"{title}: entry {k} is no key" for k in sorted(set(docs) - keys)]
    return bad


def _value(v) -> str:
    """The default as an override would write it (``--config.KEY=VALUE``, YAML)."""
    if v is None:
        return "None"
    text = v if isinstance(v, str) else repr(list(v) if isinstance(v, tuple) else v)
    return f"`{text}`".replace("|", "\\|")


def markdown() -> str:
    """The page: one table per configuration, every key with its default, unit and meaning."""
    lines = ["# Configuration reference", "",
             "Every key of the built-in configurations, with its default, its unit and what it does. A command "
             "takes a config file (`--config FILE`, a `.py` file whose `get_config()` returns one of these, "
             "changed) and overrides of single keys: `--config.KEY=VALUE` (the value is read as YAML and must "
             "have the default's type), e.g. `--config.search.epochs=3`, `--config.t_const_ms=2.7`, "
             "`--config.topology=my_devices.yaml`. An unknown key is an error.", "",
             "This page is generated from the code (`python -m jmsnas.commands.configref docs/configuration.md`; "
             "a test checks it is up to date)."]
    for title, commands, cfg, docs in _sections():
        values = flat(cfg)
        keys = sorted(values) if title != "Evolution" else sorted(k for k in values if k.startswith("evolve."))
        lines += ["", f"## {title}", "", f"Used by {commands}.", "", "| key | default | unit | meaning |",
                  "|---|---|---|---|"]
        for k in keys:
            unit, meaning = docs[k]
            lines.append(f"| `{k}` | {_value(values[k])} | {unit} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = undocumented()
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    text = markdown()
    if argv:
        with open(argv[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
