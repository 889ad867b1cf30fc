"""Calling an amp function: its arguments, their cache key, and the trace cache.

A `Call` is one call's ``(args, kwargs)`` flattened into leaves: the arrays
are traced, every other leaf (a string, a callable, ``None``, a Python
scalar, a plain object) is passed as a static value, as it would be without
``amp``. `Call.key` is the `CallKey` a `TraceCache` keeps a trace under.
A plain object (not a pytree) that holds arrays, which a cached trace would
hold as stale constants, is refused (plain_objects.py); what the call
returns is returning.py's.

Why not leave the cache to ``jax.jit`` (as Equinox's ``filter_jit`` does):
amp evaluates its plan under the caller's trace on every call and stages out
no jit, so eager calls run op by op and ``grad``/``vmap`` see the rewritten
ops; and its key holds what jit does not know (the caller's
``full_precision`` scope) or refuses (unhashable statics, plain objects keyed
by their attributes, such as a ``training`` flag).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from amp_jax._src import backends, compat, nnx_nodes

T = TypeVar("T")


def is_dynamic(leaf: object) -> bool:
    """Whether an argument leaf is traced (an array, a token) rather than passed
    as a static value."""
    return isinstance(
        leaf, (jax.Array, np.ndarray, np.generic, compat.Tracer, compat.Token, compat.Ref)
    ) or nnx_nodes.is_hijax(leaf)


def apply(fn: Callable[..., Any], *args: object, **kwargs: object) -> Any:
    """``fn(*args, **kwargs)``: what amp traces for ``amp(model)``, the model an argument."""
    return fn(*args, **kwargs)


def is_tree(fn: object) -> bool:
    """Whether ``fn`` is a pytree with children (an Equinox or NNX module), not a leaf."""
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(fn))


def fn_name(fn: object) -> str:
    """The name amp gives ``fn`` in its errors."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """``inspect.signature(fn)``, or None when it has none."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def param_names(fn: Callable[..., Any]) -> list[str]:
    """The names of ``fn``'s parameters (none when it has no signature)."""
    sig = signature(fn)
    return [] if sig is None else list(sig.parameters)


def name_like(wrapper: Any, fn: Callable[..., Any], self_first: bool = False) -> None:
    """Gives ``wrapper`` the name, source line and signature of ``fn`` (JAX's
    errors read them through ``__wrapped__``); with ``self_first``, a first
    parameter ``self`` (the model of ``amp(model)``)."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    for attr in ("__name__", "__qualname__", "__module__"):
        value = getattr(target, attr, None)
        if isinstance(value, str):
            setattr(wrapper, attr, value)
    wrapper.__wrapped__ = fn
    sig = signature(fn) if self_first else None
    if sig is not None:
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        wrapper.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])


# -- static keys ---------------------------------------------------------------------


def static_key(leaf: object, depth: int = 4) -> Hashable:
    """A hashable key of a static leaf; ``TypeError`` when there is none (then
    every call traces). A plain object is keyed by identity and attributes."""
    # (repr tells 0.0 from -0.0 and one NaN from another, which compare equal
    # or unequal the wrong way for a cache)
    if isinstance(leaf, (float, complex)):
        return (type(leaf), repr(leaf))
    if isinstance(leaf, types.MethodType):  # a bound method: its object's state too
        return (types.MethodType, leaf.__func__, static_key(leaf.__self__, depth))
    if _compares_by_identity(leaf):
        # A plain object (``self`` of a method, a config object) hashes by
        # identity: key it by its attributes too, so that ``net.training =
        # False`` makes a new trace rather than reusing the old one.
        if depth == 0:
            raise TypeError("too deep to key")  # (trace every call)
        # (dunder attributes are a wrapper's metadata -- ``functools.wraps``
        # copies ``__annotations__``, ``__wrapped__``, ``__doc__`` onto
        # ``jax.jit``'s function -- not state that changes what tracing gives)
        attrs = {k: v for k, v in instance_attrs(leaf).items() if not _is_dunder(k)}
        return (type(leaf), leaf, tuple((k, static_key(v, depth - 1)) for k, v in attrs.items()))
    return (type(leaf), leaf)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _compares_by_identity(obj: object) -> bool:
    t = type(obj)
    return (
        t.__hash__ is object.__hash__
        and t.__eq__ is object.__eq__
        and not isinstance(obj, (type, types.ModuleType, types.FunctionType))
        and (hasattr(obj, "__dict__") or bool(getattr(t, "__slots__", ())))
    )


def instance_attrs(obj: object) -> dict[str, Any]:
    """The instance attributes of ``obj`` (``__dict__`` and ``__slots__``)."""
    attrs: dict[str, Any] = {}
    try:
        attrs.update(vars(obj))
    except TypeError:
        pass
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            attrs[name] = getattr(obj, name)
    return attrs


@dataclasses.dataclass(frozen=True)
class CallKey:
    """What a trace is cached under: everything that can change what tracing gives.

    Attributes:
      fn: the static key of the function (a callable object's attributes:
        a training flag); None for ``amp(model)``, whose model is an argument.
      treedef: the structure of ``(args, kwargs)``.
      dynamic_mask: which leaves are traced.
      leaves: the abstract type of each traced leaf, the static key of the others.
      backend: the `Backend` record planned for (``backends.current()``: the
        default backend's, or one a test injected).
      trace_context: what makes ``jax.jit`` retrace (config contexts, named
        axes and their sizes, the mesh).
      full_precision: whether the caller is inside a ``full_precision`` scope.
      aliases: the Flax NNX nodes the arguments share (``nnx_nodes.aliases``):
        a call with tied weights traces apart from one without.
    """

    fn: Hashable
    treedef: compat.PyTreeDef
    dynamic_mask: tuple[bool, ...]
    leaves: tuple[Hashable, ...]
    backend: backends.Backend
    trace_context: Hashable
    full_precision: bool
    aliases: nnx_nodes.Aliases = ()


# -- one call ------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class _Static:
    """A static leaf inside the argument tree given to the tracer: no children."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], _Aux]:
        return (), _Aux(self.value)

    @classmethod
    def tree_unflatten(cls, aux: _Aux, children: Sequence[object]) -> _Static:
        return cls(aux.value)


class _Aux:
    """Aux data that compares by identity of its value (statics may be unhashable)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Aux) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """One call ``target(*args, **kwargs)`` as amp traces it.

    Attributes:
      target: the function traced: the user's ``fn``, or `apply` for
        ``amp(model)`` (the model is then ``args[0]``, so its arrays are traced).
      args: the positional arguments (with the model first for `apply`).
      kwargs: the keyword arguments.
      leaves: the leaves of ``(args, kwargs)``.
      treedef: their structure.
      dynamic_mask: which leaves are traced (`is_dynamic`).
      names: the positional parameters' names, to name an argument in errors.
      aliases: the Flax NNX nodes held at several paths of ``(args, kwargs)``
        (a pytree flatten copies them once per path; the trace ties them).
    """

    target: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[Any]
    treedef: compat.PyTreeDef
    dynamic_mask: tuple[bool, ...]
    names: tuple[str, ...]
    aliases: nnx_nodes.Aliases = ()

    @classmethod
    def of(cls, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The call ``fn(*args, **kwargs)``; a pytree ``fn`` (an Equinox or NNX
        module) becomes the first argument ``self`` of `apply`."""
        if is_tree(fn):
            target, args, names = apply, (fn, *args), ("self", *param_names(fn))
        else:
            target, names = fn, tuple(param_names(fn))
        leaves, treedef = jax.tree.flatten((args, kwargs))
        mask = tuple(is_dynamic(x) for x in leaves)
        # (a node held at two paths repeats its arrays among the leaves: the
        # walk for shared nodes, a Python call per node, only then)
        arrays = [id(x) for x, d in zip(leaves, mask) if d]
        shared = nnx_nodes.aliases((args, kwargs)) if len(set(arrays)) < len(arrays) else ()
        return cls(target, args, kwargs, leaves, treedef, mask, names, shared)

    @property
    def fn_is_argument(self) -> bool:
        """Whether the function is an argument (``amp(model)``), its arrays traced."""
        return self.target is apply

    @property
    def dynamic(self) -> list[Any]:
        """The traced leaves, in order (the jaxpr's inputs)."""
        return [x for x, d in zip(self.leaves, self.dynamic_mask) if d]

    def key(self, *, full_precision: bool, anchored: bool = False) -> CallKey | None:
        """The cache key of this call; None when a static leaf has none (it is
        unhashable): then every call traces. ``anchored``: the cache is keyed
        by the function (`shared_cache`), so the key leaves it out."""
        try:
            if self.fn_is_argument:
                fn_key: Hashable = None
            else:
                fn_key = anchored_key(self.target) if anchored else static_key(self.target)
            key = CallKey(
                fn=fn_key,
                treedef=self.treedef,
                dynamic_mask=self.dynamic_mask,
                leaves=tuple(
                    compat.abstract_key(x) if d else static_key(x)
                    for x, d in zip(self.leaves, self.dynamic_mask)
                ),
                backend=backends.current(),
                trace_context=compat.trace_context(),
                full_precision=full_precision,
                aliases=self.aliases,
            )
            hash(key)
        except TypeError:
            return None
        return key

    def abstract(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` to trace at: abstract values for the traced leaves,
        the others as childless pytree nodes (so the jaxpr's invars are the
        traced leaves, in order); `unwrap_statics` gives the values back."""
        abstract = [
            (x if nnx_nodes.is_hijax(x) else compat.abstractify(x)) if d else _Static(x)
            for x, d in zip(self.leaves, self.dynamic_mask)
        ]
        return jax.tree.unflatten(self.treedef, abstract)

    def arg_name(self, path: tuple[Any, ...]) -> str:
        """``path`` (a key path into ``(args, kwargs)``) as the user wrote the argument."""
        keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
        if not keys:
            return "?"
        rest = "".join(f"[{k!r}]" for k in keys[2:])
        if keys[0] == 1:
            return f"{keys[1]}{rest}"
        if keys[1] < len(self.names):
            return f"{self.names[keys[1]]}{rest}"
        return f"args[{keys[1]}]{rest}"

    def leaf_name(self, i: int) -> str:
        """The ``i``-th leaf of ``(args, kwargs)`` as the user wrote the argument."""
        paths = jax.tree_util.tree_flatten_with_path((self.args, self.kwargs))[0]
        return self.arg_name(paths[i][0])

    def path_name(self, path: tuple[Any, ...]) -> str:
        """``path`` (a key path into ``(args, kwargs)``) as the user would write it."""
        if len(path) < 2:
            return "?"
        return f"{self.arg_name(path[:2])}{jax.tree_util.keystr(tuple(path[2:]))}"


def unwrap_statics(tree: object) -> Any:
    """``tree`` (from `Call.abstract`, traced) with its static leaves' values."""
    return jax.tree.map(
        lambda x: x.value if isinstance(x, _Static) else x,
        tree,
        is_leaf=lambda x: isinstance(x, _Static),
    )


# -- the trace cache -----------------------------------------------------------------


class TraceCache(Generic[T]):
    """The traces of an amp function by `CallKey`, least recently used dropped
    beyond ``size``; shared by the copies JAX makes of the function (as a
    pytree, ``amp(model)`` is rebuilt by ``jax.tree.map``, Equinox and NNX).

    Attributes:
      entries: the traces, least recently used first.
      trace_count: how many times the function was traced.
    """

    __slots__ = ("entries", "lock", "trace_count")

    def __init__(self) -> None:
        self.entries: OrderedDict[CallKey, T] = OrderedDict()
        self.lock = threading.Lock()
        self.trace_count = 0

    def get(self, key: CallKey | None) -> T | None:
        """The trace kept under ``key`` (now the most recently used), or None."""
        if key is None:
            return None
        with self.lock:
            found = self.entries.get(key)
            if found is not None:
                self.entries.move_to_end(key)
            return found

    def put(self, key: CallKey | None, value: T, size: int) -> None:
        """Keeps ``value`` under ``key`` (not when None), at most ``size`` entries."""
        if key is None:
            return
        with self.lock:
            self.entries[key] = value
            while len(self.entries) > size:
                self.entries.popitem(last=False)


#: the trace caches of amp functions of a pytree ``fn`` (a module), by its structure
#: and the options: least recently used dropped beyond `_MAX_STRUCTURES`
_BY_STRUCTURE: OrderedDict[Hashable, TraceCache[Any]] = OrderedDict()
_MAX_STRUCTURES = 32
#: the trace caches of amp functions of a plain callable, while it (a bound
#: method's object) lives, by the options
_BY_FUNCTION: weakref.WeakKeyDictionary[Any, dict[Hashable, TraceCache[Any]]] = (
    weakref.WeakKeyDictionary()
)
_REGISTRY_LOCK = threading.Lock()


def shared_cache(fn: Callable[..., Any], options: Hashable) -> tuple[TraceCache[Any], bool]:
    """The trace cache that every ``amp(fn)`` with an equal ``fn`` and equal
    ``options`` (policy, cache size) shares, so that a fresh ``amp(model)``
    made in a training loop (``eqx.filter_jit(amp(model))``, ``jax.jit(amp(f))``)
    finds the traces of the last one, and the two are equal pytrees; and
    whether it is keyed by ``fn`` itself (then `Call.key` leaves ``fn``'s
    identity out of its keys, which would keep ``fn`` alive).

    A pytree ``fn`` (an Equinox or NNX module) is keyed by its structure: its
    arrays are arguments of the trace, its static fields part of the
    structure, as `CallKey` keys them. A plain callable is keyed by itself, a
    bound method by its object (weakly: the cache lives as long as it
    does). A ``fn`` that is neither hashable nor weakly referable gets a
    cache of its own.
    """
    if is_tree(fn):
        key = (jax.tree.structure(fn), options)
        try:
            hash(key)
        except TypeError:  # (a static field that is not hashable)
            return TraceCache(), False
        with _REGISTRY_LOCK:
            found = _BY_STRUCTURE.get(key)
            if found is None:
                found = _BY_STRUCTURE[key] = TraceCache()
                while len(_BY_STRUCTURE) > _MAX_STRUCTURES:
                    _BY_STRUCTURE.popitem(last=False)
            _BY_STRUCTURE.move_to_end(key)
            return found, False
    owner: object = fn
    sub: Hashable = options
    if isinstance(fn, types.MethodType):
        owner, sub = fn.__self__, (fn.__func__, options)
    try:
        with _REGISTRY_LOCK:
            caches = _BY_FUNCTION.setdefault(owner, {})
            return caches.setdefault(sub, TraceCache()), True
    except TypeError:  # (not hashable, or no weak reference to it)
        return TraceCache(), False


def anchored_key(fn: Callable[..., Any]) -> Hashable:
    """`static_key` of ``fn`` without ``fn`` itself (a bound method's object),
    for a trace cache that `shared_cache` keyed by it: its state (a callable
    object's attributes, a ``training`` flag) and nothing that would keep it
    alive. A function's key is None (it is keyed by identity alone)."""
    if isinstance(fn, types.MethodType):
        return (types.MethodType, fn.__func__, _state_key(fn.__self__))
    return _state_key(fn)


def _state_key(obj: object) -> Hashable:
    if isinstance(obj, types.FunctionType):
        return None
    if not _compares_by_identity(obj):
        return (type(obj),)  # (its value keys its cache)
    attrs = {k: v for k, v in instance_attrs(obj).items() if not _is_dunder(k)}
    return (type(obj), tuple((k, static_key(v, 3)) for k, v in attrs.items()))
