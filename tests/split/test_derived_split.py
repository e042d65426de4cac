"""``jmsnas split --model RUN_DIR/result.json``: the derived network of a search as a layer graph (split.derived)."""
import numpy as np
import pytest
import jax

from jmsnas import supernet
from jmsnas.topology import presets
from jmsnas.space import IDENTITY, OPS, build_space, op_flops, op_params
from jmsnas.split import derived


def _space(topo):
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8,) * topo.num_devices,
                       device_strides=(1, 2) + (1,) * (topo.num_devices - 2), stem_channels=8, head_channels=16)


def _random_ops(space, seed):
    rng = np.random.default_rng(seed)
    return [int(rng.choice(np.flatnonzero(m))) for m in space.mask()]


@pytest.mark.parametrize("topo", [presets.chain_preset((1, 2, 1, 1)), presets.mesh_preset((1, 1, 1, 1, 1, 1))],
                         ids=["chain", "mesh"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_derived_net_counts_match_the_space_and_the_compact_network(topo, seed):
    space = _space(topo)
    ops = _random_ops(space, seed)
    net = derived.net_from_space(space, ops)
    stem = 9 * 1 * 8 * 8 * 8  # k = 3, 1 -> 8 channels at 8x8
    hw, c = space.head_in
    head = hw * hw * c * 16 + 16 * 10
    assert net.total_macs == stem + head + sum(op_flops(OPS[i], s) / 2 for s, i in zip(space.layers, ops))
    layer_params = sum(op_params(OPS[i], s) for s, i in zip(space.layers, ops))
    assert net.total_params == 9 * 8 + 2 * 8 + layer_params + c * 16 + 2 * 16 + 16 * 10 + 10
    # the same count as the compact network jmsnas trains (weights and batch-norm scale/shift)
    params, state = supernet.init(jax.random.PRNGKey(0), space)
    compact, _ = supernet.extract(space, params, state, ops)
    assert supernet.count_params(compact) == net.total_params
    assert net.layers[-1].out_shape == (10,) and net.input_shape == (8, 8, 1)


def test_identities_vanish_and_the_mesh_merge_reads_every_branch():
    topo = presets.mesh_preset((1, 1, 1, 1, 1, 1))
    space = _space(topo)
    ops = [IDENTITY if m[IDENTITY] else int(np.flatnonzero(m)[0]) for m in space.mask()]
    net = derived.net_from_space(space, ops)
    merge = [l for l in net.layers if l.kind == "mean"]
    assert len(merge) == 1 and len(merge[0].inputs) == 3
    n_conv = sum(OPS[i].kernel > 0 for i in ops)
    assert len(net.layers) == 1 + 3 * n_conv + sum(OPS[i].residual for i in ops) + 1 + 3


def test_bad_result_files(tmp_path):
    p = tmp_path / "result.json"
    p.write_text('{"topology": "chain"}')
    with pytest.raises(ValueError, match="not a search result"):
        derived.load_result(str(p))
