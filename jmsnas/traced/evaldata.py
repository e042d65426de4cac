"""Evaluation data for your own model: images and labels from an .npz file or a prepared tfds dataset.

* ``FILE.npz`` with ``images`` (real numbers, shape [N, *input_shape], exactly what ``apply`` takes: normalise
  them as the model was trained) and ``labels`` (integers, shape [N]);
* ``tfds:NAME`` or ``tfds:NAME:SPLIT`` (default split ``test``) read from ``data_dir`` without downloading; images
  as float32 of their stored values (0..255 for image features: the model normalises them itself).

``split(images, labels)`` halves the set: the first half (``val``) is where Auto-Split checks a candidate's
accuracy drop against A and calibrates the activation ranges, the second (``test``) where the chosen split is
reported. Every problem is one ``EvalDataError`` line naming the value and what was expected.
"""
from __future__ import annotations

import os

import numpy as np

from jmsnas.data import Split


class EvalDataError(ValueError):
    """Evaluation data that cannot be used with the model (one line)."""


def _check(images, labels, input_shape, where: str):
    images, labels = np.asarray(images), np.asarray(labels)
    want = "[N, " + ", ".join(map(str, input_shape)) + "]"
    if images.dtype.kind not in "fiu" or images.dtype.kind == "b":
        raise EvalDataError(f"{where}: images have dtype {images.dtype}; expected real numbers (float or integer) "
                            f"shaped {want}")
    if images.ndim != len(input_shape) + 1 or tuple(images.shape[1:]) != tuple(input_shape) or len(images) < 2:
        raise EvalDataError(f"{where}: images have shape {list(images.shape)}; the model takes {want} with N >= 2")
    if labels.dtype.kind not in "iu":
        raise EvalDataError(f"{where}: labels have dtype {labels.dtype}; expected integer class indices")
    if labels.shape != (len(images),):
        raise EvalDataError(f"{where}: labels have shape {list(labels.shape)}; expected [{len(images)}] (one per "
                            "image)")
    if (labels < 0).any():
        raise EvalDataError(f"{where}: labels hold negative values; expected class indices >= 0")
    return images.astype(np.float32), labels.astype(np.int32)


def _npz(path: str, input_shape):
    if not os.path.isfile(path):
        raise EvalDataError(f"--data {path!r} does not exist (expected FILE.npz with images and labels, or "
                            "tfds:NAME)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("images", "labels") if k not in z.files]
            if missing:
                raise EvalDataError(f"--data {path!r} lacks {missing}; expected arrays 'images' and 'labels' "
                                    f"(it has {sorted(z.files)})")
            return _check(z["images"], z["labels"], input_shape, f"--data {path!r}")
    except EvalDataError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zip raises BadZipFile, ValueError, EOFError, ...
        raise EvalDataError(f"--data {path!r} is not a readable .npz file: {type(e).__name__}: {e}") from None


def _tfds(spec: str, input_shape, data_dir):
    from jmsnas.data import DatasetError, first_line, import_tf_quietly, not_prepared
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise EvalDataError(f"--data {spec!r}: expected tfds:NAME or tfds:NAME:SPLIT")
    name, split_name = parts[1], parts[2] if len(parts) == 3 else "test"
    _, tfds = import_tf_quietly()
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        ds = builder.as_dataset(split=split_name, as_supervised=True)
        xs, ys = zip(*[(np.asarray(x), int(y)) for x, y in tfds.as_numpy(ds)])
    except AssertionError:
        raise EvalDataError(str(not_prepared(name, builder)).replace("--config.data_dir=DIR", "--data-dir DIR")) \
            from None
    except (DatasetError, ValueError) as e:
        raise EvalDataError(f"--data {spec!r}: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - tfds raises many types for a missing or damaged dataset
        raise EvalDataError(f"--data {spec!r} cannot be read from data_dir {data_dir or '(tfds default)'}: "
                            f"{first_line(e)}") from None
    return _check(np.stack(xs).astype(np.float32), np.asarray(ys, np.int64), input_shape, f"--data {spec!r}")


def load(spec: str, input_shape, data_dir: str | None = None):
    """(images float32[N, *input_shape], labels int32[N]) from ``FILE.npz`` or ``tfds:NAME[:SPLIT]``."""
    if not isinstance(spec, str) or not spec:
        raise EvalDataError(f"--data must be FILE.npz or tfds:NAME, got {spec!r}")
    if spec.startswith("tfds:"):
        return _tfds(spec, tuple(input_shape), data_dir)
    return _npz(spec, tuple(input_shape))


def check_classes(labels, output_shape, spec: str) -> None:
    """EvalDataError (one line) when a label is no output of the model (``output_shape``: the traced model's, with
    its batch dimension; its other dimensions flattened are the classes): its accuracy would be 0 without a word."""
    shape = tuple(output_shape)
    classes = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
    if len(labels) and int(labels.max()) >= classes:
        raise EvalDataError(f"--data {spec!r}: labels reach {int(labels.max())}; the model has {classes} outputs")


def split(images, labels) -> tuple:
    """(val, test) halves as ``data.Split``s: the first ceil(N/2) examples and the rest."""
    h = (len(images) + 1) // 2
    return Split(images[:h], labels[:h]), Split(images[h:], labels[h:])
