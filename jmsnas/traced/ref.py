"""Your own JAX model as a ``UserModel``: an apply function, its parameters and the input shape of one example.

A model reference ``pkg.module:factory`` (or ``path/to/file.py:factory``) names a function of no arguments that
returns one of

* a ``UserModel`` (e.g. from ``from_linen`` / ``from_nnx`` / ``from_apply``);
* a tuple ``(apply, params, input_shape)``: ``apply(params, x) -> logits`` with ``x`` float32[B, *input_shape]
  and one array out; ``params`` a pytree of arrays, or a path to a ``.npz`` file (keys ``a/b/c`` become nested
  dicts) or to an orbax checkpoint directory holding them.

Parameters vs buffers: when ``params`` is a dict with a top-level ``"params"`` key (flax's variable collections),
only the leaves under it count as parameters; the others (``"batch_stats"``, ...) are buffers (torchvision's
convention: running statistics are not parameters). Otherwise every leaf is a parameter.

``resolve(ref)`` imports the module (the current directory is searched first, as ``python -m`` does), calls the
factory and checks what it returned; every failure is one ``ModelRefError`` line naming the reference.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, NamedTuple

import jax
import numpy as np


class ModelRefError(ValueError):
    """A model reference that cannot be used; the message is one line naming the reference and the cause."""


class UserModel(NamedTuple):
    """name: label in reports; apply(params, x) -> y; params: pytree of arrays; input_shape: one example's shape
    (no batch dimension); input_dtype: dtype of x."""

    name: str
    apply: Callable
    params: object
    input_shape: tuple
    input_dtype: str = "float32"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_reference(text) -> bool:
    """True for ``module:factory`` / ``file.py:factory`` (a colon with a Python name after it)."""
    if not isinstance(text, str) or text.count(":") != 1:
        return False
    mod, fn = text.split(":")
    return bool(mod) and fn.isidentifier()


def from_apply(apply: Callable, params, input_shape, name: str = "model", input_dtype: str = "float32") -> UserModel:
    """A plain ``apply(params, x)`` model; ``params`` may be a pytree or a .npz / orbax checkpoint path."""
    if isinstance(params, (str, os.PathLike)):
        params = load_params(os.fspath(params))
    return UserModel(name, apply, params, _shape(input_shape, name), str(np.dtype(input_dtype)))


def from_linen(module, variables, input_shape, name: str | None = None, **apply_kwargs) -> UserModel:
    """A flax linen module with its variables ({"params": ..., "batch_stats": ...}); ``apply_kwargs`` are passed
    to every call (e.g. ``train=False``). Batch statistics are read, never updated."""
    kw = dict(apply_kwargs)

    def apply(v, x):
        return module.apply(v, x, **kw)
    return from_apply(apply, variables, input_shape, name or type(module).__name__)


def from_nnx(model, input_shape, name: str | None = None) -> UserModel:
    """A flax nnx module (put it in eval mode first, ``model.eval()``): its ``nnx.Param`` variables are the
    parameters, everything else (batch statistics, ...) buffers."""
    from flax import nnx
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(v, x):
        return nnx.merge(graphdef, v["params"], v.get("buffers", {}))(x)
    variables = {"params": nnx.to_pure_dict(params), "buffers": nnx.to_pure_dict(rest)}
    return from_apply(apply, variables, input_shape, name or type(model).__name__)


def _shape(input_shape, where: str) -> tuple:
    try:
        shape = tuple(int(d) for d in input_shape)
        if not shape or any(d < 1 for d in shape) or any(float(d) != int(d) for d in input_shape):
            raise ValueError
    except (TypeError, ValueError):
        raise ModelRefError(f"model {where!r}: input_shape must be positive integers without the batch "
                            f"dimension, e.g. (32, 32, 3), got {input_shape!r}") from None
    return shape


def load_params(path: str):
    """A parameter pytree from a .npz file (keys "a/b/c" -> nested dicts) or an orbax checkpoint directory."""
    if os.path.isdir(path):
        try:
            import orbax.checkpoint as ocp
            return ocp.PyTreeCheckpointer().restore(os.path.abspath(path))
        except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged or foreign directory
            raise ModelRefError(f"cannot read the orbax checkpoint {path!r}: {_one_line(e)}") from None
    if not os.path.isfile(path):
        raise ModelRefError(f"parameter file {path!r} does not exist (expected a .npz file or an orbax "
                            "checkpoint directory)")
    try:
        from jmsnas.run.directory import unflatten
        with np.load(path, allow_pickle=False) as z:
            return unflatten({k: np.asarray(z[k]) for k in z.files})
    except Exception as e:  # noqa: BLE001 - a damaged zip raises BadZipFile, ValueError, EOFError, ...
        raise ModelRefError(f"cannot read parameter file {path!r} as .npz: {_one_line(e)}") from None


def save_params(params, path: str) -> None:
    """Writes a parameter pytree of nested dicts as a .npz with "a/b/c" keys (the inverse of ``load_params``)."""
    flat = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        flat["/".join(_key(k) for k in kp)] = np.asarray(leaf)
    np.savez(path, **flat)


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_names(params) -> list:
    """"a/b/c" path of every leaf of ``params`` in ``jax.tree_util`` flattening order."""
    return ["/".join(_key(k) for k in kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def counted(params) -> list:
    """Per leaf (flattening order): True when it counts as a parameter (see the module docstring)."""
    names = leaf_names(params)
    if isinstance(params, dict) and "params" in params and len(params) > 1:
        return [n.split("/", 1)[0] == "params" for n in names]
    return [True] * len(names)


def _import(module: str, ref: str):
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise ModelRefError(f"model {ref!r}: file {module!r} does not exist")
        name = "_jmsnas_model_" + os.path.splitext(os.path.basename(module))[0]
        spec = importlib.util.spec_from_file_location(name, module)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's module raises, an exit too
            raise ModelRefError(f"model {ref!r}: importing {module!r} raised {_one_line(e)}") from None
        return mod
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.split(".")[0] == e.name.split(".")[0] or e.name == module:
            raise ModelRefError(f"model {ref!r}: module {module!r} not found (expected an importable module, "
                                "e.g. pkg.module:factory, or path/to/file.py:factory)") from None
        raise ModelRefError(f"model {ref!r}: importing {module!r} raised {_one_line(e)}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() at import is a failing module too
        raise ModelRefError(f"model {ref!r}: importing {module!r} raised {_one_line(e)}") from None
    finally:
        if added and sys.path and sys.path[0] == os.getcwd():
            sys.path.pop(0)


def resolve(ref) -> UserModel:
    """The ``UserModel`` a reference names (a ``UserModel`` is returned unchanged); ModelRefError if not."""
    if isinstance(ref, UserModel):
        return ref
    if not is_reference(ref):
        raise ModelRefError(f"model reference {ref!r} must be module:factory or file.py:factory")
    module, fn_name = ref.split(":")
    mod = _import(module, ref)
    factory = getattr(mod, fn_name, None)
    if not callable(factory):
        raise ModelRefError(f"model {ref!r}: {module!r} has no function {fn_name!r}")
    try:
        made = factory()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's factory raises, an exit too
        raise ModelRefError(f"model {ref!r}: the factory raised {_one_line(e)}") from None
    if isinstance(made, UserModel):
        return made._replace(input_shape=_shape(made.input_shape, ref))
    if not (isinstance(made, tuple) and len(made) == 3 and callable(made[0])):
        raise ModelRefError(f"model {ref!r}: the factory returned {type(made).__name__}; expected a UserModel or "
                            "(apply, params or a path to them, input_shape)")
    return from_apply(made[0], made[1], _shape(made[2], ref), name=fn_name)
