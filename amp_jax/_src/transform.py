"""``amp`` and ``full_precision``: the user-facing transformations."""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import numpy as np

from amp_jax._src import compat
from amp_jax._src.interpreter import Context, evaluate, plan
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, get_policy, scope_in

F = TypeVar("F", bound=Callable[..., Any])

_CACHE_SIZE = 64


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, compat.Tracer))


def _static_key(leaf: Any) -> Any:
    # (repr tells 0.0 from -0.0 and one NaN from another, which compare equal
    # or unequal the wrong way for a cache)
    if isinstance(leaf, (float, complex)):
        return (type(leaf), repr(leaf))
    return (type(leaf), leaf)


_VALUE_TYPES = (str, bytes, int, float, complex, bool, type(None), type, np.dtype, range, slice)


def _held_array(obj: Any, depth: int = 3) -> str | None:
    """The attribute path of a jax/NumPy array held by the plain object ``obj``, or None."""
    if isinstance(obj, _VALUE_TYPES) or depth == 0 or isinstance(obj, types.ModuleType):
        return None
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        return None
    if isinstance(obj, types.MethodType):
        inner = _held_array(obj.__self__, depth - 1)
        return None if inner is None else f".__self__{inner}"
    if isinstance(obj, functools.partial):
        for i, a in enumerate((*obj.args, *obj.keywords.values())):
            if any(_is_dynamic(x) for x in jax.tree.leaves(a)):
                return f".args[{i}]"
            if (inner := _held_array(a, depth - 1)) is not None:
                return f".args[{i}]{inner}"
        return None
    attrs: dict[str, Any] = {}
    try:
        attrs.update(vars(obj))
    except TypeError:
        pass
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            attrs[name] = getattr(obj, name)
    for name, value in attrs.items():
        if isinstance(value, (list, tuple, dict)):
            if any(_is_dynamic(x) for x in jax.tree.leaves(value)):
                return f".{name}"
        elif _is_dynamic(value):
            return f".{name}"
        elif not isinstance(value, type) and (inner := _held_array(value, depth - 1)) is not None:
            return f".{name}{inner}"
    return None


def _arg_name(fn: Any, path: tuple[Any, ...]) -> str:
    """``path`` (into ``(args, kwargs)``) as the user wrote the argument."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if not keys:
        return "?"
    rest = "".join(f"[{k!r}]" for k in keys[2:])
    if keys[0] == 1:
        return f"{keys[1]}{rest}"
    try:
        params = list(inspect.signature(fn).parameters)
        return f"{params[keys[1]]}{rest}"
    except (TypeError, ValueError, IndexError):
        return f"args[{keys[1]}]{rest}"


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


@jax.tree_util.register_pytree_node_class
class _Static:
    """A static leaf inside the argument tree given to the tracer: no children."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self):
        return (), _Aux(self.value)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux.value)


class _Aux:
    """Aux data that compares by identity of its value (statics may be unhashable)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Aux) and other.value is self.value

    def __hash__(self):
        return id(self.value)


def _unwrap_statics(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.value if isinstance(x, _Static) else x,
        tree,
        is_leaf=lambda x: isinstance(x, _Static),
    )


def _name_like(wrapper: Any, fn: Any) -> None:
    """Gives ``wrapper`` the name, source line and signature of ``fn`` (JAX's
    errors read them through ``__wrapped__``)."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    for attr in ("__name__", "__qualname__", "__module__"):
        value = getattr(target, attr, None)
        if isinstance(value, str):
            setattr(wrapper, attr, value)
    wrapper.__wrapped__ = fn


def _as_output(x: Any) -> Any:
    """A returned constant (a Python ``3``, a NumPy array) as a jax Array, like jit."""
    if isinstance(x, (jax.Array, compat.Tracer)):
        return x
    for t in (bool, int, float, complex):  # weakly typed, as jit returns them
        if isinstance(x, t):
            return jax.numpy.asarray(t(x))
    return jax.numpy.asarray(x, dtype=getattr(x, "dtype", None))


class _Traced:
    """The plan of the traced jaxpr of one input signature, and its context."""

    __slots__ = ("plan", "out_tree", "ctx")

    def __init__(self, plan, out_tree, ctx):
        self.plan, self.out_tree, self.ctx = plan, out_tree, ctx


class AmpFunction:
    """The callable returned by :func:`amp`; also exposes its trace cache."""

    def __init__(self, fn: Callable[..., Any], policy: Policy, cache_size: int = _CACHE_SIZE):
        self.fn = fn
        self.policy = policy
        self.cache_size = cache_size
        self._cache: OrderedDict[Any, _Traced] = OrderedDict()
        self._lock = threading.Lock()
        #: number of times ``fn`` was traced (cache misses); for tests/inspection.
        self.trace_count = 0
        self._scopes = (FULL_PRECISION_SCOPE, *policy.full_precision_scopes)
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"amp({getattr(self.fn, '__qualname__', self.fn)!r}, policy={self.policy.compute_dtype.name!r})"

    def __get__(self, obj, objtype=None):  # behave like a function as a method
        return self if obj is None else functools.partial(self, obj)

    def _check_static(self, args, kwargs, leaves, dyn_mask) -> None:
        """Refuses plain (non-pytree) objects that hold arrays: amp would bake
        the arrays into its cached trace, as constants."""
        for (path, leaf), dyn in zip(
            jax.tree_util.tree_flatten_with_path((args, kwargs))[0], dyn_mask
        ):
            held = None if dyn else _held_array(leaf)
            if held is None:
                continue
            name = _arg_name(self.fn, path)
            kind = type(leaf).__name__
            raise TypeError(
                f"amp({_fn_name(self.fn)}): argument `{name}` is a {kind} that holds arrays "
                f"(`{name}{held}`) but is not a pytree, so amp would bake them into its cached "
                f"trace and return stale results once they change. Make {kind} a pytree "
                "(jax.tree_util.register_dataclass or register_pytree_node_class, an "
                "equinox.Module, a flax.struct.dataclass), or pass the arrays as arguments. "
                "(jax.jit refuses this argument too.)"
            )

    def _trace(self, treedef, leaves, dyn_mask) -> _Traced:
        # Trace a function with the user's name, source line and signature
        # (through __wrapped__), so that JAX's errors name them and the
        # arguments as jax.jit does; static leaves travel as childless pytree
        # nodes, so the jaxpr's invars are the dynamic leaves, in order.
        abstract = [compat.abstractify(x) if d else _Static(x) for x, d in zip(leaves, dyn_mask)]
        t_args, t_kwargs = jax.tree.unflatten(treedef, abstract)

        def traced_fn(*args, **kwargs):
            args, kwargs = _unwrap_statics((args, kwargs))
            return self.fn(*args, **kwargs)

        _name_like(traced_fn, self.fn)
        closed, out_shape = compat.trace_with_shape_kw(traced_fn, t_args, t_kwargs)
        if len(compat.in_avals(closed)) != sum(dyn_mask):  # pragma: no cover
            raise AssertionError("amp_jax: traced arguments do not match; please report this.")
        self.trace_count += 1
        out_tree = jax.tree.structure(out_shape)
        ctx = Context(self.policy, jax.default_backend())
        return _Traced(plan(ctx, closed), out_tree, ctx)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn_mask = tuple(_is_dynamic(x) for x in leaves)
        key = None
        try:
            key = (
                treedef,
                dyn_mask,
                tuple(
                    compat.abstract_key(x) if d else _static_key(x)
                    for x, d in zip(leaves, dyn_mask)
                ),
                jax.default_backend(),
                # (what makes jax.jit retrace: config contexts, named axes and
                # their sizes, the mesh; and whether the caller is in a
                # full_precision scope)
                compat.trace_context(),
                scope_in(compat.current_name_stack_str(), self._scopes) is not None,
            )
            hash(key)
        except TypeError:  # an unhashable static leaf: trace every call
            key = None
        traced = None
        if key is not None:
            with self._lock:
                traced = self._cache.get(key)
                if traced is not None:
                    self._cache.move_to_end(key)
        if traced is None:
            self._check_static(args, kwargs, leaves, dyn_mask)
            traced = self._trace(treedef, leaves, dyn_mask)
            # A jaxpr that captured tracers of an enclosing transformation is
            # only valid inside that transformation: don't cache it.
            if key is not None and not any(
                isinstance(c, compat.Tracer) for c in compat.consts_of(traced.plan.closed)
            ):
                with self._lock:
                    self._cache[key] = traced
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        dyn = [x for x, d in zip(leaves, dyn_mask) if d]
        outs = evaluate(traced.ctx, traced.plan, dyn)
        return jax.tree.unflatten(traced.out_tree, [_as_output(o) for o in outs])


@overload
def amp(
    fn: F,
    *,
    policy: Policy | str | Any = "bfloat16",
    strict: bool | None = None,
    cache_size: int = _CACHE_SIZE,
) -> F: ...
@overload
def amp(
    fn: None = None,
    *,
    policy: Policy | str | Any = "bfloat16",
    strict: bool | None = None,
    cache_size: int = _CACHE_SIZE,
) -> Callable[[F], F]: ...


def amp(fn=None, *, policy="bfloat16", strict=None, cache_size=_CACHE_SIZE):
    """Automatic mixed precision: runs ``fn`` with its primitives recast by ``policy``.

    ``amp`` traces ``fn`` to a jaxpr once per input signature, decides for
    every primitive whether it runs in the compute dtype (matmuls,
    convolutions and the elementwise ops between them), in float32
    (exp/log/pow, accumulating reductions, normalisation statistics, losses)
    or in its original dtypes, and evaluates the result under the caller's
    trace -- so ``jit``, ``grad``, ``vmap`` and friends compose with it. The
    policy applies inside every higher-order primitive (``jit``, ``cond``,
    ``while``, ``scan``, ``checkpoint``, ``custom_jvp``/``custom_vjp``,
    ``shard_map``). Outputs keep the dtypes ``fn`` returns; under ``jax.grad``
    gradients come back in the parameters' dtypes, and the backward matmuls
    and convolutions also run with compute-dtype operands.

    Args:
      fn: the function to transform. Array leaves of its arguments (any
        pytree, positional or keyword) are traced; other leaves (strings,
        callables, ``None``, Python scalars) are passed through as static
        values, as they would be without ``amp``, and are part of the trace
        cache key. A plain object (not a pytree) that holds arrays is refused
        with a ``TypeError``, as ``jax.jit`` refuses it: amp would bake the
        arrays into its cached trace.
      policy: a :class:`Policy`, a preset name (``"bfloat16"``,
        ``"float16"``, ``"float32"``) or a dtype. ``"float32"`` is the
        identity: bitwise the same results and gradients as ``fn``.
      strict: if true, a primitive that is in no class of the policy raises
        ``NotImplementedError`` naming it (default: treat it as ``follow``).
        Overrides ``policy.strict`` when given.
      cache_size: how many input signatures keep their trace (an LRU,
        default 64); a program that cycles through more shapes retraces.

    Returns:
      A function with the signature and output structure of ``fn``. It can
      be used as ``@amp``, ``@amp(policy=...)`` or ``amp(fn, policy=...)``.

    Raises:
      TypeError: ``fn`` is not callable.
      ValueError: ``policy`` is not a known preset, Policy or float dtype,
        or ``cache_size`` is not an int >= 1.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from amp_jax import amp
      >>> @amp
      ... def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> jax.grad(loss)(w, x).dtype
      dtype('float32')
    """
    pol = get_policy(policy)
    if strict is not None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {strict!r}.")
        pol = pol.replace(strict=strict)
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise ValueError(
            f"amp(cache_size={cache_size!r}) must be an int >= 1 (default {_CACHE_SIZE})."
        )
    if fn is None:
        return functools.partial(amp, policy=pol, cache_size=cache_size)
    if not callable(fn):
        raise TypeError(
            f"amp(fn) needs a callable, got {type(fn).__name__}: {fn!r}. "
            "Use @amp or amp(fn, policy=...) on a function."
        )
    return AmpFunction(fn, pol, cache_size)


def full_precision(fn: F | None = None) -> F:
    """Marks ``fn`` to run in its original precision under :func:`amp`.

    The equivalent of ``torch.autocast(enabled=False)``: every primitive traced
    while ``fn`` runs (including its backward, and anything nested in ``jit``,
    ``scan`` etc.) keeps its original dtypes. It works through a
    ``jax.named_scope`` called ``"amp_full_precision"``; outside ``amp`` it
    changes nothing. Also usable as a decorator.

    Args:
      fn: the function to keep in full precision.

    Returns:
      The wrapped function.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import amp, full_precision
      >>> @full_precision
      ... def sensitive(a, b):
      ...     return a @ b
      >>> amp(lambda a, b: sensitive(a, b) + (a @ b))(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype
      dtype('float32')
    """
    if fn is None:
        return full_precision
    if not callable(fn):
        raise TypeError(f"full_precision(fn) needs a callable, got {type(fn).__name__}: {fn!r}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return fn(*args, **kwargs)

    return wrapped
