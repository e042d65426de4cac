"""Reference networks as layer specs (``jmsnas.graph.NetSpec``) for baselines, rooflines and split solvers.

Every network takes a 224x224x3 image and has 1000 classes. One LayerSpec is one convolution with its batch
norm and activation fused, a squeeze-and-excitation module ("se": pool, two 1x1 convolutions and the channel
scaling), a pooling, a fully connected layer or a residual "add" whose ``inputs`` are the two summed layers.

Counting conventions (the same as torchvision's documented figures, which the tests compare with):

* ``macs``: multiply-accumulates of convolutions and fully connected layers (SE's two 1x1 convolutions
  included); pooling, activations, additions and SE's channel scaling count as 0.
* ``params``: weights, biases where the reference model has them, and batch norm's scale and shift
  (2 per channel; running statistics are buffers, not parameters).

Layer choices follow torchvision's definitions (ResNet v1.5: stride in the 3x3 convolution of a bottleneck;
MNASNet-1.0 is torchvision's ``mnasnet1_0`` B1 variant without SE; MobileNetV1 follows Howard et al. 2017).
"""
from __future__ import annotations

import math

from jmsnas.graph import LayerSpec, NetSpec

INPUT_SHAPE = (224, 224, 3)
NUM_CLASSES = 1000


def _divisible(v: float, divisor: int = 8) -> int:
    """Rounds channels to a multiple of ``divisor`` without going below 90% (MobileNet's make_divisible)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class _Builder:
    """Appends layers in topological order, tracking each layer's output shape."""

    def __init__(self, name: str):
        self.name, self.layers = name, []

    def shape(self, i: int) -> tuple:
        return INPUT_SHAPE if i < 0 else self.layers[i].out_shape

    @property
    def last(self) -> int:
        return len(self.layers) - 1

    def _add(self, name, kind, macs, params, out_shape, inputs) -> int:
        ins = tuple(i for i in inputs if i >= 0)
        self.layers.append(LayerSpec(name, kind, int(macs), int(params), tuple(out_shape), ins))
        return self.last

    def conv(self, name: str, cout: int, k: int, stride: int = 1, groups: int = 1, *, src: int | None = None,
             bn: bool = True, bias: bool = False) -> int:
        """k x k convolution with padding k//2 (+ batch norm); ``groups == cin`` makes it depthwise."""
        src = self.last if src is None else src
        h, w, cin = self.shape(src)
        ho, wo = (h + 2 * (k // 2) - k) // stride + 1, (w + 2 * (k // 2) - k) // stride + 1
        per_out = cin // groups * k * k
        params = cout * per_out + (cout if bias else 0) + (2 * cout if bn else 0)
        kind = "dwconv" if groups == cin and groups > 1 else "conv"
        return self._add(name, kind, ho * wo * cout * per_out, params, (ho, wo, cout), (src,))

    def se(self, name: str, squeeze: int) -> int:
        """Squeeze-and-excitation: global pool, 1x1 conv C->squeeze and squeeze->C (with biases), scaling."""
        h, w, c = self.shape(self.last)
        return self._add(name, "se", 2 * c * squeeze, 2 * c * squeeze + squeeze + c, (h, w, c), (self.last,))

    def add(self, name: str, a: int, b: int) -> int:
        assert self.shape(a) == self.shape(b), (name, self.shape(a), self.shape(b))
        return self._add(name, "add", 0, 0, self.shape(a), (a, b))

    def maxpool(self, name: str, k: int = 3, stride: int = 2) -> int:
        h, w, c = self.shape(self.last)
        ho, wo = (h + 2 * (k // 2) - k) // stride + 1, (w + 2 * (k // 2) - k) // stride + 1
        return self._add(name, "pool", 0, 0, (ho, wo, c), (self.last,))

    def avgpool(self, name: str = "avgpool") -> int:
        return self._add(name, "pool", 0, 0, (self.shape(self.last)[-1],), (self.last,))

    def fc(self, name: str, cout: int) -> int:
        (cin,) = self.shape(self.last)
        return self._add(name, "fc", cin * cout, cin * cout + cout, (cout,), (self.last,))

    def net(self) -> NetSpec:
        spec = NetSpec(self.name, INPUT_SHAPE, tuple(self.layers))
        spec.validate()
        return spec


def _inverted_residual(b: _Builder, name: str, cout: int, k: int, stride: int, mid: int,
                       se_squeeze: int = 0) -> None:
    """MBConv: 1x1 expansion (skipped when mid == cin), k x k depthwise, optional SE, 1x1 projection, skip."""
    src = b.last
    cin = b.shape(src)[-1]
    if mid != cin:
        b.conv(f"{name}.expand", mid, 1)
    b.conv(f"{name}.dw", mid, k, stride, groups=mid)
    if se_squeeze:
        b.se(f"{name}.se", se_squeeze)
    b.conv(f"{name}.project", cout, 1)
    if stride == 1 and cin == cout:
        b.add(f"{name}.add", src, b.last)


def mobilenet_v1() -> NetSpec:
    """MobileNetV1 1.0-224 (Howard et al. 2017, Table 1): 3x3 stem, 13 depthwise-separable pairs, pool, FC."""
    b = _Builder("mobilenet_v1")
    b.conv("stem", 32, 3, 2)
    plan = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [(1024, 2), (1024, 1)]
    for i, (c, s) in enumerate(plan, 1):
        b.conv(f"block{i}.dw", b.shape(b.last)[-1], 3, s, groups=b.shape(b.last)[-1])
        b.conv(f"block{i}.pw", c, 1)
    b.avgpool()
    b.fc("fc", NUM_CLASSES)
    return b.net()


def mobilenet_v2() -> NetSpec:
    """MobileNetV2 1.0 (Sandler et al. 2018, Table 2; torchvision ``mobilenet_v2``)."""
    b = _Builder("mobilenet_v2")
    b.conv("stem", 32, 3, 2)
    n = 0
    for t, c, reps, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                          (6, 160, 3, 2), (6, 320, 1, 1)]:
        for r in range(reps):
            _inverted_residual(b, f"block{n}", c, 3, s if r == 0 else 1, b.shape(b.last)[-1] * t)
            n += 1
    b.conv("head", 1280, 1)
    b.avgpool()
    b.fc("fc", NUM_CLASSES)
    return b.net()


def mobilenet_v3_large() -> NetSpec:
    """MobileNetV3-Large 1.0 (Howard et al. 2019, Table 1; torchvision ``mobilenet_v3_large``).

    SE squeeze width = make_divisible(expanded / 4, 8); the head is 1x1 conv 160->960, pool, FC 960->1280
    (with bias, no BN), FC 1280->1000.
    """
    b = _Builder("mobilenet_v3_large")
    b.conv("stem", 16, 3, 2)
    # (kernel, expanded, out, SE, stride)
    plan = [(3, 16, 16, False, 1), (3, 64, 24, False, 2), (3, 72, 24, False, 1), (5, 72, 40, True, 2),
            (5, 120, 40, True, 1), (5, 120, 40, True, 1), (3, 240, 80, False, 2), (3, 200, 80, False, 1),
            (3, 184, 80, False, 1), (3, 184, 80, False, 1), (3, 480, 112, True, 1), (3, 672, 112, True, 1),
            (5, 672, 160, True, 2), (5, 960, 160, True, 1), (5, 960, 160, True, 1)]
    for i, (k, mid, c, se, s) in enumerate(plan):
        _inverted_residual(b, f"block{i}", c, k, s, mid, _divisible(mid / 4) if se else 0)
    b.conv("head", 960, 1)
    b.avgpool()
    b.fc("fc1", 1280)
    b.fc("fc", NUM_CLASSES)
    return b.net()


def mnasnet1_0() -> NetSpec:
    """MNASNet-1.0 as torchvision's ``mnasnet1_0`` (Tan et al. 2019, B1 variant: MBConv stacks without SE)."""
    b = _Builder("mnasnet1_0")
    b.conv("stem", 32, 3, 2)
    b.conv("sepconv.dw", 32, 3, 1, groups=32)
    b.conv("sepconv.pw", 16, 1)
    n = 0
    # (out, kernel, stride, expansion, repeats)
    for c, k, s, e, reps in [(24, 3, 2, 3, 3), (40, 5, 2, 3, 3), (80, 5, 2, 6, 3), (96, 3, 1, 6, 2),
                             (192, 5, 2, 6, 4), (320, 3, 1, 6, 1)]:
        for r in range(reps):
            _inverted_residual(b, f"block{n}", c, k, s if r == 0 else 1, b.shape(b.last)[-1] * e)
            n += 1
    b.conv("head", 1280, 1)
    b.avgpool()
    b.fc("fc", NUM_CLASSES)
    return b.net()


def efficientnet_b0() -> NetSpec:
    """EfficientNet-B0 (Tan & Le 2019, Table 1; torchvision ``efficientnet_b0``); SE squeeze = block input / 4."""
    b = _Builder("efficientnet_b0")
    b.conv("stem", 32, 3, 2)
    n = 0
    # (expansion, kernel, stride, out, repeats)
    for e, k, s, c, reps in [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                             (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]:
        for r in range(reps):
            cin = b.shape(b.last)[-1]
            _inverted_residual(b, f"block{n}", c, k, s if r == 0 else 1, cin * e, max(1, cin // 4))
            n += 1
    b.conv("head", 1280, 1)
    b.avgpool()
    b.fc("fc", NUM_CLASSES)
    return b.net()


def _resnet(name: str, bottleneck: bool, depths: tuple) -> NetSpec:
    """torchvision ResNet (v1.5): 7x7/2 stem, 3x3/2 max pool, 4 stages, pool, FC; 1x1 projection shortcuts."""
    b = _Builder(name)
    b.conv("stem", 64, 7, 2)
    b.maxpool("maxpool")
    for stage, (width, reps) in enumerate(zip((64, 128, 256, 512), depths), 1):
        for r in range(reps):
            stride = 2 if r == 0 and stage > 1 else 1
            src, p = b.last, f"layer{stage}.{r}"
            cout = width * 4 if bottleneck else width
            if bottleneck:
                b.conv(f"{p}.conv1", width, 1)
                b.conv(f"{p}.conv2", width, 3, stride)
                b.conv(f"{p}.conv3", cout, 1)
            else:
                b.conv(f"{p}.conv1", width, 3, stride)
                b.conv(f"{p}.conv2", width, 3)
            main = b.last
            skip = src
            if stride != 1 or b.shape(src)[-1] != cout:
                skip = b.conv(f"{p}.downsample", cout, 1, stride, src=src)
            b.add(f"{p}.add", skip, main)
    b.avgpool()
    b.fc("fc", NUM_CLASSES)
    return b.net()


def resnet18() -> NetSpec:
    return _resnet("resnet18", False, (2, 2, 2, 2))


def resnet50() -> NetSpec:
    return _resnet("resnet50", True, (3, 4, 6, 3))


def resnet152() -> NetSpec:
    return _resnet("resnet152", True, (3, 8, 36, 3))


_REGISTRY = {
    "mobilenet_v1": mobilenet_v1,
    "mobilenet_v2": mobilenet_v2,
    "mobilenet_v3_large": mobilenet_v3_large,
    "mnasnet1_0": mnasnet1_0,
    "efficientnet_b0": efficientnet_b0,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "resnet152": resnet152,
}
NAMES: tuple = tuple(_REGISTRY)


def get(name: str) -> NetSpec:
    """A zoo network by name; raises ValueError listing the known names for an unknown one."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown network {name!r}; expected one of {list(NAMES)}")
    return _REGISTRY[name]()


def summary(net: NetSpec) -> str:
    """One line: name, layers, GMACs, M params."""
    return (f"{net.name}: {len(net.layers)} layers, {net.total_macs / 1e9:.3f} GMACs, "
            f"{net.total_params / 1e6:.3f} M params, output {math.prod(net.layers[-1].out_shape)}")
