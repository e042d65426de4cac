"""experiments/configs/cifar_chain.py: the CIFAR-sized space and the paper's optimiser, CIFAR-10 and the stand-in."""
import importlib.util
from pathlib import Path

import pytest

from jmsnas import pipeline
from paths import REPO

CONFIG = Path(REPO) / "experiments" / "configs" / "cifar_chain.py"


def _module():
    spec = importlib.util.spec_from_file_location("cifar_chain", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cifar_chain_config():
    m = _module()
    c = m.get_config()
    assert c.dataset == "cifar10" and c.search.batch_size == 512
    assert (c.search.warmup_epochs, c.search.epochs, c.retrain.epochs) == (20, 60, 200)
    assert c.search.weight_lr == c.search.arch_lr == 0.002 and c.topology == "chain"
    assert sum(c.layers_per_device) >= 20 and len(c.layers_per_device) == 4
    t_min, t_max = m.reachable_range(3)
    assert t_min < c.t_const_ms < t_max
    pipeline.validate_config(c)
    s = m.get_config("standin")  # the embedded digits at 32x32: the same space but the stem's input channels
    pipeline.validate_config(s)
    space, _ = pipeline.build(s, pipeline.load_data(s))
    assert space.num_layers == 20 and space.image_size == 32 and space.in_channels == 1
    assert m.reachable_range(1)[0] < s.t_const_ms < m.reachable_range(1)[1]
    with pytest.raises(ValueError, match="cifar_chain config argument must be one of"):
        m.get_config("cifar100")
