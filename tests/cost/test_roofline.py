"""Roofline latency: hand-computed layers, DAG input traffic, presets, and SplitNets' published latencies."""
import numpy as np
import pytest

from jmsnas.cost import roofline
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.topology import presets
from jmsnas.topology.presets import DEVICES
from jmsnas.split import zoo
from jmsnas.topology import DeviceProfile, transfer_ms

DEV = DeviceProfile("toy", peak_gflops=100.0, memory_bytes=1e9, mem_bandwidth_gbs=10.0, efficiency=0.5,
                    layer_overhead_ms=0.01)


def test_compute_bound_layer_by_hand():
    layer = LayerSpec("conv", "conv", macs=1_000_000, params=1000, out_shape=(10, 10, 10))
    # compute: 2e6 FLOP / (100e9 * 0.5 FLOP/s) = 4e-5 s = 0.04 ms
    # memory: (2000 in + 1000 out + 1000 weights) * 4 B = 16000 B / 10e9 B/s = 1.6e-6 s = 0.0016 ms
    assert roofline.layer_latency_ms(layer, DEV, 32, in_elems=2000) == pytest.approx(0.04 + 0.01)


def test_memory_bound_layer_by_hand_and_bit_widths():
    layer = LayerSpec("add", "add", macs=1000, params=1000, out_shape=(10, 10, 10))
    # compute 2e3 / 5e10 = 4e-8 s = 4e-5 ms < memory 16000 B / 1e10 = 1.6e-3 ms
    assert roofline.layer_latency_ms(layer, DEV, 32, in_elems=2000) == pytest.approx(0.0016 + 0.01)
    # 8-bit everything: 4000 B -> 4e-4 ms; 8-bit activations, 32-bit weights: 3000 + 4000 B -> 7e-4 ms
    assert roofline.layer_latency_ms(layer, DEV, 8, in_elems=2000) == pytest.approx(0.0004 + 0.01)
    assert roofline.layer_latency_ms(layer, DEV, 8, in_elems=2000, weight_bits=32) == pytest.approx(0.0007 + 0.01)


def test_net_table_counts_every_producer():
    net = NetSpec("dag", (4, 4, 3), (
        LayerSpec("a", "conv", 0, 0, (4, 4, 2), ()),        # reads the input: 48
        LayerSpec("b", "conv", 0, 0, (4, 4, 2), (0,)),      # reads a: 32
        LayerSpec("c", "add", 0, 0, (4, 4, 2), (0, 1)),     # reads a and b: 64
    ))
    assert roofline.layer_input_elems(net) == [48, 32, 64]
    devs = [DEV, DEV._replace(name="fast", mem_bandwidth_gbs=20.0, layer_overhead_ms=0.0)]
    table = roofline.net_latency_table(net, devs, bits=8)
    # no MACs: every layer is memory-bound, (in + out) bytes / bandwidth
    expected = np.array([[(48 + 32) / 10e6 + 0.01, (48 + 32) / 20e6],
                         [(32 + 32) / 10e6 + 0.01, (32 + 32) / 20e6],
                         [(64 + 32) / 10e6 + 0.01, (64 + 32) / 20e6]])
    assert table.shape == (3, 2)
    np.testing.assert_allclose(table, expected, rtol=1e-12)


def test_presets():
    assert presets.device("raspberry_pi4") is DEVICES["raspberry_pi4"]
    for name in ("splitnets_sensor", "splitnets_aggregator", "eyeriss", "tpu"):
        d = presets.device(name)
        assert d.name == name and d.note
    assert presets.device("splitnets_sensor").memory_bytes == 2 * 1024 ** 2
    assert presets.device("eyeriss").mem_bandwidth_gbs == 1.0 and presets.device("tpu").mem_bandwidth_gbs == 13.0
    with pytest.raises(ValueError, match="unknown device preset 'gpu'"):
        roofline.layer_latency_ms(zoo.get("resnet18").layers[0], "gpu")
    table = roofline.net_latency_table(zoo.get("resnet18"), list(DEVICES))  # devices by preset name
    assert table.shape == (len(zoo.get("resnet18").layers), len(DEVICES)) and np.all(table > 0)


# SplitNets (paper 000) Table 4, weights and activations at 8 bits: all-on-sensor latency and the
# on-aggregator latency of all-on-aggregator, in ms.
SPLITNETS_TABLE4 = {
    "mobilenet_v2": (2.46, 0.24),
    "mnasnet1_0": (2.52, 0.25),
    "efficientnet_b0": (3.09, 0.31),
    "resnet152": (92.1, 9.21),
}


@pytest.mark.parametrize("name", sorted(SPLITNETS_TABLE4))
def test_splitnets_presets_reproduce_table4(name):
    sen, agg = SPLITNETS_TABLE4[name]
    table = roofline.net_latency_table(zoo.get(name), ["splitnets_sensor", "splitnets_aggregator"], bits=8)
    assert table[:, 0].sum() == pytest.approx(sen, rel=0.03)
    assert table[:, 1].sum() == pytest.approx(agg, rel=0.05)  # Table 4 rounds these to 2 digits


def test_splitnets_bus_share_matches_table4_raw_image_transfer():
    # 4 sensors at 25% of 1.2 Gb/s = 300 Mbit/s = 37.5 MB/s; a raw 3x224x224 8-bit image takes 4.01 ms (Table 4)
    assert presets.splitnets_sensor_link_mbps(4) == 300.0
    assert transfer_ms(3 * 224 * 224, presets.splitnets_sensor_link_mbps(4)) == pytest.approx(4.01, abs=0.005)


def test_bad_inputs():
    layer = LayerSpec("x", "conv", 10, 10, (1,))
    with pytest.raises(ValueError, match="bits must be an integer"):
        roofline.layer_latency_ms(layer, DEV, bits=0)
    with pytest.raises(ValueError, match="efficiency must be a finite number > 0"):
        roofline.layer_latency_ms(layer, DEV._replace(efficiency=0.0))
    with pytest.raises(ValueError, match="efficiency must be in"):
        roofline.layer_latency_ms(layer, DEV._replace(efficiency=1.5))
    with pytest.raises(ValueError, match="at least one device"):
        roofline.net_latency_table(zoo.get("resnet18"), [])
