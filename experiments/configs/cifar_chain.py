"""A CIFAR-sized search: 32x32x3 input, 20 searchable layers over the paper's four-device chain, the paper's optimiser.

``get_config()`` / ``get_config("cifar10")``: CIFAR-10 from a prepared tensorflow-datasets directory (give it with
``--config.data_dir=DIR``; nothing is downloaded), the paper's first stage (20 warm-up + 60 search epochs, Adam at
0.002 for weights and architecture, batch 512; section V-A of paper 003) and 200 retraining epochs. Meant for a
GPU/TPU:

  jmsnas search --config experiments/configs/cifar_chain.py --config.data_dir=~/tensorflow_datasets \\
      --workdir runs/cifar_chain

``get_config("standin")``: the same space and optimiser on the embedded digits resized to 32x32 (one channel
instead of three, the only difference in the supernet: the stem's input channels), 2 + 2 epochs of batch 64 and
1 retraining epoch: a few hundred steps that run on a CPU to measure steps per second, compile time and memory.

Space: the chain UE -> SBS -> MBS -> cloud with Table I links, 5 searchable layers per device (20 in all), widths
32/48/64/96 and strides 1/2/2/1 per device (the supernet of ``benchmarks/bench_vs_pytorch.py``, 2.5 times as
deep), stem 16 channels, head 128. T_const is placed halfway between the fastest and the slowest architecture of
the space (computed from the same cost table the search uses), so the budget binds.
"""
from __future__ import annotations

import functools

import ml_collections
import numpy as np

from jmsnas.configs import default_config

LAYERS_PER_DEVICE = (5, 5, 5, 5)
WIDTHS = (32, 48, 64, 96)
STRIDES = (1, 2, 2, 1)
VARIANTS = ("cifar10", "standin")


@functools.lru_cache(maxsize=None)
def reachable_range(in_channels: int) -> tuple[float, float]:
    """(T_min, T_max) in ms over the architectures of the space at 32x32 x in_channels, split fixed."""
    from jmsnas.topology import presets
    from jmsnas.cost.latency import arch_latency
    from jmsnas.cost.tables import analytic_table
    from jmsnas.space import build_space

    space = build_space(presets.chain_preset(LAYERS_PER_DEVICE), image_size=32, in_channels=in_channels,
                        num_classes=10, device_channels=WIDTHS, device_strides=STRIDES)
    table = analytic_table(space)
    lat = np.asarray(table.compute_ms, np.float64)[space.layer_devices(), np.arange(space.num_layers)]
    valid = space.mask()
    t = lambda ops: float(arch_latency(space, table, ops.astype(np.int32)).total)
    return (t(np.argmin(np.where(valid, lat, np.inf), axis=1)),
            t(np.argmax(np.where(valid, lat, -np.inf), axis=1)))


def get_config(arg: str = "cifar10") -> ml_collections.ConfigDict:
    if arg not in VARIANTS:
        raise ValueError(f"cifar_chain config argument must be one of {list(VARIANTS)}, got {arg!r}")
    c = default_config()
    c.layers_per_device = LAYERS_PER_DEVICE
    c.space.device_channels = WIDTHS
    c.space.device_strides = STRIDES
    c.space.stem_channels, c.space.stem_stride, c.space.head_channels = 16, 1, 128
    c.search.weight_lr = c.search.arch_lr = 0.002  # Adam, paper 003 section V-A
    if arg == "cifar10":
        c.dataset = "cifar10"
        c.search.warmup_epochs, c.search.epochs, c.search.batch_size = 20, 60, 512
        c.retrain.epochs = 200
        c.eval_batch_size = 512
        channels = 3
    else:
        c.image_size = 32
        c.search.warmup_epochs, c.search.epochs, c.search.batch_size = 2, 2, 64
        c.retrain.epochs = 1
        channels = 1
    t_min, t_max = reachable_range(channels)
    c.t_const_ms = round(0.5 * (t_min + t_max), 4)
    return c
