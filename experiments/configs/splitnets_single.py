"""SplitNets, single view (V = 1): ``jmsnas evolve --config experiments/configs/splitnets_single.py --workdir W``.

One sensor sees a 12 x 12 crop of each digit upsampled to 16 x 16 (``jmsnas.splitnets.views``) and sends its reduced features to
the aggregator over the whole 1.2 Gbit/s bus. Sensor and aggregator NPUs are SplitNets' (125 GOP/s, 1.25 TOP/s).
Our networks are about 10^4 times smaller than ImageNet models, so the limits are scaled: the sensor's memory is
20 kB instead of 2 MB (the space's networks need 5.5-43 kB at 8 bits) and T_const = 2 us (they take 0.7-3.7 us).
The paper's 512 x 20 evolution is the default of ``jmsnas.evolve``; this config runs 32 x 4 to stay short.
"""
import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    if arg not in ("", "tiny"):  # a typo (":tyni") must not run the full config
        raise ValueError(f"splitnets config argument must be '' or 'tiny', got {arg!r}")
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.dataset = "digits"
    c.data_dir = ml_collections.FieldReference(None, field_type=str)
    c.val_fraction = 0.15
    c.image_size = 16  # the 8 x 8 digits upsampled: a 16 x 16 camera
    c.max_train = ml_collections.FieldReference(None, field_type=int)
    c.t_const_ms = 0.002
    c.splitnets = ml_collections.ConfigDict(dict(
        views=1, view_size=12, stem_channels=8, phase_channels=(12, 16, 24), phase_strides=(2, 2, 2), max_depth=2,
        kernels=(3, 5), expands=(3, 6), reductions=(2, 4, 8), split_kernel=1, head_channels=64, init="geometric",
        extra_modules=0.5, bus_mbps=1200.0, sensor_memory_bytes=20000.0))
    c.splitnets.topology = ml_collections.FieldReference(None, field_type=str)
    c.search = ml_collections.ConfigDict(dict(batch_size=64, weight_lr=3e-3, lambda1=1e-5))
    c.evolve = ml_collections.ConfigDict(dict(epochs=4, num_random=2, population=32, generations=4,
                                              fitness_examples=229, bn_batches=2, bn_batch_size=64))
    c.retrain = ml_collections.ConfigDict(dict(epochs=2, lr=1e-3))
    c.checkpoint_every = 50  # batches between mid-epoch checkpoints (jmsnas.run.loop)
    c.checkpoint_min_interval_s = 30.0  # epoch-end checkpoints at most this often, and after each stage's last
    if arg == "tiny":  # tests and smoke runs
        c.max_train = 128
        c.splitnets.phase_channels, c.splitnets.phase_strides, c.splitnets.max_depth = (8, 16), (2, 2), 2
        c.splitnets.kernels, c.splitnets.expands, c.splitnets.reductions = (3,), (3, 6), (2, 4)
        c.splitnets.head_channels = 16
        c.search.batch_size = 32
        c.evolve.update(epochs=1, population=8, generations=2, fitness_examples=64, bn_batches=1, bn_batch_size=32)
        c.retrain.epochs = 1
    return c
