"""torchvision's ResNet-18/50 and MobileNetV2 written in flax linen (NHWC), for the traced-graph oracle tests.

Same layers, padding, strides, biases and batch norms as torchvision's definitions (ResNet v1.5: the stride in the
3x3 convolution of a bottleneck; 1x1 projection shortcuts with batch norm; MobileNetV2 1.0 without expansion in
its first block). Batch norm runs on its running statistics (inference).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _conv(c, k, s=1, groups=1, name=None, bias=False):
    return nn.Conv(c, (k, k), (s, s), padding=[(k // 2, k // 2)] * 2, feature_group_count=groups, use_bias=bias,
                   name=name)


def _bn(name):
    return nn.BatchNorm(use_running_average=True, momentum=0.9, epsilon=1e-5, name=name)


class BasicBlock(nn.Module):
    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(_bn("bn1")(_conv(self.width, 3, self.stride, name="conv1")(x)))
        h = _bn("bn2")(_conv(self.width, 3, name="conv2")(h))
        if self.stride != 1 or x.shape[-1] != self.width:
            x = _bn("downsample_bn")(_conv(self.width, 1, self.stride, name="downsample")(x))
        return nn.relu(x + h)


class Bottleneck(nn.Module):
    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(_bn("bn1")(_conv(self.width, 1, name="conv1")(x)))
        h = nn.relu(_bn("bn2")(_conv(self.width, 3, self.stride, name="conv2")(h)))
        h = _bn("bn3")(_conv(self.width * 4, 1, name="conv3")(h))
        if self.stride != 1 or x.shape[-1] != self.width * 4:
            x = _bn("downsample_bn")(_conv(self.width * 4, 1, self.stride, name="downsample")(x))
        return nn.relu(x + h)


class ResNet(nn.Module):
    depths: tuple
    bottleneck: bool
    num_classes: int = 1000

    @nn.compact
    def __call__(self, x):
        x = nn.relu(_bn("bn1")(_conv(64, 7, 2, name="stem")(x)))
        x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        block = Bottleneck if self.bottleneck else BasicBlock
        for stage, (width, reps) in enumerate(zip((64, 128, 256, 512), self.depths), 1):
            for r in range(reps):
                x = block(width, 2 if r == 0 and stage > 1 else 1, name=f"layer{stage}_{r}")(x)
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


class InvertedResidual(nn.Module):
    out: int
    stride: int
    expand: int

    @nn.compact
    def __call__(self, x):
        cin = x.shape[-1]
        mid = cin * self.expand
        h = x
        if self.expand != 1:
            h = jax.nn.relu6(_bn("bn0")(_conv(mid, 1, name="expand")(h)))
        h = jax.nn.relu6(_bn("bn1")(_conv(mid, 3, self.stride, groups=mid, name="dw")(h)))
        h = _bn("bn2")(_conv(self.out, 1, name="project")(h))
        return x + h if self.stride == 1 and cin == self.out else h


class MobileNetV2(nn.Module):
    num_classes: int = 1000

    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu6(_bn("bn")(_conv(32, 3, 2, name="stem")(x)))
        n = 0
        for t, c, reps, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                              (6, 160, 3, 2), (6, 320, 1, 1)]:
            for r in range(reps):
                x = InvertedResidual(c, s if r == 0 else 1, t, name=f"block{n}")(x)
                n += 1
        x = jax.nn.relu6(_bn("head_bn")(_conv(1280, 1, name="head")(x)))
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


def resnet18(num_classes=1000):
    return ResNet((2, 2, 2, 2), False, num_classes)


def resnet50(num_classes=1000):
    return ResNet((3, 4, 6, 3), True, num_classes)


def mobilenet_v2(num_classes=1000):
    return MobileNetV2(num_classes)


def abstract_variables(module, input_shape):
    """The module's variables as shapes only (jax.eval_shape: nothing is computed)."""
    return jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1,) + tuple(input_shape), jnp.float32))


class TinyResidual(nn.Module):
    """A small CNN with batch norm and a residual block (cheap to compile): conv, conv/2, two convs + skip, fc."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(_bn("bn1")(_conv(8, 3, name="conv1")(x)))
        x = nn.relu(_bn("bn2")(_conv(16, 3, 2, name="conv2")(x)))
        h = nn.relu(_bn("bn3")(_conv(16, 3, name="res_a")(x)))
        h = _bn("bn4")(_conv(16, 3, name="res_b")(h))
        x = nn.relu(x + h)
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


def numpy_variables(module, input_shape, seed=0):
    """Variables of the module's shapes filled by NumPy (nothing compiled): kernels He-normal, biases and BN
    shifts small, BN scales near 1, running means near 0 and variances in [0.5, 1.5]."""
    rng = np.random.default_rng(seed)

    def fill(path, a):
        name = path[-1].key
        if name == "kernel":
            return (rng.standard_normal(a.shape) * np.sqrt(2.0 / np.prod(a.shape[:-1]))).astype(np.float32)
        if name in ("scale", "var"):
            return rng.uniform(0.5, 1.5, a.shape).astype(np.float32)
        return (0.1 * rng.standard_normal(a.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(fill, abstract_variables(module, input_shape))
