"""Peak memory of a device's part of a network, against hand computations."""
import pytest

from jmsnas.cost.memory import memory_report, peak_memory_bytes
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.split import zoo


def _dag(with_skip=True):
    """input 4x4x3 (48) -> a 4x4x2 (32) -> b 4x4x4 (64) -> c 4x4x2 (32) -> d = a + c (32) -> e (10).

    Parameters: a 10, b 20, c 30, d 0, e 100.
    """
    layers = (LayerSpec("a", "conv", 0, 10, (4, 4, 2), ()),
              LayerSpec("b", "conv", 0, 20, (4, 4, 4), (0,)),
              LayerSpec("c", "conv", 0, 30, (4, 4, 2), (1,)),
              LayerSpec("d", "add" if with_skip else "act", 0, 0, (4, 4, 2), (0, 2) if with_skip else (2,)),
              LayerSpec("e", "fc", 0, 100, (10,), (3,)))
    return NetSpec("dag", (4, 4, 3), layers)


def test_whole_dag_by_hand():
    # alive while each layer runs (elements):
    #   a: input 48 + a 32            = 80
    #   b: a 32 (kept for d) + b 64   = 96
    #   c: a 32 + b 64 + c 32         = 128   <- peak: the skip keeps a alive
    #   d: a 32 + c 32 + d 32         = 96
    #   e: d 32 + e 10                = 42
    # fp32: 128 * 4 = 512 bytes of activations + (10 + 20 + 30 + 100) * 4 = 640 bytes of weights
    r = memory_report(_dag(), range(5))
    assert (r.activation_bytes, r.weight_bytes, r.peak_layer, r.live) == (512, 640, 2, (0, 1, 2))
    assert peak_memory_bytes(_dag(), [0, 1, 2, 3, 4]) == 1152


def test_without_the_skip_the_peak_drops():
    # chain: a 80 (input + a), b 96, c 96 (b + c), d 64, e 42 -> peak 96 elements = 384 bytes
    assert memory_report(_dag(with_skip=False), range(5)).activation_bytes == 384


def test_parts_received_and_sent_tensors_and_bit_widths():
    net = _dag()
    # device holding {c, d}: receives b (64) for c and a (32) for d; d goes to e on another device
    #   c: b 64 + a 32 + c 32 = 128;  d: a 32 + c 32 + d 32 = 96  -> 128 elements
    # 8-bit activations -> 128 bytes; 8-bit weights: c's 30 params -> 30 bytes
    r = memory_report(net, [3, 2], weight_bits=8, act_bits=8)
    assert (r.activation_bytes, r.weight_bytes, r.live) == (128, 30, (0, 1, 2))
    # device holding {a, b}: a is needed by d elsewhere, so it stays until the part ends
    #   a: input 48 + a 32 = 80;  b: a 32 + b 64 = 96 -> 96 elements at 8 bits = 96 bytes
    # 4-bit weights, packed per layer: ceil(10 * 4 / 8) + ceil(20 * 4 / 8) = 5 + 10
    r = memory_report(net, [0, 1], weight_bits=4, act_bits=8)
    assert (r.activation_bytes, r.weight_bytes, r.peak_layer) == (96, 15, 1)
    # 3-bit activations are packed: ceil(48*3/8) + ceil(32*3/8) = 18 + 12 = 30 at a; 12 + 24 = 36 at b
    assert memory_report(net, [0, 1], act_bits=3).activation_bytes == 36
    # only the classifier: receives d (32) and produces e (10)
    assert memory_report(net, [4], 32, 32).total_bytes == (32 + 10) * 4 + 100 * 4


def test_chain_matches_auto_split_chain_formula():
    """For a chain, Auto-Split's M_a = max_i (input_i + output_i); MobileNetV1 is a chain."""
    net = zoo.get("mobilenet_v1")
    sizes = [net.input_elems] + [l.out_elems for l in net.layers]
    expected = max(a + b for a, b in zip(sizes, sizes[1:]))
    assert memory_report(net, range(len(net.layers)), 8, 8).activation_bytes == expected


def test_empty_part_and_bad_input():
    assert memory_report(_dag(), []).total_bytes == 0
    with pytest.raises(ValueError, match=r"layer indices \[7\]"):
        peak_memory_bytes(_dag(), [0, 7])
    with pytest.raises(ValueError, match=r"listed more than once"):
        peak_memory_bytes(_dag(), [1, 1])
    with pytest.raises(ValueError, match="act_bits must be an integer"):
        peak_memory_bytes(_dag(), [0], act_bits=0)
