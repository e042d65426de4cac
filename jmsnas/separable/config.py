"""The separable-network run's configuration (ml_collections) and its validation."""
from __future__ import annotations

import ml_collections

from jmsnas import data, runcheck, tensorboard as tb


def default_config() -> ml_collections.ConfigDict:
    """G = 4 nodes, alpha = 2, a 2-stage Sep-ResNeXt on the embedded digits, Raspberry Pi 3B+ class devices."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.dataset = "digits"
    c.data_dir = ml_collections.FieldReference(None, field_type=str)
    c.val_fraction = 0.15
    c.max_train = ml_collections.FieldReference(None, field_type=int)
    c.net = ml_collections.ConfigDict(dict(
        num_groups=4, stem_channels=16, stage_channels=(16, 32), stage_blocks=(2, 2), stage_strides=(1, 2),
        cardinality=8, path_width=4, alpha=2, num_levels=1, p_min=50.0, float16=False, output_group=0))
    # the cluster: one device per group, links between all of them. Paper 004, section 4.6: a Raspberry Pi 3B+
    # computes 1.7e8 FLOP/s and sends at 300 Mbit/s. num_devices None = G; peak_gflops and bandwidth_mbps take a
    # number (all the same) or a list (per device / a G x G matrix, diagonal ignored).
    c.cluster = ml_collections.ConfigDict(dict(num_devices=None, peak_gflops=0.17, efficiency=1.0,
                                               bandwidth_mbps=300.0, link_latency_ms=0.0, input_device=0))
    c.cluster.num_devices = ml_collections.FieldReference(None, field_type=int)
    # or a topology file (docs/topology.md) linking every ordered pair of its G devices, e.g.
    # experiments/topologies/pi_cluster4.yaml; it replaces the numbers above
    c.cluster.topology = ml_collections.FieldReference(None, field_type=str)
    c.search = ml_collections.ConfigDict(dict(
        rounds=8, net_steps=50, decisions_per_step=1, batch_size=64, lr=3e-3, ctrl_steps=10, population=8,
        ctrl_lr=0.02, hidden=100, entropy_coef=1e-3, comm_cost=0.0, final_samples=8, finetune_steps=30,
        finetune_lr=1e-3, baseline_decay=0.0, augment_shift=1))
    # augment_shift: training batches (every arm, the reference, fine-tuning) are shifted by up to this many pixels
    # in each direction, edges repeated (the paper trains with AutoAugment, section 4.1); 0 = no augmentation.
    # Without it the network trained on the controller's one decision overfits the 1298 digits and loses to the
    # network trained on random decisions in 5 of 18 runs (experiments/separable.md)
    # baseline_decay: the controller's REINFORCE baseline is b <- d b + (1 - d) mean(rewards of this step). d = 0
    # (default) uses the mean reward of the step's own P decisions, judged with the same weights; an EMA (d > 0)
    # lags behind the jump in accuracy after each round of network training and so rewards every decision sampled
    # in the first steps of a round
    # a decision sequence to report as well (S permutations, Table 3 reading: entry i = destination of node i),
    # e.g. ((1, 0, 3, 2), (0, 1, 2, 3)); levels: S sparsity levels (None: 100 %)
    c.decisions = ml_collections.FieldReference(None, field_type=tuple)
    c.levels = ml_collections.FieldReference(None, field_type=tuple)
    c.reference = True  # also train the non-separated network for the same number of steps
    c.eval_batch_size = 256
    # True: compile without XLA's optimisation passes (about 1.3x faster compiles, 2.5x slower steps on CPU)
    c.fast_compile = False
    c.tensorboard = True  # TensorBoard logs under WORKDIR/tensorboard (jmsnas.tensorboard); False: none
    return c


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A few steps of everything (tests, smoke runs)."""
    c.max_train = 256
    c.net.stem_channels, c.net.stage_channels, c.net.path_width = 8, (8, 8), 2
    s = c.search
    s.rounds, s.net_steps, s.ctrl_steps, s.population, s.final_samples, s.finetune_steps = 2, 3, 2, 4, 4, 2
    s.batch_size, s.hidden = 32, 16
    return c


_POS_INT = ("rounds", "net_steps", "decisions_per_step", "batch_size", "ctrl_steps", "population", "hidden",
            "final_samples")
# the bounds of the numeric settings (runcheck.number's keyword arguments)
BOUNDS = {**{f"search.{n}": dict(low=1, integer=True) for n in _POS_INT},
          "search.finetune_steps": dict(low=0, integer=True), "search.augment_shift": dict(low=0, integer=True),
          **{f"search.{n}": dict(low=0, low_open=True) for n in ("lr", "ctrl_lr", "finetune_lr")},
          "search.entropy_coef": dict(low=0), "search.comm_cost": dict(low=0),
          "search.baseline_decay": dict(low=0, high=1, high_open=True),
          "cluster.efficiency": {}, "cluster.link_latency_ms": {},
          "cluster.num_devices": dict(low=2, integer=True, optional=True)}


def validate(cfg) -> None:
    """Checks the values that would fail deep inside a run, before anything is loaded or written."""
    tb.enabled(cfg)  # a bool
    data.check_name(cfg.dataset)
    runcheck.with_defaults(cfg.net, default_config().net.to_dict(), "net")  # the network's settings, no others
    optional = ("search.finetune_steps", "search.augment_shift", "search.baseline_decay")  # older configs lack them
    runcheck.check_bounds(cfg, {k: v for k, v in BOUNDS.items()
                                if k not in optional or k.split(".")[1] in cfg.search})
