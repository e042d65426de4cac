"""Train / validation / test splits for the bilevel search, from an embedded dataset or tfds.

The search uses three splits: ``train`` for weight steps, ``val`` for architecture steps and the per-epoch
evaluation of the derived network, ``test`` for the final report. Every split is held in memory as
``float32 [N, H, W, C]`` images normalised per channel with the *train* split's mean and standard deviation,
and ``int32 [N]`` labels.

Sources:

* ``digits`` (default, offline): scikit-learn's ``load_digits``, 1797 real 8x8 grayscale handwritten digits
  that ship inside the scikit-learn wheel. A fixed stratified test split of 270 images (15 %, the same for
  every ``seed``) is held out first; the remaining 1527 are split, stratified and shuffled with ``seed``, into
  ``val`` (``round(val_fraction * 1527)``, 229 at the default 0.15) and ``train`` (the rest, 1298). The splits
  are kept in ``<cache root>/data/`` (:mod:`jmsnas.cache`; not with ``JMSNAS_COMPILE_CACHE=0``), so a later run
  reads them without importing scikit-learn.
* ``cifar10``, ``cifar100``, ``imagenet2012``: tensorflow-datasets, read from a prepared ``data_dir`` without
  downloading. tensorflow-datasets and TensorFlow are an extra (``pip install -e '.[tfds]'``); without them
  asking for one of these ends with a DatasetError naming that command. tfds ``train[:P%]`` becomes ``train`` and ``train[P%:]`` becomes ``val`` with
  ``P = 100 * (1 - val_fraction)``; ``test`` is tfds ``test`` (cifar) or ``validation`` (imagenet2012).
  Images are centre-cropped to a square and resized when ``image_size`` is given (imagenet2012 defaults to
  224). ``max_train`` / ``max_eval`` cap the number of examples read, which is what makes imagenet2012 fit
  in memory.

Batching is deterministic: the order of an epoch is a pure function of ``(seed, epoch)``, so a run resumed in
the middle of an epoch (``start=``) sees exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import os
from typing import Iterator, NamedTuple

import numpy as np


class DatasetError(ValueError):
    """A dataset that cannot be loaded as asked: unknown name, bad argument, or data not prepared."""


class Split(NamedTuple):
    """One split held in memory.

    Attributes:
      images: float32 [N, H, W, C], normalised per channel with the train split's statistics.
      labels: int32 [N], class indices in [0, num_classes).
    """

    images: np.ndarray
    labels: np.ndarray


class Dataset(NamedTuple):
    """The three splits of one dataset plus what a model needs to know about them.

    Attributes:
      name: dataset name, one of ``DATASETS``.
      train, val, test: the splits (see module docstring for how they are made).
      num_classes: number of classes.
      image_size: H == W of every image, in pixels.
      channels: C.
      mean, std: float32 [C], the per-channel statistics of the raw train pixels (digits: 0..16 intensity
        units; tfds: 0..255) used to normalise all three splits; apply the same to inputs at deployment.
    """

    name: str
    train: Split
    val: Split
    test: Split
    num_classes: int
    image_size: int
    channels: int
    mean: np.ndarray
    std: np.ndarray


class _TfdsSpec(NamedTuple):
    test_split: str
    default_size: int | None  # None: keep the native size


_TFDS = {
    "cifar10": _TfdsSpec("test", None),
    "cifar100": _TfdsSpec("test", None),
    "imagenet2012": _TfdsSpec("validation", 224),
}
DATASETS = ("digits",) + tuple(_TFDS)

_DIGITS_TOTAL = 1797
_DIGITS_TEST = 270
_DIGITS_CLASSES = 10
_MAX_IMAGE_SIZE = 4096


def check_name(name) -> None:
    """ConfigError (``runcheck``, one line) unless ``name`` is one of ``DATASETS``: a flow's check of its config."""
    if name not in DATASETS:
        from jmsnas.runcheck import ConfigError
        raise ConfigError(f"unknown dataset {name!r}; expected one of {list(DATASETS)}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_args(name, data_dir, val_fraction, seed, image_size, max_train, max_eval) -> None:
    """Reject bad arguments before anything is read."""
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise DatasetError(f"data_dir must be a path or None, got {data_dir!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float, np.floating)) or not (
        0.0 < float(val_fraction) < 1.0
    ):
        raise DatasetError(f"val_fraction must be a number strictly between 0 and 1, got {val_fraction!r}")
    if not _is_int(seed) or seed < 0:
        raise DatasetError(f"seed must be a non-negative integer, got {seed!r}")
    if image_size is not None and (not _is_int(image_size) or not 1 <= image_size <= _MAX_IMAGE_SIZE):
        raise DatasetError(f"image_size must be None or an integer in [1, {_MAX_IMAGE_SIZE}] pixels, got {image_size!r}")
    for arg, value in (("max_train", max_train), ("max_eval", max_eval)):
        if value is not None and (not _is_int(value) or value < 1):
            raise DatasetError(f"{arg} must be None or a positive integer, got {value!r}")


def load(
    name: str = "digits",
    *,
    data_dir: str | None = None,
    val_fraction: float = 0.15,
    seed: int = 0,
    image_size: int | None = None,
    max_train: int | None = None,
    max_eval: int | None = None,
) -> Dataset:
    """Loads ``name`` as normalised in-memory train / val / test splits.

    Args:
      name: one of ``DATASETS``; ``"digits"`` needs nothing on disk.
      data_dir: tfds data directory holding ``<name>/<version>``; None = the tfds default (``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``). Ignored for digits.
      val_fraction: fraction of the training pool held out as the validation split, in (0, 1).
      seed: shuffles the digits train/val split (the tfds slices do not depend on it).
      image_size: resize images to ``image_size x image_size`` pixels; None keeps the native size
        (8 for digits, 32 for cifar, 224 for imagenet2012).
      max_train: keep at most this many training examples.
      max_eval: keep at most this many validation and this many test examples.

    Returns:
      a ``Dataset``.

    Raises:
      DatasetError: bad argument (checked before any read), or a tfds dataset that is not prepared in data_dir.
    """
    _check_args(name, data_dir, val_fraction, seed, image_size, max_train, max_eval)
    if name == "digits":
        splits, num_classes = _load_digits(float(val_fraction), int(seed), max_train, max_eval), _DIGITS_CLASSES
    else:
        splits, num_classes = _load_tfds(name, data_dir, float(val_fraction), image_size, max_train, max_eval)
    if name == "digits" and image_size is not None:
        _check_resize_memory(splits, image_size)
        splits = tuple(Split(_resize(s.images, image_size), s.labels) for s in splits)
    (train, val, test), mean, std = _normalise(splits)
    _, height, width, channels = train.images.shape
    return Dataset(name, train, val, test, num_classes, int(height), int(channels), mean, std)


def from_config(cfg) -> Dataset:
    """The dataset a run's configuration names (its ``dataset``, ``data_dir``, ``val_fraction``, ``seed``,
    ``image_size``, ``max_train``, ``max_eval``; a ConfigDict or a plain dict)."""
    get = cfg.get
    return load(cfg["dataset"], data_dir=get("data_dir"), val_fraction=cfg["val_fraction"], seed=cfg["seed"],
                image_size=get("image_size"), max_train=get("max_train"), max_eval=get("max_eval"))


def _digits_sizes(val_fraction: float) -> tuple[int, int]:
    """(train, val) sizes of the digits pool after the fixed test split; errors if either is too small."""
    pool = _DIGITS_TOTAL - _DIGITS_TEST
    n_val = int(round(val_fraction * pool))
    if min(n_val, pool - n_val) < _DIGITS_CLASSES:
        raise DatasetError(
            f"val_fraction={val_fraction!r} leaves {n_val} validation and {pool - n_val} training digits; "
            f"a stratified split needs at least {_DIGITS_CLASSES} in each (use roughly 0.01 to 0.99)"
        )
    return pool - n_val, n_val


_DIGITS_KEYS = ("x_train", "x_val", "x_test", "y_train", "y_val", "y_test")


def _split_digits(n_val: int, seed: int) -> dict:
    """scikit-learn digits: fixed stratified test split, then a seeded stratified train/val split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None]  # [1797, 8, 8, 1], intensities 0..16
    labels = digits.target.astype(np.int32)
    if images.shape[0] != _DIGITS_TOTAL:
        raise DatasetError(f"scikit-learn's digits has {images.shape[0]} images, expected {_DIGITS_TOTAL}")
    x_pool, x_test, y_pool, y_test = train_test_split(
        images, labels, test_size=_DIGITS_TEST, stratify=labels, random_state=0
    )
    x_train, x_val, y_train, y_val = train_test_split(
        x_pool, y_pool, test_size=n_val, stratify=y_pool, random_state=seed
    )
    return dict(zip(_DIGITS_KEYS, (x_train, x_val, x_test, y_train, y_val, y_test)))


def _digits_cache_path(n_val: int, seed: int):
    """Where the splits for (n_val, seed) are kept: ``<cache root>/data/digits-<hash>.npz``, named by the split
    sizes, the seed and scikit-learn's version (its data and its splitting); None when jmsnas keeps nothing
    between runs (``JMSNAS_COMPILE_CACHE=0``)."""
    import hashlib
    import importlib.metadata

    from jmsnas import cache

    try:
        if not cache.requested():
            return None
        version = importlib.metadata.version("scikit-learn")
    except (ValueError, importlib.metadata.PackageNotFoundError):
        return None
    key = hashlib.sha256(f"digits|{_DIGITS_TOTAL}|{_DIGITS_TEST}|{n_val}|{seed}|{version}".encode()).hexdigest()
    return cache.root() / "data" / f"digits-{key[:32]}.npz"


def _read_digits(path, n_val: int):
    """The stored splits, or None when the file is missing or not what (n_val) implies."""
    n_train = _DIGITS_TOTAL - _DIGITS_TEST - n_val
    shapes = {"x_train": (n_train, 8, 8, 1), "x_val": (n_val, 8, 8, 1), "x_test": (_DIGITS_TEST, 8, 8, 1),
              "y_train": (n_train,), "y_val": (n_val,), "y_test": (_DIGITS_TEST,)}
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in _DIGITS_KEYS}
    except (OSError, KeyError, ValueError, EOFError):
        return None
    for k, a in arrays.items():
        if a.shape != shapes[k] or a.dtype != (np.float32 if k[0] == "x" else np.int32):
            return None
    return arrays


def _write_digits(path, arrays: dict) -> None:
    """Store the splits atomically (``safeio.atomic_write``); a directory that cannot be written is skipped (the
    splits are made again next time)."""
    from jmsnas import safeio

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with safeio.atomic_write(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError:
        pass


def _load_digits(val_fraction, seed, max_train, max_eval) -> tuple[Split, Split, Split]:
    """The digits splits (``_split_digits``), kept under the cache root after the first time, so that a later
    run neither imports scikit-learn (about a second) nor splits again."""
    _, n_val = _digits_sizes(val_fraction)
    path = _digits_cache_path(n_val, seed)
    arrays = _read_digits(path, n_val) if path is not None else None
    if arrays is None:
        arrays = _split_digits(n_val, seed)
        if path is not None:
            _write_digits(path, arrays)
    x_train, x_val, x_test, y_train, y_val, y_test = (arrays[k] for k in _DIGITS_KEYS)
    return (
        Split(x_train[:max_train], y_train[:max_train]),
        Split(x_val[:max_eval], y_val[:max_eval]),
        Split(x_test[:max_eval], y_test[:max_eval]),
    )


def _check_resize_memory(splits, size: int) -> None:
    """Refuses (before resizing) digits whose resized float32 copies (resized + normalised) would not fit."""
    from jmsnas.runcheck import memory_limit_bytes

    need = 2 * sum(s.images.shape[0] * size * size * s.images.shape[3] * 4 for s in splits)
    have, what = memory_limit_bytes()
    if have is not None and need > have:
        raise DatasetError(f"image_size={size} makes the digits take about {need / 2**30:.1f} GiB as float32, more "
                           f"than the {have / 2**30:.1f} GiB {what}; use a smaller image_size")


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear (antialiased when shrinking) resize of float32 [N, H, W, C] to [N, size, size, C]."""
    import jax

    n, _, _, c = images.shape
    return np.asarray(jax.image.resize(images, (n, size, size, c), method="linear"), dtype=np.float32)


def _normalise(splits) -> tuple[tuple[Split, Split, Split], np.ndarray, np.ndarray]:
    """Per-channel (x - mean) / std on all splits with the statistics of splits[0] (train)."""
    train_images = splits[0].images
    mean = train_images.mean(axis=(0, 1, 2), dtype=np.float64)
    std = train_images.std(axis=(0, 1, 2), dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    mean32, std32 = mean.astype(np.float32), std.astype(np.float32)
    out = []
    for split in splits:
        images = split.images.astype(np.float32, copy=True)
        images -= mean32
        images /= std32
        out.append(Split(images, split.labels.astype(np.int32)))
    return tuple(out), mean32, std32


def not_prepared(name, builder) -> DatasetError:
    """The one-message error for a tfds dataset that is not in data_dir."""
    root = builder.data_dir_root
    manual = (
        "; imagenet2012 cannot be downloaded by tfds at all: put ILSVRC2012_img_train.tar and "
        "ILSVRC2012_img_val.tar in DIR/downloads/manual before `tfds build`"
        if name == "imagenet2012"
        else ""
    )
    return DatasetError(
        f"dataset {name!r} is not prepared in data_dir {root} (looked for {builder.data_dir}) and cannot be "
        f"downloaded here; on a machine with internet access run `tfds build {name} --data_dir=DIR` (or "
        f"tfds.load({name!r}, data_dir=DIR, download=True)), or copy a prepared DIR/{name}/<version> folder, "
        f"then pass DIR as data_dir (--config.data_dir=DIR){manual}"
    )


def _load_tfds(name, data_dir, val_fraction, image_size, max_train, max_eval):
    """Reads the three splits of a prepared tfds dataset; returns ((train, val, test), num_classes)."""
    tf, tfds = import_tf_quietly(name)
    data_dir = os.fspath(data_dir) if data_dir is not None else None
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as err:  # noqa: BLE001 - tfds raises protobuf, JSON, OS errors for a damaged folder
        raise DatasetError(f"cannot open dataset {name!r} in data_dir {data_dir or '(tfds default)'}: "
                           f"{first_line(err)} (expected a folder prepared by `tfds build {name}`)") from None
    size = image_size if image_size is not None else _TFDS[name].default_size
    pct = format(100.0 * (1.0 - val_fraction), ".10g")
    wanted = ((f"train[:{pct}%]", max_train), (f"train[{pct}%:]", max_eval), (_TFDS[name].test_split, max_eval))
    _check_memory(name, builder, wanted, size)
    try:
        splits = tuple(_read_split(builder, spec, size, limit) for spec, limit in wanted)
    except AssertionError:  # raised by tfds' as_dataset when the data folder is missing
        raise not_prepared(name, builder) from None
    except KeyError as err:  # tfds: "splits is empty ... has not been generated yet" (an empty version folder)
        if "not been generated" in str(err):
            raise not_prepared(name, builder) from None
        raise DatasetError(f"could not read dataset {name!r} from {builder.data_dir}: {first_line(err)}") from None
    except (tf.errors.OpError, OSError, ValueError) as err:
        raise DatasetError(f"could not read dataset {name!r} from {builder.data_dir}: {first_line(err)}") from None
    for spec, split in zip((w[0] for w in wanted), splits):
        if split.labels.shape[0] == 0:
            raise DatasetError(f"split {spec!r} of {name!r} is empty; choose a different val_fraction")
    return splits, int(builder.info.features["label"].num_classes)


def import_tf_quietly(name: str = "a tfds dataset"):
    """(tensorflow, tensorflow_datasets), imported with the process's stderr (fd 2) parked in a temporary file
    (a DatasetError naming the install command where either is not installed: they are the ``tfds`` extra):
    TensorFlow 2.21 logs oneDNN/absl lines at import whatever TF_CPP_MIN_LOG_LEVEL says, which would bury a
    one-line dataset error. What it printed is passed on only if the import fails."""
    import importlib.util
    import sys
    import tempfile

    for module, package in (("tensorflow_datasets", "tensorflow-datasets"), ("tensorflow", "TensorFlow")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ValueError, AttributeError):  # sys.modules holds None for it (an import blocked on purpose)
            found = False
        if not found:
            raise DatasetError(f"dataset {name!r} is read with {package}, which is not installed: run "
                               f"pip install -e '.[tfds]' in the jmsnas checkout (or pip install 'jmsnas[tfds]'); "
                               f"the embedded digits (--config.dataset=digits) need neither")
    if "tensorflow_datasets" in sys.modules:
        import tensorflow as tf
        import tensorflow_datasets as tfds
        return tf, tfds
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            import tensorflow as tf
            import tensorflow_datasets as tfds
        except BaseException:
            os.dup2(saved, 2)
            log.seek(0)
            os.write(2, log.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return tf, tfds


def first_line(err: BaseException, limit: int = 240) -> str:
    """The first non-empty line of an exception's message (or its type), at most ``limit`` characters."""
    lines = [ln.strip() for ln in str(err).strip().strip('"').splitlines() if ln.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_memory(name, builder, wanted, size) -> None:
    """Refuses (before reading) a load whose float32 arrays would take more than half of physical memory."""
    counts = []
    for spec, limit in wanted:
        try:
            n = builder.info.splits[spec].num_examples
        except (KeyError, ValueError):  # sizes unknown (not prepared, or mocked): nothing to check
            return
        counts.append(n if limit is None else min(n, limit))
    height, width, channels = builder.info.features["image"].shape
    pixels = (size * size if size is not None else (height or 0) * (width or 0)) * (channels or 3)
    need = sum(counts) * pixels * 4
    have = _physical_memory_bytes()
    if have is not None and need > have // 2:
        raise DatasetError(
            f"{name} with {counts[0]} train, {counts[1]} val and {counts[2]} test images would take "
            f"{need / 2**30:.1f} GiB as float32, more than half of this machine's {have / 2**30:.1f} GiB; "
            f"cap it with --config.max_train=N / --config.max_eval=N (max_train / max_eval of jmsnas.data.load) "
            f"or a smaller --config.image_size"
        )


def _physical_memory_bytes() -> int | None:
    """Physical memory of this machine in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _read_split(builder, spec: str, size: int | None, limit: int | None) -> Split:
    """Streams one tfds split into memory as raw float32 pixels (normalised later) and int32 labels."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    def prepare(image, label):
        if size is not None:
            height, width = tf.shape(image)[0], tf.shape(image)[1]
            side = tf.minimum(height, width)
            image = tf.image.crop_to_bounding_box(image, (height - side) // 2, (width - side) // 2, side, side)
            image = tf.image.resize(image, (size, size), method="bilinear", antialias=True)
        return tf.cast(image, tf.float32), tf.cast(label, tf.int32)

    ds = builder.as_dataset(split=spec, as_supervised=True, shuffle_files=False)
    if limit is not None:
        ds = ds.take(limit)
    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).batch(512).prefetch(2)
    images, labels = [], []
    for x, y in tfds.as_numpy(ds):
        images.append(x)
        labels.append(y)
    if not images:
        return Split(np.zeros((0, size or 0, size or 0, 3), np.float32), np.zeros((0,), np.int32))
    return Split(np.concatenate(images), np.concatenate(labels))


def num_batches(split: Split, batch_size: int) -> int:
    """Number of full batches of ``batch_size`` in ``split`` (the remainder is dropped)."""
    _check_batch_size(split, batch_size)
    return split.labels.shape[0] // batch_size


def _check_batch_size(split: Split, batch_size: int) -> None:
    n = split.labels.shape[0]
    if not _is_int(batch_size) or batch_size < 1:
        raise DatasetError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > n:
        raise DatasetError(f"batch_size={batch_size} is larger than the split ({n} examples): an epoch has no batch")


def epoch_batches(
    split: Split, batch_size: int, *, seed: int, epoch: int, start: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields the shuffled full batches of one epoch, from batch index ``start`` on.

    The permutation is ``np.random.default_rng([seed, epoch]).permutation(N)``: a pure function of
    ``(seed, epoch)``, so ``start=k`` yields exactly batches k, k+1, ... of the uninterrupted epoch.

    Yields:
      (images float32 [batch_size, H, W, C], labels int32 [batch_size]).
    """
    total = num_batches(split, batch_size)
    for arg, value in (("seed", seed), ("epoch", epoch)):
        if not _is_int(value) or value < 0:
            raise DatasetError(f"{arg} must be a non-negative integer, got {value!r}")
    if not _is_int(start) or not 0 <= start <= total:
        raise DatasetError(f"start must be an integer batch index in [0, {total}], got {start!r}")
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(split.labels.shape[0])
    return _gather(split, order, batch_size, start, total)


def _gather(split, order, batch_size, start, stop):
    for b in range(start, stop):
        idx = order[b * batch_size : (b + 1) * batch_size]
        yield split.images[idx], split.labels[idx]


def eval_batches(split: Split, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields ``split`` in order in batches of ``batch_size``; the last batch may be smaller."""
    if not _is_int(batch_size) or batch_size < 1:
        raise DatasetError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = split.labels.shape[0]
    return ((split.images[i : i + batch_size], split.labels[i : i + batch_size]) for i in range(0, n, batch_size))
