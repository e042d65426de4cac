"""Model zoo as layer specs: totals against published counts, graph structure, hand-computed layers."""
import pytest

from jmsnas.split import zoo

# name: (published MACs, source, published params, source). torchvision's model pages list "num_params" and
# "GFLOPS" (the latter counts multiply-adds of convolutions and linear layers); their params include batch
# norm's scale and shift, which zoo.py counts too.
PUBLISHED = {
    "mobilenet_v1": (569e6, "Howard et al. 2017 (MobileNets), Table 8: 569 M mult-adds",
                     4.2e6, "same table: 4.2 M parameters"),
    "mobilenet_v2": (301e6, "SplitNets (paper 000) Table 4: 301 M OPs (multiply-adds)",
                     3_504_872, "torchvision mobilenet_v2 num_params"),
    "mobilenet_v3_large": (219e6, "Howard et al. 2019 (MobileNetV3), Table 3: 219 M MAdds",
                           5_483_032, "torchvision mobilenet_v3_large num_params"),
    "mnasnet1_0": (314e6, "SplitNets (paper 000) Table 4: 314 M OPs (torchvision: 0.31 GFLOPS)",
                   4_383_312, "torchvision mnasnet1_0 num_params"),
    "efficientnet_b0": (386e6, "SplitNets (paper 000) Table 4: 386 M OPs (Tan & Le 2019: 0.39 B FLOPs)",
                        5_288_548, "torchvision efficientnet_b0 num_params"),
    "resnet18": (1.81e9, "torchvision resnet18: 1.81 GFLOPS", 11_689_512, "torchvision resnet18 num_params"),
    "resnet50": (4.09e9, "torchvision resnet50: 4.09 GFLOPS", 25_557_032, "torchvision resnet50 num_params"),
    "resnet152": (11.51e9, "torchvision resnet152: 11.51 GFLOPS", 60_192_808, "torchvision resnet152 num_params"),
}


def test_registry_names():
    assert set(zoo.NAMES) == set(PUBLISHED)
    with pytest.raises(ValueError, match="unknown network 'vgg16'.*resnet50"):
        zoo.get("vgg16")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_totals_within_2_percent_of_published(name):
    macs, macs_src, params, params_src = PUBLISHED[name]
    net = zoo.get(name)
    assert abs(net.total_macs / macs - 1) <= 0.02, (name, net.total_macs, macs_src)
    assert abs(net.total_params / params - 1) <= 0.02, (name, net.total_params, params_src)


# name: (residual adds, projection shortcuts) counted from the architectures' definitions
STRUCTURE = {
    "mobilenet_v1": (0, 0),
    "mobilenet_v2": (10, 0),  # stride-1 same-width repeats: 1 + 2 + 3 + 2 + 2
    "mobilenet_v3_large": (10, 0),  # blocks 0, 2, 4, 5, 7, 8, 9, 11, 13, 14
    "mnasnet1_0": (10, 0),  # repeats beyond the first in each stack: 2 + 2 + 2 + 1 + 3
    "efficientnet_b0": (9, 0),  # 1 + 1 + 2 + 2 + 3
    "resnet18": (8, 3),
    "resnet50": (16, 4),
    "resnet152": (50, 4),
}


@pytest.mark.parametrize("name", sorted(STRUCTURE))
def test_graph_structure(name):
    net = zoo.get(name)
    net.validate()
    assert net.input_shape == (224, 224, 3) and net.layers[-1].out_shape == (1000,)
    adds = [l for l in net.layers if l.kind == "add"]
    assert (len(adds), sum(".downsample" in l.name for l in net.layers)) == STRUCTURE[name]
    for l in adds:
        i = net.layers.index(l)
        a, b = (net.layers[j] for j in l.inputs)
        assert a.out_shape == b.out_shape == l.out_shape and len(set(l.inputs)) == 2 and max(l.inputs) == i - 1
        # the skip (through its projection, if any) starts at the block input, 2 or more layers back
        starts = [net.layers[j].inputs[0] if ".downsample" in net.layers[j].name else j for j in l.inputs]
        assert min(starts) <= i - 3
    for i, l in enumerate(net.layers):
        assert l.kind == "add" or len(l.inputs) <= 1
        assert l.inputs or i == 0
        assert l.macs >= 0 and l.params >= 0


def test_hand_computed_layers():
    v2 = zoo.get("mobilenet_v2").layers
    stem = v2[0]  # 3x3/2 conv 3->32 at 224 -> 112x112x32, 27 MACs per output, BN 2*32
    assert (stem.out_shape, stem.macs, stem.params) == ((112, 112, 32), 112 * 112 * 32 * 27, 32 * 27 + 64)
    dw = v2[1]  # block0 has expansion 1: its first layer is the 3x3 depthwise conv on 32 channels
    assert (dw.name, dw.kind, dw.macs, dw.params) == ("block0.dw", "dwconv", 112 * 112 * 32 * 9, 32 * 9 + 64)
    r50 = {l.name: l for l in zoo.get("resnet50").layers}
    assert r50["stem"].macs == 112 * 112 * 64 * 7 * 7 * 3
    assert r50["maxpool"].out_shape == (56, 56, 64)
    assert r50["layer2.0.conv2"].out_shape == (28, 28, 128)  # v1.5: stride in the 3x3 conv
    assert r50["layer2.0.downsample"].macs == 28 * 28 * 512 * 256
    assert r50["fc"].params == 2048 * 1000 + 1000
    se = {l.name: l for l in zoo.get("efficientnet_b0").layers}["block1.se"]  # 96 channels, squeeze 16 // 4 = 4
    assert (se.macs, se.params) == (2 * 96 * 4, 2 * 96 * 4 + 4 + 96)
