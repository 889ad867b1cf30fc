"""Plain objects (not pytrees) that hold arrays, refused where amp would keep them.

amp passes a leaf that is not an array as a static value and keys its trace
cache by it (calling.py): a plain object that holds arrays, as the function
or an argument, would have those arrays baked into the cached trace as stale
constants (`check_arguments`), and one that ``fn`` assigns an array to while
amp traces it would keep a tracer (`check_no_leak`). `held_array` finds such
an array, to name it in the refusal.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import numpy as np

from amp_jax._src.calling import Call, TraceCache, fn_name, instance_attrs, is_dynamic

_VALUE_TYPES = (str, bytes, int, float, complex, bool, type(None), type, np.dtype, range, slice)


def held_array(obj: object, seen: set[int] | None = None) -> str | None:
    """The attribute path of a jax/NumPy array held by the plain object ``obj``, or None.

    Followed to any depth, through attributes, ``functools.partial`` and bound
    methods, and every container (lists, dicts, sets, ``collections.deque``).
    """
    seen = set() if seen is None else seen
    if isinstance(obj, _VALUE_TYPES) or isinstance(obj, types.ModuleType) or id(obj) in seen:
        return None
    if isinstance(obj, TraceCache):
        # amp's own trace cache (of an amp function passed as an argument, or
        # jitted): its traces hold constants of amp's making, not user state
        return None
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        return None
    seen.add(id(obj))
    if is_dynamic(obj):  # (a NumPy array of objects, e.g. a Mesh's devices, is no array)
        return None if isinstance(obj, np.ndarray) and obj.dtype.kind == "O" else ""
    if isinstance(obj, types.MethodType):
        inner = held_array(obj.__self__, seen)
        return None if inner is None else f".__self__{inner}"
    if isinstance(obj, functools.partial):
        items = [(f".args[{i}]", a) for i, a in enumerate(obj.args)]
        items += [(f".keywords[{k!r}]", a) for k, a in obj.keywords.items()]
    elif isinstance(obj, Mapping):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, Collection) and not isinstance(obj, np.ndarray):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    else:
        items = [(f".{k}", v) for k, v in instance_attrs(obj).items()]
    for where, value in items:
        if (inner := held_array(value, seen)) is not None:
            return f"{where}{inner}"
    return None


def held_by_fn(fn: Callable[..., Any]) -> str | None:
    """The path (under ``fn``) of an array that the callable ``fn`` holds, or
    None. A ``functools.partial`` holds none that matter: its arguments cannot
    be rebound, so the arrays bound in it (at any depth: a list of
    parameters, the ``ClosedJaxpr`` of ``jax.core.jaxpr_as_fun``) are
    constants of the trace, as a closure's are, and under ``jax.jit``; the
    trace is kept for that partial (`calling.static_key` keys it by identity)."""
    if type(fn) is functools.partial:
        return None
    return held_array(fn)


def check_arguments(fn: Callable[..., Any], call: Call) -> None:
    """Refuses a callable ``fn`` or a static argument that is a plain (non-pytree)
    object holding arrays: amp would bake the arrays into its cached trace."""
    if not call.fn_is_argument and (held := held_by_fn(fn)) is not None:
        kind = type(fn).__name__
        raise TypeError(
            f"amp({fn_name(fn)}): the function is a {kind} that holds arrays "
            f"(`fn{held}`) but is not a pytree, so amp would bake them into its cached "
            "trace and return stale results once they change. Pass a pytree (an "
            "equinox.Module or Flax NNX Module as amp(model), a registered class), or "
            "pass the arrays as arguments."
        )
    paths = jax.tree_util.tree_flatten_with_path((call.args, call.kwargs))[0]
    for (path, leaf), dyn in zip(paths, call.dynamic_mask):
        held = None if dyn else held_by_fn(leaf) if callable(leaf) else held_array(leaf)
        if held is None:
            continue
        name = call.arg_name(path)
        kind = type(leaf).__name__
        raise TypeError(
            f"amp({fn_name(fn)}): argument `{name}` is a {kind} that holds arrays "
            f"(`{name}{held}`) but is not a pytree, so amp would bake them into its cached "
            f"trace and return stale results once they change. Make {kind} a pytree "
            "(jax.tree_util.register_dataclass or register_pytree_node_class, an "
            "equinox.Module, a flax.struct.dataclass), or pass the arrays as arguments. "
            "(jax.jit refuses this argument too.)"
        )


def check_no_leak(fn: Callable[..., Any], call: Call) -> None:
    """Refuses an array that ``fn`` assigned, while amp traced it, to a plain
    object (not a pytree) among its static arguments or its ``self``: the
    object would keep a tracer of amp's trace and the caller would never see
    the value.

    Reads the static leaves `Call.of` found before ``fn`` ran (the same
    objects ``fn`` was given), without flattening the arguments again: a
    pytree that ``fn`` consumed may refuse to be flattened twice (Equinox's
    ``State`` once a stateful layer has used it).
    """
    where = None
    for i, (leaf, dyn) in enumerate(zip(call.leaves, call.dynamic_mask)):
        held = None if dyn else held_by_fn(leaf) if callable(leaf) else held_array(leaf)
        if held is not None:
            where, kind = f"{call.leaf_name(i)}{held}", type(leaf).__name__
            break
    if where is None and not call.fn_is_argument and (held := held_by_fn(fn)) is not None:
        where, kind = f"fn{held}", type(fn).__name__
    if where is not None:
        raise TypeError(
            f"amp({fn_name(fn)}): the function assigned an array to `{where}`, "
            f"inside a {kind} that is not a pytree. amp runs the function in a trace, so "
            "the object would keep a tracer that is invalid once the trace ends, and the "
            f"caller would never see the value. Return the value from the function, or "
            f"make {kind} a pytree (jax.tree_util.register_dataclass, an equinox.Module, "
            "a Flax NNX Module whose Variables amp writes back)."
        )
