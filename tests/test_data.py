"""Tests of jmsnas.data: the embedded digits splits, deterministic batching, and the tfds path (mocked)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from jmsnas import data
from jmsnas.data import DatasetError, Split


@pytest.fixture(scope="module")
def digits():
    return data.load("digits", seed=0)


def _raw(ds: data.Dataset, split: Split) -> np.ndarray:
    """Undo the normalisation: raw pixels of a split."""
    return split.images * ds.std + ds.mean


# ---------------------------------------------------------------- digits


def test_digits_shapes_and_dtypes(digits):
    assert (digits.name, digits.num_classes, digits.image_size, digits.channels) == ("digits", 10, 8, 1)
    sizes = {}
    for key in ("train", "val", "test"):
        split = getattr(digits, key)
        assert split.images.dtype == np.float32 and split.labels.dtype == np.int32
        assert split.images.shape[1:] == (8, 8, 1) and split.images.shape[0] == split.labels.shape[0]
        sizes[key] = split.labels.shape[0]
    # documented sizes: test 270 fixed; val = round(0.15 * 1527) = 229; train = 1527 - 229
    assert sizes == {"train": 1298, "val": 229, "test": 270}


def test_digits_splits_partition_the_sklearn_set(digits):
    from sklearn.datasets import load_digits

    ref = load_digits()
    key = lambda imgs, labs: sorted(  # noqa: E731
        np.rint(i).astype(np.uint8).tobytes() + bytes([int(l)]) for i, l in zip(imgs.reshape(len(labs), -1), labs)
    )
    got = []
    for split in (digits.train, digits.val, digits.test):
        raw = _raw(digits, split)
        np.testing.assert_allclose(raw, np.rint(raw), atol=1e-4)  # raw intensities are integers 0..16
        got += key(raw, split.labels)
    assert sorted(got) == key(ref.images, ref.target)


def test_digits_normalised_with_train_statistics(digits):
    train_raw = _raw(digits, digits.train)
    np.testing.assert_allclose(digits.mean, train_raw.mean(axis=(0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(digits.std, train_raw.std(axis=(0, 1, 2)), rtol=1e-4)
    np.testing.assert_allclose(digits.train.images.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(digits.train.images.std(axis=(0, 1, 2)), 1.0, atol=1e-5)


def test_digits_stratified(digits):
    pool = np.bincount(np.concatenate([digits.train.labels, digits.val.labels, digits.test.labels]), minlength=10)
    share = pool / pool.sum()
    for split in (digits.train, digits.val, digits.test):
        counts = np.bincount(split.labels, minlength=10)
        assert np.all(np.abs(counts - share * counts.sum()) <= 1.0 + 1e-9), counts


def test_digits_deterministic_in_seed(digits):
    again = data.load("digits", seed=0)
    other = data.load("digits", seed=1)
    for a, b in zip(digits[1:4], again[1:4]):
        np.testing.assert_array_equal(a.images, b.images)
        np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(digits.train.labels, other.train.labels)
    # the test split does not depend on the seed (comparable final reports)
    np.testing.assert_array_equal(np.rint(_raw(digits, digits.test)), np.rint(_raw(other, other.test)))
    np.testing.assert_array_equal(digits.test.labels, other.test.labels)


def test_digits_val_fraction_caps_and_resize(digits):
    ds = data.load("digits", val_fraction=0.3, max_train=100, max_eval=50, image_size=16)
    assert ds.val.labels.shape == (50,) and ds.test.labels.shape == (50,) and ds.train.labels.shape == (100,)
    assert ds.train.images.shape == (100, 16, 16, 1) and ds.image_size == 16
    assert data.load("digits", val_fraction=0.3).val.labels.shape == (round(0.3 * 1527),)
    same = data.load("digits", image_size=8)  # resizing to the native size is the identity
    np.testing.assert_allclose(same.train.images, digits.train.images, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(name="mnist"), "'mnist'"),
        (dict(val_fraction=0.0), "val_fraction"),
        (dict(val_fraction=1.0), "val_fraction"),
        (dict(val_fraction=True), "val_fraction"),
        (dict(val_fraction=0.001), "val_fraction=0.001"),
        (dict(image_size=0), "image_size"),
        (dict(image_size=8.0), "image_size"),
        (dict(seed=-1), "seed"),
        (dict(max_train=0), "max_train"),
        (dict(max_eval=-3), "max_eval"),
    ],
)
def test_bad_arguments_rejected(kwargs, needle):
    with pytest.raises(DatasetError) as info:
        data.load(**kwargs)
    assert needle in str(info.value)


def test_unknown_name_lists_datasets():
    with pytest.raises(DatasetError) as info:
        data.load("cifar-10")
    msg = str(info.value)
    assert "'cifar-10'" in msg and all(name in msg for name in data.DATASETS)


def test_arguments_checked_before_loading(monkeypatch, tmp_path):
    def boom(*args, **kwargs):
        raise AssertionError("loader must not run")

    monkeypatch.setattr(data, "_load_digits", boom)
    monkeypatch.setattr(data, "_load_tfds", boom)
    with pytest.raises(DatasetError, match="image_size"):
        data.load("digits", image_size=-2)
    with pytest.raises(DatasetError, match="val_fraction"):
        data.load("cifar10", data_dir=str(tmp_path), val_fraction=2.0)


# ---------------------------------------------------------------- batching


def _indexed_split(n: int) -> Split:
    """A split whose image i is filled with the value i, to track which examples a batch holds."""
    images = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n, 2, 2, 1)).copy()
    return Split(images, np.arange(n, dtype=np.int32))


def test_num_batches_drops_remainder():
    split = _indexed_split(23)
    assert [data.num_batches(split, b) for b in (1, 5, 23)] == [23, 4, 1]
    for bad in (0, -1, 24, 2.0):
        with pytest.raises(DatasetError, match="batch_size"):
            data.num_batches(split, bad)


def test_epoch_batches_is_a_deterministic_permutation():
    split = _indexed_split(23)
    batches = list(data.epoch_batches(split, 5, seed=3, epoch=2))
    assert len(batches) == 4 and all(x.shape == (5, 2, 2, 1) and y.shape == (5,) for x, y in batches)
    seen = np.concatenate([y for _, y in batches])
    assert len(np.unique(seen)) == 20  # no example twice, remainder of 3 dropped
    for x, y in batches:  # images and labels stay paired
        np.testing.assert_array_equal(x[:, 0, 0, 0], y.astype(np.float32))
    again = np.concatenate([y for _, y in data.epoch_batches(split, 5, seed=3, epoch=2)])
    np.testing.assert_array_equal(seen, again)
    expected = np.random.default_rng([3, 2]).permutation(23)[:20]
    np.testing.assert_array_equal(seen, expected)
    other_epoch = np.concatenate([y for _, y in data.epoch_batches(split, 5, seed=3, epoch=3)])
    other_seed = np.concatenate([y for _, y in data.epoch_batches(split, 5, seed=4, epoch=2)])
    assert not np.array_equal(seen, other_epoch) and not np.array_equal(seen, other_seed)


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_epoch_batches_resume_from_start(k):
    split = _indexed_split(23)
    full = [y for _, y in data.epoch_batches(split, 5, seed=7, epoch=1)]
    head = [y for _, y in data.epoch_batches(split, 5, seed=7, epoch=1)][:k]
    tail = [y for _, y in data.epoch_batches(split, 5, seed=7, epoch=1, start=k)]
    assert len(head) + len(tail) == len(full)
    for a, b in zip(head + tail, full):
        np.testing.assert_array_equal(a, b)


def test_epoch_batches_bad_arguments():
    split = _indexed_split(10)
    for kwargs, needle in [
        (dict(seed=0, epoch=0, start=4), "start"),
        (dict(seed=0, epoch=0, start=-1), "start"),
        (dict(seed=-1, epoch=0), "seed"),
        (dict(seed=0, epoch=-2), "epoch"),
    ]:
        with pytest.raises(DatasetError, match=needle):
            list(data.epoch_batches(split, 3, **kwargs))


def test_eval_batches_cover_every_example_once_in_order():
    split = _indexed_split(23)
    for batch_size in (1, 5, 23, 40):
        batches = list(data.eval_batches(split, batch_size))
        labels = np.concatenate([y for _, y in batches])
        np.testing.assert_array_equal(labels, np.arange(23))
        np.testing.assert_array_equal(np.concatenate([x for x, _ in batches])[:, 0, 0, 0], np.arange(23))
        assert all(len(y) == batch_size for _, y in batches[:-1]) and 1 <= len(batches[-1][1]) <= batch_size
    with pytest.raises(DatasetError, match="batch_size"):
        list(data.eval_batches(split, 0))


# ---------------------------------------------------------------- tfds (mocked) and the not-prepared error


def _raw_tfds(name: str, split: str, num: int) -> tuple[np.ndarray, np.ndarray]:
    import tensorflow_datasets as tfds

    ds = tfds.builder(name).as_dataset(split=split, as_supervised=True)
    images, labels = zip(*tfds.as_numpy(ds.take(num)))
    return np.stack(images).astype(np.float32), np.asarray(labels)


@pytest.mark.parametrize("name, classes", [("cifar10", 10), ("cifar100", 100)])
def test_tfds_cifar_mocked(name, classes, tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=24):
        ds = data.load(name, data_dir=str(tmp_path), max_train=20)
        raw_train, raw_labels = _raw_tfds(name, "train", 20)
        raw_test, _ = _raw_tfds(name, "test", 24)
    assert (ds.num_classes, ds.image_size, ds.channels) == (classes, 32, 3)
    # mock_data yields num_examples for every (sliced) split; max_train caps the train split
    assert [s.labels.shape[0] for s in ds[1:4]] == [20, 24, 24]
    for split in ds[1:4]:
        assert split.images.shape[1:] == (32, 32, 3) and split.images.dtype == np.float32
        assert split.labels.dtype == np.int32 and split.labels.min() >= 0 and split.labels.max() < classes
    mean, std = raw_train.mean(axis=(0, 1, 2)), raw_train.std(axis=(0, 1, 2))
    np.testing.assert_allclose(ds.mean, mean, rtol=1e-5)
    np.testing.assert_allclose(ds.std, std, rtol=1e-4)
    np.testing.assert_allclose(ds.train.images, (raw_train - mean) / std, atol=1e-4)
    np.testing.assert_array_equal(ds.train.labels, raw_labels)
    np.testing.assert_allclose(ds.test.images, (raw_test - mean) / std, atol=1e-4)  # train statistics


def test_tfds_imagenet_mocked_resized(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=6):  # mocked imagenet images have random non-square sizes
        ds = data.load("imagenet2012", data_dir=str(tmp_path), image_size=12, max_train=5, max_eval=3)
    assert (ds.num_classes, ds.image_size, ds.channels) == (1000, 12, 3)
    assert [s.images.shape for s in ds[1:4]] == [(5, 12, 12, 3), (3, 12, 12, 3), (3, 12, 12, 3)]
    assert all(np.isfinite(s.images).all() for s in ds[1:4])


def test_tfds_not_prepared_is_one_clear_error(tmp_path):
    import tensorflow_datasets as tfds

    empty = tmp_path / "tfds"
    empty.mkdir()
    # mock_data is not active here: the builder really looks inside the empty directory
    assert tfds.builder("cifar10", data_dir=str(empty)).data_dir.startswith(str(empty))
    with pytest.raises(DatasetError) as info:
        data.load("cifar10", data_dir=str(empty))
    msg = str(info.value)
    assert "'cifar10'" in msg and str(empty) in msg and "tfds build cifar10" in msg
    assert "--config.data_dir=DIR" in msg  # the flag that exists
    assert "\n" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


class _FakeSplits(dict):
    def __getitem__(self, spec):
        return type("SplitInfo", (), {"num_examples": dict.__getitem__(self, spec)})()


def _fake_builder(counts: dict, shape=(32, 32, 3)):
    info = type("Info", (), {"splits": _FakeSplits(counts), "features": {"image": type("F", (), {"shape": shape})()}})
    return type("Builder", (), {"info": info})()


def test_memory_guard_refuses_loads_larger_than_half_of_memory(monkeypatch):
    builder = _fake_builder({"train[:85%]": 850, "train[85%:]": 150, "test": 1000})
    wanted = (("train[:85%]", None), ("train[85%:]", None), ("test", 500))
    need = (850 + 150 + 500) * 32 * 32 * 3 * 4  # float32 bytes of the capped splits: 18,432,000
    monkeypatch.setattr(data, "_physical_memory_bytes", lambda: 2 * need)
    data._check_memory("cifar10", builder, wanted, None)  # exactly half: accepted
    monkeypatch.setattr(data, "_physical_memory_bytes", lambda: 2 * need - 2)
    with pytest.raises(DatasetError, match="850 train, 150 val and 500 test") as e:
        data._check_memory("cifar10", builder, wanted, None)
    # the hint names overrides that exist: each is a key of the default config the command line accepts
    from jmsnas.configs import apply_overrides
    from jmsnas.configs import default_config
    flags = re.findall(r"--config\.(\w+)", str(e.value))
    assert sorted(flags) == ["image_size", "max_eval", "max_train"]
    cfg = apply_overrides(default_config(), [f"--config.{f}=16" for f in flags])
    assert [cfg[f] for f in flags] == [16, 16, 16]
    # resizing changes the estimate: 16x16 images need a quarter of the bytes
    data._check_memory("cifar10", builder, wanted, 16)
    # sizes unknown (not prepared or mocked): nothing to check
    data._check_memory("cifar10", _fake_builder({}), wanted, None)


# ---------------------------------------------------------------- digits kept between runs


@pytest.mark.slow
def test_kept_digits_equal_a_fresh_split_and_need_no_sklearn(tmp_path):
    import json
    import os
    import subprocess
    import sys

    # a position-weighted sum per split: equal only for the same images and labels in the same order
    probe = ("import json, sys, numpy as np\n"
             "from jmsnas import data\n"
             "ds = data.load('digits', seed=int(sys.argv[1]))\n"
             "w = lambda s: np.arange(1, len(s.labels) + 1)\n"
             "sums = [float(np.sum(s.images * w(s)[:, None, None, None]) + np.sum(s.labels * w(s)))\n"
             "        for s in (ds.train, ds.val, ds.test)]\n"
             "print(json.dumps({'sklearn': 'sklearn' in sys.modules, 'sums': sums}))\n")
    env = dict(os.environ, JMSNAS_CACHE_DIR=str(tmp_path / "root"))
    env.pop("JMSNAS_COMPILE_CACHE", None)

    def run(seed, **extra):
        out = subprocess.run([sys.executable, "-c", probe, str(seed)], env=dict(env, **extra), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(0), run(0)
    assert first["sklearn"] and not second["sklearn"]  # the second run reads the kept splits
    assert second["sums"] == first["sums"]
    assert run(1)["sums"] != first["sums"]  # another seed: another split, kept apart
    assert len(list((tmp_path / "root" / "data").glob("digits-*.npz"))) == 2
    off = run(2, JMSNAS_COMPILE_CACHE="0")
    assert off["sklearn"] and len(list((tmp_path / "root" / "data").glob("digits-*.npz"))) == 2


def test_kept_digits_damaged_or_missing_are_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("JMSNAS_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.delenv("JMSNAS_COMPILE_CACHE", raising=False)
    fresh = data._split_digits(229, 0)
    got = data._load_digits(0.15, 0, None, None)
    (path,) = (tmp_path / "root" / "data").glob("digits-*.npz")
    for split, (x, y) in zip(got, (("x_train", "y_train"), ("x_val", "y_val"), ("x_test", "y_test"))):
        np.testing.assert_array_equal(split.images, fresh[x])
        np.testing.assert_array_equal(split.labels, fresh[y])
    for damage in (b"not an npz", None):
        if damage is None:
            np.savez(path, x_train=np.zeros((3, 8, 8, 1), np.float32))  # a readable file of the wrong content
        else:
            path.write_bytes(damage)
        assert data._read_digits(path, 229) is None
        again = data._load_digits(0.15, 0, None, None)
        np.testing.assert_array_equal(again[0].images, fresh["x_train"])
        assert data._read_digits(path, 229) is not None  # replaced
