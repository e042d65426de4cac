"""Multi-view data: V deterministic partial views of every image (the V sensors of SplitNets' multi-view task).

A view is a square crop of ``view_size`` x ``view_size`` pixels of the (normalised) image. View v's crop is centred
on the point at angle 45 deg + v * 360 deg / V on the circle through the image's corner crops, clipped to the
image: for V = 4 the views are the four corner crops (top-left, top-right, bottom-right, bottom-left in turn from
view 0 = bottom-right); for V = 1 the single view is the bottom-right crop. With ``view_size`` < H no view holds the
whole image (a 6 x 6 corner crop of an 8 x 8 digit misses 44% of its pixels), so fusing the views is needed to see
all of it, while neighbouring views overlap. The crops are the same for every image and every epoch.

``from_dataset`` turns any ``jmsnas.data.Dataset`` (the embedded digits, or a tfds image dataset loaded by
``jmsnas.data.load``) into a ``MultiViewDataset`` whose splits hold float32[N, V, s, s, C] images.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jmsnas import data


class MultiViewDataset(NamedTuple):
    """Like ``data.Dataset`` with images float32[N, V, s, s, C]; ``origins`` are the (row, col) of each crop."""

    name: str
    train: data.Split
    val: data.Split
    test: data.Split
    num_classes: int
    image_size: int  # s, the view size
    channels: int
    views: int
    origins: tuple


def view_origins(image_size: int, view_size: int, views: int) -> tuple:
    """((row, col), ...) of the top-left corner of each of the ``views`` crops (see the module docstring)."""
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be an integer >= 1 (one per sensor), got {views!r}")
    if isinstance(view_size, bool) or not isinstance(view_size, int) or not 1 <= view_size <= image_size:
        raise ValueError(f"view_size must be an integer in [1, {image_size}] (the image is {image_size} pixels), "
                         f"got {view_size!r}")
    span = image_size - view_size
    out = []
    for v in range(views):
        a = math.pi / 4 + 2 * math.pi * v / views
        r = int(np.clip(round(span / 2 * (1 + math.sqrt(2) * math.sin(a))), 0, span))
        c = int(np.clip(round(span / 2 * (1 + math.sqrt(2) * math.cos(a))), 0, span))
        out.append((r, c))
    return tuple(out)


def make_views(images: np.ndarray, origins, view_size: int) -> np.ndarray:
    """float32[N, H, W, C] -> float32[N, V, view_size, view_size, C], one crop per origin."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1] != images.shape[2]:
        raise ValueError(f"images must be float32[N, H, H, C] (square), got shape {images.shape}")
    return np.stack([images[:, r:r + view_size, c:c + view_size, :] for r, c in origins], axis=1).astype(np.float32)


def from_dataset(ds: data.Dataset, views: int, view_size: int) -> MultiViewDataset:
    """The ``views`` partial views of every image of ``ds`` (any source ``data.load`` reads)."""
    origins = view_origins(ds.image_size, view_size, views)
    split = lambda s: data.Split(make_views(s.images, origins, view_size), s.labels)
    return MultiViewDataset(ds.name, split(ds.train), split(ds.val), split(ds.test), ds.num_classes, view_size,
                            ds.channels, views, origins)


def load(name: str = "digits", *, views: int, view_size: int, **kwargs) -> MultiViewDataset:
    """``data.load(name, **kwargs)`` (digits offline, or a prepared tfds dataset) turned into V views; the view
    arguments are checked before anything is read."""
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be an integer >= 1 (one per sensor), got {views!r}")
    if isinstance(view_size, bool) or not isinstance(view_size, int) or view_size < 1:
        raise ValueError(f"view_size must be a positive integer number of pixels, got {view_size!r}")
    return from_dataset(data.load(name, **kwargs), views, view_size)
