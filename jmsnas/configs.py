"""Built-in configurations (ml_collections), loading a config file and its ``--config.KEY=VALUE`` overrides.
Experiment files under experiments/configs/ start from the built-in ones; every command loads its ``--config``
through :func:`load_config` and :func:`apply_overrides`."""
from __future__ import annotations

import ml_collections

from jmsnas import safeio


def default_config() -> ml_collections.ConfigDict:
    """The main job: the chain preset (UE -> SBS -> MBS -> cloud, Table I links) on the embedded digits data."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.topology = "chain"
    c.layers_per_device = (2, 2, 2, 2)
    c.dataset = "digits"
    c.data_dir = ml_collections.FieldReference(None, field_type=str)
    c.val_fraction = 0.15
    c.image_size = ml_collections.FieldReference(None, field_type=int)
    c.max_train = ml_collections.FieldReference(None, field_type=int)
    c.max_eval = ml_collections.FieldReference(None, field_type=int)  # per validation and test split
    c.space = ml_collections.ConfigDict(dict(device_channels=(24, 32, 48, 64), device_strides=(1, 2, 1, 2),
                                             stem_channels=16, stem_stride=1, head_channels=128))
    c.cost = ml_collections.ConfigDict(dict(activation_bits=32))
    c.cost.tables = ml_collections.FieldReference(None, field_type=dict)
    # The derived latency of this space spans about 2.68-2.98 ms (the ue->sbs transfer alone is 1.97 ms).
    c.t_const_ms = 2.8
    c.shared_weights = True  # one superkernel per layer (see jmsnas.supernet.init); False: ProxylessNAS-style
    c.split = "fixed"  # or "searched": the best chain split of the current E[tau] in every architecture step
    c.search = ml_collections.ConfigDict(dict(
        warmup_epochs=2, epochs=8, batch_size=64, arch_every=1, weight_lr=2e-3, arch_lr=2e-3, lambda1=1e-5,
        lambda2=100.0, penalty="two_sided", gate_mode="two_path", tau0=5.0, tau_min=0.1, tau_decay=0.97,
        # weight of the devices' memory/energy hinge (jmsnas.limits; built only when a limit can bind)
        lambda_limits=100.0))
    c.retrain = ml_collections.ConfigDict(dict(epochs=15, lr=2e-3))
    # the composed search (docs/composed.md): split-module reductions at every cut, weight bit widths of the layers
    # on quantizing devices (topology field quantize), bit widths of the transmitted tensors; all [] = JMSNAS alone;
    # module_optional=False: every cut carries one of the modules (SplitNets' fixed module when modules has one r);
    # send_input=True (a chain, split="searched"): a split may send the input image, the stem moving along the chain
    c.compose = ml_collections.ConfigDict(dict(modules=(), weight_bits=(), activation_bits=(), module_optional=True,
                                               send_input=False))
    c.eval_batch_size = 256
    c.checkpoint_every = 50
    # epoch-end checkpoints: written when this many seconds have passed since the stage's last checkpoint, and
    # always after a stage's last epoch (0: after every epoch). A kill loses at most this much work.
    c.checkpoint_min_interval_s = 30.0
    c.dw_impl = "auto"
    # how the supernet computes candidates: "own" size (lax.switch), "padded" to the widest, or "auto" (own for
    # all-path gates, and for sampled paths on layers whose input has >= 4096 values per image, e.g. 16x16x16;
    # see jmsnas.supernet.candidate_impl)
    c.candidate_impl = "auto"
    c.tensorboard = True  # TensorBoard logs under WORKDIR/tensorboard (jmsnas.tensorboard); False: none
    return c


def mesh_config() -> ml_collections.ConfigDict:
    """Fig. 2(b): UE -> SBS -> three MBS in parallel -> cloud."""
    c = default_config()
    c.topology = "mesh"
    c.layers_per_device = (2, 2, 2, 2, 2, 2)
    c.space.device_channels = (24, 32, 48, 48, 48, 64)
    c.space.device_strides = (1, 2, 1, 1, 1, 2)
    return c


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A few steps of everything (tests, smoke runs)."""
    c.layers_per_device = tuple(1 for _ in c.layers_per_device)
    c.space.device_channels = tuple(8 for _ in c.space.device_channels)
    c.space.stem_channels = 8
    c.space.head_channels = 16
    c.max_train = 256
    c.search.warmup_epochs, c.search.epochs, c.search.batch_size = 1, 1, 32
    c.retrain.epochs = 1
    c.eval_batch_size = 64
    c.checkpoint_every = 3
    return c


def load_config(path: str | None, default=default_config):
    """A ConfigDict from ``path`` (a .py file with get_config(), optionally ``file.py:arg``) or ``default()``."""
    if path is None:
        return default()
    file, _, arg = path.partition(":")
    module = safeio.import_file(file, "config file", "jmsnas_user_config")
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {file!r} has no get_config()")
    args = (arg,) if arg else ()
    cfg = safeio.call_user(module.get_config, f"config file {file!r}: get_config()", *args)
    if not hasattr(cfg, "to_dict"):
        raise ValueError(f"config file {file!r}: get_config() returned {type(cfg).__name__}, expected a ConfigDict")
    return cfg


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


RUN_DEFAULTS = {"tensorboard": True}  # settings of the run layer (docs/runs.md) a config file need not name


def apply_overrides(cfg, overrides):
    """``--config.a.b=value`` pairs (value parsed as YAML) applied to cfg; unknown keys are errors."""
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise ValueError(f"unrecognised argument {safeio.short(item)}; overrides look like "
                             "--config.search.epochs=3")
        key, value = item[len("--config."):].split("=", 1)
        parent, name = cfg, key.split(".")[-1]
        if key in RUN_DEFAULTS and key not in cfg:  # a run-layer setting every training command takes
            with cfg.unlocked():
                cfg[key] = RUN_DEFAULTS[key]
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
