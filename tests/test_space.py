"""The search space built from a topology: slots, shapes, masks, mesh wiring, analytic cost (issue 2, item 3)."""
import itertools
import re

import numpy as np
import pytest

from jmsnas.topology import presets
from jmsnas.cost.tables import analytic_table
from jmsnas.space import (IDENTITY, NUM_OPS, OP_NAMES, OPS, build_space, op_flops, op_index, op_params)
from jmsnas.topology import TopologyError

RES_OR_ID = [i for i, o in enumerate(OPS) if o.is_identity or o.residual]
PLAIN = [i for i, o in enumerate(OPS) if not (o.is_identity or o.residual)]


def chain_space(**kw):
    """ue (2 layers, 4->8 ch) -> sbs (2, stride 2) -> mbs (1, 8->12 ch) -> cloud (3)."""
    topo = presets.topology("chain", [2, 2, 1, 3])
    args = dict(image_size=8, in_channels=3, num_classes=5, device_channels=[8, 8, 12, 12],
                device_strides=[1, 2, 1, 2], stem_channels=4, head_channels=8)
    args.update(kw)
    return build_space(topo, **args)


def mesh_space(lpd=(1, 2, 1, 1, 1, 2)):
    """Fig. 2(b): ue -> sbs (root) -> mbs1..3 in parallel -> cloud (aggregator)."""
    return build_space(presets.topology("mesh", lpd), image_size=8, in_channels=3, num_classes=5,
                       device_channels=[4, 8, 12, 12, 12, 12], device_strides=[1, 2, 2, 2, 2, 1],
                       stem_channels=4, head_channels=8)


def test_thirteen_candidates_of_section_iv_a():
    assert NUM_OPS == 13 and len(set(OP_NAMES)) == 13
    assert OPS[IDENTITY].is_identity and sum(o.is_identity for o in OPS) == 1
    convs = {(o.kernel, o.expand, o.residual) for o in OPS if not o.is_identity}
    assert convs == set(itertools.product((3, 5, 7), (3, 6), (False, True)))
    assert op_index("mbconv_k5_e6_res") == OP_NAMES.index("mbconv_k5_e6_res")
    with pytest.raises(ValueError, match=re.escape("unknown op 'mbconv_k9_e3'")):
        op_index("mbconv_k9_e3")


@pytest.mark.parametrize("make", [chain_space, mesh_space])
def test_mask_thirteen_on_shape_keeping_slots_six_elsewhere(make):
    sp = make()
    mask = sp.mask()
    assert mask.shape == (sp.num_layers, NUM_OPS) and mask.dtype == bool
    kinds = set()
    for s in sp.layers:
        keeps = s.in_ch == s.out_ch and s.in_hw == s.out_hw and s.stride == 1
        assert s.keeps_shape == keeps
        kinds.add(keeps)
        if keeps:
            assert mask[s.index].all()
        else:
            # identity and every shortcut variant are masked; the 6 plain MBConvs remain
            assert mask[s.index].sum() == 6
            assert np.flatnonzero(mask[s.index]).tolist() == PLAIN
            assert not mask[s.index, RES_OR_ID].any()
    assert kinds == {True, False}


def test_stride_only_and_channel_only_changes_both_mask_shortcuts():
    sp = chain_space()
    by_kind = {}
    for s in sp.layers:
        if s.stride == 2 and s.in_ch == s.out_ch:
            by_kind["stride"] = s
        if s.stride == 1 and s.in_ch != s.out_ch:
            by_kind["channels"] = s
    assert set(by_kind) == {"stride", "channels"}
    for s in by_kind.values():
        assert sp.mask()[s.index].sum() == 6


def test_chain_slots_follow_device_schedule():
    sp = chain_space()
    topo = sp.topology
    assert sp.num_layers == sum(topo.layers_per_device) == 8
    assert [s.device for s in sp.layers] == [0, 0, 1, 1, 2, 3, 3, 3]
    assert sp.layer_devices().tolist() == [0, 0, 1, 1, 2, 3, 3, 3]
    assert sp.layers_of(1) == (2, 3)
    # stem: 3 -> 4 channels at 8x8 (stride 1); each device's first layer applies its channels and stride
    expect = [(4, 8, 8, 8, 1), (8, 8, 8, 8, 1), (8, 8, 8, 4, 2), (8, 8, 4, 4, 1), (8, 12, 4, 4, 1),
              (12, 12, 4, 2, 2), (12, 12, 2, 2, 1), (12, 12, 2, 2, 1)]
    assert [(s.in_ch, s.out_ch, s.in_hw, s.out_hw, s.stride) for s in sp.layers] == expect
    for n in range(sp.num_layers):
        assert sp.input_of(n) == (n - 1,)
    assert sp.head_in == (2, 12) and sp.stem_out_hw == 8
    assert sp.layers[5].out_elems == 2 * 2 * 12


def test_stem_stride_and_odd_sizes_use_same_padding():
    sp = chain_space(image_size=7, stem_stride=2)
    assert sp.stem_out_hw == 4  # ceil(7 / 2)
    assert [s.out_hw for s in sp.layers] == [4, 4, 2, 2, 2, 1, 1, 1]


def test_mesh_branches_read_root_and_aggregator_reads_every_branch():
    sp = mesh_space()
    # ue: L0; sbs (root): L1, L2; mbs1..3: L3, L4, L5; cloud (aggregator): L6, L7
    assert [s.device for s in sp.layers] == [0, 1, 1, 2, 3, 4, 5, 5]
    assert [s.branch for s in sp.layers] == [-1, -1, -1, 0, 1, 2, -1, -1]
    inputs = [sp.input_of(n) for n in range(sp.num_layers)]
    assert inputs == [(-1,), (0,), (1,), (2,), (2,), (2,), (3, 4, 5), (6,)]
    # every branch starts from the root's output shape; the aggregator's input is a branch output (a mean
    # keeps the shape)
    root_last = sp.layers[2]
    for n in (3, 4, 5):
        s = sp.layers[n]
        assert (s.in_ch, s.in_hw) == (root_last.out_ch, root_last.out_hw)
    agg = sp.layers[6]
    assert (agg.in_ch, agg.in_hw) == (sp.layers[3].out_ch, sp.layers[3].out_hw)


def test_mesh_with_longer_branches_wires_inside_branch_sequentially():
    sp = mesh_space(lpd=(1, 1, 2, 2, 2, 1))
    # ue L0; root L1; mbs1 L2, L3; mbs2 L4, L5; mbs3 L6, L7; cloud L8
    assert [sp.input_of(n) for n in range(9)] == [(-1,), (0,), (1,), (2,), (1,), (4,), (1,), (6,), (3, 5, 7)]


def test_validate_arch_rejects_bad_arch_naming_value():
    sp = chain_space()
    ok = [0] * sp.num_layers
    sp.validate_arch(ok)
    with pytest.raises(ValueError, match=re.escape("architecture has shape (7,), expected (8,)")):
        sp.validate_arch(ok[:-1])
    with pytest.raises(ValueError, match=re.escape("architecture has shape (2, 8)")):
        sp.validate_arch([ok, ok])
    bad = list(ok)
    bad[2] = IDENTITY  # layer 2 has stride 2: identity is masked
    with pytest.raises(ValueError, match=rf"layer 2: op index {IDENTITY} is not a valid candidate"):
        sp.validate_arch(bad)
    bad[2] = op_index("mbconv_k3_e3_res")
    with pytest.raises(ValueError, match=rf"layer 2: op index {bad[2]} is not a valid candidate"):
        sp.validate_arch(bad)
    for v in (13, -1):
        bad = list(ok)
        bad[1] = v
        with pytest.raises(ValueError, match=rf"layer 1: op index {v} is not a valid candidate"):
            sp.validate_arch(bad)


def test_build_space_rejects_bad_schedules():
    topo = presets.topology("chain")
    base = dict(image_size=8, in_channels=3, num_classes=5, device_channels=[8, 8, 8, 8],
                device_strides=[1, 1, 1, 1])
    cases = [
        (dict(device_channels=[8, 8, 8]), TopologyError, "device_channels has 3 entries [8, 8, 8], expected one per device"),
        (dict(device_strides=[1, 1]), TopologyError, "device_strides has 2 entries"),
        (dict(device_strides=[1, 3, 1, 1]), ValueError, "device_strides for 'sbs' must be 1 or 2, got 3"),
        (dict(device_channels=[8, 0, 8, 8]), ValueError, "device_channels for 'sbs' must be a positive integer, got 0"),
        (dict(image_size=0), ValueError, "image_size must be a positive integer, got 0"),
        (dict(num_classes=2.5), ValueError, "num_classes must be a positive integer, got 2.5"),
        (dict(stem_stride=4), ValueError, "stem_stride must be 1 or 2, got 4"),
    ]
    for over, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            build_space(topo, **{**base, **over})
    with pytest.raises(ValueError, match="mesh branches .*must share channels and stride"):
        build_space(presets.topology("mesh"), image_size=8, in_channels=3, num_classes=5,
                    device_channels=[4, 4, 8, 12, 8, 8], device_strides=[1] * 6)


def test_space_is_hashable_for_jit():
    assert hash(chain_space()) == hash(chain_space())
    assert chain_space() == chain_space() and chain_space() != chain_space(image_size=16)


def test_op_flops_and_params_by_hand():
    sp = chain_space()
    s = sp.layers[2]  # 8 -> 8 channels, 8x8 -> 4x4, stride 2
    op = OPS[op_index("mbconv_k5_e3")]
    mid = 24
    assert op_flops(op, s) == 2 * (8 * 8 * 8 * mid + 4 * 4 * mid * 25 + 4 * 4 * mid * 8)
    assert op_params(op, s) == 8 * mid + 25 * mid + mid * 8 + 2 * (mid + mid + 8)
    assert op_flops(OPS[IDENTITY], s) == 0 and op_params(OPS[IDENTITY], s) == 0


@pytest.mark.parametrize("make", [chain_space, mesh_space])
def test_analytic_table_zero_for_identity_and_increasing_in_kernel_and_expansion(make):
    sp = make()
    u = np.asarray(analytic_table(sp).compute_ms)
    mask = sp.mask()
    assert u.shape == (sp.topology.num_devices, sp.num_layers, NUM_OPS)
    assert np.all(u[:, :, IDENTITY] == 0)
    assert np.all(u[:, ~mask] == 0)  # masked candidates cost nothing
    assert np.all(u[:, mask & (np.arange(NUM_OPS) != IDENTITY)] > 0)
    for res in ("", "_res"):
        for e in (3, 6):
            k3, k5, k7 = (op_index(f"mbconv_k{k}_e{e}{res}") for k in (3, 5, 7))
            rows = mask[:, k3]
            assert np.all(u[:, rows, k3] < u[:, rows, k5]) and np.all(u[:, rows, k5] < u[:, rows, k7])
        for k in (3, 5, 7):
            e3, e6 = op_index(f"mbconv_k{k}_e3{res}"), op_index(f"mbconv_k{k}_e6{res}")
            rows = mask[:, e3]
            assert np.all(u[:, rows, e3] < u[:, rows, e6])
    # the same op is slower on the Pi (UE) than on the V100 server (cloud)
    ue, cloud = 0, sp.topology.num_devices - 1
    assert np.all(u[ue][mask & (np.arange(NUM_OPS) != IDENTITY)] > u[cloud][mask & (np.arange(NUM_OPS) != IDENTITY)])


def test_scaling_benchmark_counts_the_work_each_step_computes():
    """bench_scaling.work on the 8- and 16-layer chains: valid candidates by hand (a device's first layer changes
    the shape, so it has no shortcut candidates: 6; the others 13) and the FLOPs as the sum of op_flops."""
    import importlib.util
    import os
    from jmsnas.space import OPS, op_flops
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_scaling.py")
    spec = importlib.util.spec_from_file_location("bench_scaling", path)
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    w8, w16 = (B.work(B.space_of(B.chain(4, k))) for k in (2, 4))
    assert w8["valid_candidates"] == 4 * (6 + 13) and w16["valid_candidates"] == 4 * (6 + 3 * 13)
    space = B.space_of(B.chain(4, 2))
    mask = space.mask()
    first = space.layers[0]
    by_hand = [op_flops(OPS[i], first) for i in range(len(OPS)) if mask[0, i]]
    assert len(by_hand) == 6 and w8["all_candidates_mflop"] > sum(by_hand) / 1e6
    assert w8["mean_path_mflop"] < w8["all_candidates_mflop"] / 6
    # the added layers keep their shape: more candidates per layer, so the Gumbel step's work grows faster
    assert w16["all_candidates_mflop"] / w8["all_candidates_mflop"] > 2.0


def test_to_dict_from_dict_is_the_one_serialisation():
    import json
    from jmsnas.space import from_dict, to_dict
    for sp in (mesh_space((1, 2, 1, 1, 1, 2)),
               build_space(presets.topology("chain", [2, 2, 1, 3]), image_size=8, in_channels=3, num_classes=5,
                           device_channels=(8, 16, 16, 24), device_strides=(1, 2, 1, 2), stem_channels=4,
                           stem_stride=2, head_channels=32)):
        d = json.loads(json.dumps(to_dict(sp)))  # plain JSON data
        assert from_dict(d) == sp and d["topology"]["name"] == sp.topology.name
    d = to_dict(mesh_space((1,) * 6))
    with pytest.raises(ValueError, match=r"the recorded space: lacks \['device_strides'\]"):
        from_dict({k: v for k, v in d.items() if k != "device_strides"})
    with pytest.raises(ValueError, match="the recorded space: device_strides for 'ue' must be 1 or 2, got 3"):
        from_dict(dict(d, device_strides=[3] + d["device_strides"][1:]))
    with pytest.raises(ValueError, match="must be a mapping"):
        from_dict(None)
