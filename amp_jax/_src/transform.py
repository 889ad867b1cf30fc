"""``amp`` and ``full_precision``: the user-facing transformations."""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar, overload

import jax
import numpy as np

from amp_jax._src import compat, mutation
from amp_jax._src.interpreter import Interpreter, evaluate
from amp_jax._src.planning import plan
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, get_policy, scope_in

F = TypeVar("F", bound=Callable[..., Any])


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, compat.Tracer))


def _static_key(leaf: Any, depth: int = 4) -> Any:
    # (repr tells 0.0 from -0.0 and one NaN from another, which compare equal
    # or unequal the wrong way for a cache)
    if isinstance(leaf, (float, complex)):
        return (type(leaf), repr(leaf))
    if isinstance(leaf, types.MethodType):  # a bound method: its object's state too
        return (types.MethodType, leaf.__func__, _static_key(leaf.__self__, depth))
    if _compares_by_identity(leaf):
        # A plain object (``self`` of a method, a config object) hashes by
        # identity: key it by its attributes too, so that ``net.training =
        # False`` makes a new trace rather than reusing the old one.
        if depth == 0:
            raise TypeError("too deep to key")  # (trace every call)
        attrs = _attrs(leaf)
        return (type(leaf), leaf, tuple((k, _static_key(v, depth - 1)) for k, v in attrs.items()))
    return (type(leaf), leaf)


def _compares_by_identity(obj: Any) -> bool:
    t = type(obj)
    return (
        t.__hash__ is object.__hash__
        and t.__eq__ is object.__eq__
        and not isinstance(obj, (type, types.ModuleType, types.FunctionType))
        and (hasattr(obj, "__dict__") or bool(getattr(t, "__slots__", ())))
    )


def _attrs(obj: Any) -> dict[str, Any]:
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


_VALUE_TYPES = (str, bytes, int, float, complex, bool, type(None), type, np.dtype, range, slice)


def _held_array(obj: Any, seen: set[int] | None = None) -> str | None:
    """The attribute path of a jax/NumPy array held by the plain object ``obj``, or None.

    Followed to any depth, through attributes, ``functools.partial`` and bound
    methods, and every container (lists, dicts, sets, ``collections.deque``).
    """
    seen = set() if seen is None else seen
    if isinstance(obj, _VALUE_TYPES) or isinstance(obj, types.ModuleType) or id(obj) in seen:
        return None
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        return None
    seen.add(id(obj))
    if _is_dynamic(obj):  # (a NumPy array of objects, e.g. a Mesh's devices, is no array)
        return None if isinstance(obj, np.ndarray) and obj.dtype.kind == "O" else ""
    if isinstance(obj, types.MethodType):
        inner = _held_array(obj.__self__, seen)
        return None if inner is None else f".__self__{inner}"
    if isinstance(obj, functools.partial):
        items = [(f".args[{i}]", a) for i, a in enumerate(obj.args)]
        items += [(f".keywords[{k!r}]", a) for k, a in obj.keywords.items()]
    elif isinstance(obj, Mapping):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, Collection) and not isinstance(obj, np.ndarray):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    else:
        items = [(f".{k}", v) for k, v in _attrs(obj).items()]
    for where, value in items:
        if (inner := _held_array(value, seen)) is not None:
            return f"{where}{inner}"
    return None


def _arg_name(names: list[str], path: tuple[Any, ...]) -> str:
    """``path`` (into ``(args, kwargs)``) as the user wrote the argument;
    ``names`` are the positional parameters' names."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if not keys:
        return "?"
    rest = "".join(f"[{k!r}]" for k in keys[2:])
    if keys[0] == 1:
        return f"{keys[1]}{rest}"
    if keys[1] < len(names):
        return f"{names[keys[1]]}{rest}"
    return f"args[{keys[1]}]{rest}"


def _path_name(names: list[str], path: tuple[Any, ...]) -> str:
    """``path`` (a key path into ``(args, kwargs)``) as the user would write it."""
    if len(path) < 2:
        return "?"
    top = path[:2]
    rest = jax.tree_util.keystr(tuple(path[2:]))
    return f"{_arg_name(names, top)}{rest}"


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
    """The plan of the traced jaxpr of one input signature, its context, and
    what the function writes into its arguments (their values are the
    jaxpr's last outputs)."""

    __slots__ = ("plan", "out_tree", "ctx", "writes")

    def __init__(self, plan, out_tree, ctx, writes=None):
        self.plan, self.out_tree, self.ctx = plan, out_tree, ctx
        self.writes: mutation.Writes | None = writes


class _Shared:
    """The trace cache of an amp function, shared by the copies JAX makes of it
    (as a pytree, ``amp(model)`` is rebuilt by ``jax.tree.map``, Equinox and NNX)."""

    __slots__ = ("cache", "lock", "trace_count")

    def __init__(self):
        self.cache: OrderedDict[Any, _Traced] = OrderedDict()
        self.lock = threading.Lock()
        self.trace_count = 0


def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


@jax.tree_util.register_pytree_with_keys_class
class AmpFunction:
    """The callable returned by [`amp`][amp_jax.amp]; also exposes its trace cache.

    A pytree whose one child is ``fn``: ``amp(model)`` of an Equinox or Flax
    NNX module holds the model's arrays, so ``eqx.filter_grad``,
    ``nnx.grad`` and ``jax.tree`` functions see them (as with
    ``eqx.filter_jit(model)``), and each call traces them as arguments.
    """

    def __init__(self, fn: Callable[..., Any], policy: Policy, cache_size: int = 64):
        self.fn = fn
        self.policy = policy
        self.cache_size = cache_size
        self._shared = _Shared()
        self._scopes = (FULL_PRECISION_SCOPE, *policy.full_precision_scopes)
        # (a pytree fn's __dict__ holds its arrays: not copied, they would go stale)
        functools.update_wrapper(self, fn, updated=() if _is_tree(fn) else ("__dict__",))

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("fn"), self.fn),), (
            self.policy,
            self.cache_size,
            self._shared,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        new = cls.__new__(cls)
        new.policy, new.cache_size, new._shared = aux
        new.fn = children[0]
        new._scopes = (FULL_PRECISION_SCOPE, *new.policy.full_precision_scopes)
        functools.update_wrapper(new, new.fn, updated=())
        return new

    @property
    def _cache(self) -> OrderedDict[Any, _Traced]:
        return self._shared.cache

    @property
    def trace_count(self) -> int:
        """Number of times ``fn`` was traced (cache misses); for tests/inspection."""
        return self._shared.trace_count

    def __repr__(self) -> str:
        return f"amp({getattr(self.fn, '__qualname__', self.fn)!r}, policy={self.policy.compute_dtype.name!r})"

    def __get__(self, obj, objtype=None):  # behave like a function as a method
        return self if obj is None else functools.partial(self, obj)

    def _check_static(self, args, kwargs, leaves, dyn_mask, names) -> None:
        """Refuses plain (non-pytree) objects that hold arrays: amp would bake
        the arrays into its cached trace, as constants."""
        for (path, leaf), dyn in zip(
            jax.tree_util.tree_flatten_with_path((args, kwargs))[0], dyn_mask
        ):
            held = None if dyn else _held_array(leaf)
            if held is None:
                continue
            name = _arg_name(names, path)
            kind = type(leaf).__name__
            raise TypeError(
                f"amp({_fn_name(self.fn)}): argument `{name}` is a {kind} that holds arrays "
                f"(`{name}{held}`) but is not a pytree, so amp would bake them into its cached "
                f"trace and return stale results once they change. Make {kind} a pytree "
                "(jax.tree_util.register_dataclass or register_pytree_node_class, an "
                "equinox.Module, a flax.struct.dataclass), or pass the arrays as arguments. "
                "(jax.jit refuses this argument too.)"
            )

    def _held_by_fn(self) -> str | None:
        """The path (under ``fn``) of an array that the callable ``fn`` holds, or None."""
        fn = self.fn
        if isinstance(fn, functools.partial):
            # (arrays bound in a partial are fixed, like a closure's: constants
            # of the trace, as with jax.jit; objects bound in it are checked)
            parts = [(f".args[{i}]", a) for i, a in enumerate(fn.args)]
            parts += [(f".keywords[{k!r}]", a) for k, a in fn.keywords.items()]
            parts = [(w, a) for w, a in parts if not _is_dynamic(a)]
        else:
            parts = [("", fn)]
        found = [(w, h) for w, a in parts if (h := _held_array(a)) is not None]
        return f"{found[0][0]}{found[0][1]}" if found else None

    def _check_fn(self) -> None:
        """Refuses a callable that is not a pytree but holds arrays (a bound
        method of a plain object, a callable class instance)."""
        held = self._held_by_fn()
        if held is not None:
            kind = type(self.fn).__name__
            raise TypeError(
                f"amp({_fn_name(self.fn)}): the function is a {kind} that holds arrays "
                f"(`fn{held}`) but is not a pytree, so amp would bake them into its cached "
                "trace and return stale results once they change. Pass a pytree (an "
                "equinox.Module or Flax NNX Module as amp(model), a registered class), or "
                "pass the arrays as arguments."
            )

    def _check_no_leak(self, args, kwargs, names, target) -> None:
        """Refuses an array that the function assigned, while amp traced it, to
        a plain object (not a pytree) among its arguments or its ``self``: the
        object would keep a tracer of amp's trace and the caller would never
        see the value."""
        where = None
        for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            if not _is_dynamic(leaf) and (held := _held_array(leaf)) is not None:
                where, kind = f"{_arg_name(names, path)}{held}", type(leaf).__name__
                break
        if where is None and target is not _apply and (held := self._held_by_fn()) is not None:
            where, kind = f"fn{held}", type(self.fn).__name__
        if where is not None:
            raise TypeError(
                f"amp({_fn_name(self.fn)}): the function assigned an array to `{where}`, "
                f"inside a {kind} that is not a pytree. amp runs the function in a trace, so "
                "the object would keep a tracer that is invalid once the trace ends, and the "
                f"caller would never see the value. Return the value from the function, or "
                f"make {kind} a pytree (jax.tree_util.register_dataclass, an equinox.Module, "
                "a Flax NNX Module whose Variables amp writes back)."
            )

    def _trace(self, treedef, leaves, dyn_mask, target: Any = None, names=()) -> _Traced:
        # Trace a function with the user's name, source line and signature
        # (through __wrapped__), so that JAX's errors name them and the
        # arguments as jax.jit does; static leaves travel as childless pytree
        # nodes, so the jaxpr's invars are the dynamic leaves, in order.
        target = self.fn if target is None else target
        abstract = [compat.abstractify(x) if d else _Static(x) for x, d in zip(leaves, dyn_mask)]
        t_args, t_kwargs = jax.tree.unflatten(treedef, abstract)

        found: list[mutation.Writes | None] = []

        def traced_fn(*args, **kwargs):
            tree = _unwrap_statics((args, kwargs))
            snap = mutation.Snapshot(tree)
            with mutation.haiku_guard(_fn_name(self.fn)):
                out = target(*tree[0], **tree[1])
            self._check_no_leak(tree[0], tree[1], names, target)
            try:
                writes = mutation.collect(snap, tree, lambda p: _path_name(names, p))
            except TypeError as e:
                raise TypeError(f"amp({_fn_name(self.fn)}): the function {e}") from None
            found.append(writes)
            return out if writes is None else (out, writes.outputs)

        _name_like(traced_fn, self.fn)
        if target is _apply:  # the model is the first argument: call it `self`
            sig = _signature(self.fn)
            if sig is not None:
                self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
                traced_fn.__signature__ = sig.replace(
                    parameters=[self_param, *sig.parameters.values()]
                )
        closed, out_shape = compat.trace_with_shape_kw(traced_fn, t_args, t_kwargs)
        if len(compat.in_avals(closed)) != sum(dyn_mask):  # pragma: no cover
            raise AssertionError("amp_jax: traced arguments do not match; please report this.")
        self._shared.trace_count += 1
        writes = found[0]
        out_tree = jax.tree.structure(out_shape if writes is None else out_shape[0])
        ctx = Interpreter(self.policy, jax.default_backend())
        return _Traced(plan(ctx, closed), out_tree, ctx, writes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy.is_identity:
            # float32 changes nothing: run the function itself, so that results,
            # gradients and state writes are bitwise its own, eagerly too, and
            # JAX sees its jitted helpers (a re-evaluated jaxpr sums cotangents
            # in another order on JAX 0.12)
            return jax.tree.map(_as_output, self.fn(*args, **kwargs))
        if _is_tree(self.fn):  # amp(model): the model's arrays are arguments
            target, args = _apply, (self.fn, *args)
            names = ["self", *_param_names(self.fn)]
            fn_key = None
        else:
            target, names = self.fn, _param_names(self.fn)
            fn_key = self.fn
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn_mask = tuple(_is_dynamic(x) for x in leaves)
        key = None
        try:
            key = (
                _static_key(fn_key),  # (a callable object's attributes: a training flag)
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
        shared = self._shared
        traced = None
        if key is not None:
            with shared.lock:
                traced = shared.cache.get(key)
                if traced is not None:
                    shared.cache.move_to_end(key)
        if traced is None:
            if target is not _apply:
                self._check_fn()
            self._check_static(args, kwargs, leaves, dyn_mask, names)
            traced = self._trace(treedef, leaves, dyn_mask, target, names=names)
            # A jaxpr that captured tracers of an enclosing transformation is
            # only valid inside that transformation: don't cache it.
            if key is not None and not any(
                isinstance(c, compat.Tracer) for c in compat.consts_of(traced.plan.closed)
            ):
                with shared.lock:
                    shared.cache[key] = traced
                    while len(shared.cache) > self.cache_size:
                        shared.cache.popitem(last=False)
        dyn = [x for x, d in zip(leaves, dyn_mask) if d]
        outs = evaluate(traced.ctx, traced.plan, dyn)
        n = traced.out_tree.num_leaves
        if traced.writes is not None:  # carry the function's writes to the arguments
            after = traced.writes.after(leaves, outs[n:])
            mutation.write_back((args, kwargs), after, traced.writes.changed(after))
        return jax.tree.unflatten(traced.out_tree, [_as_output(o) for o in outs[:n]])


def _is_tree(fn: Any) -> bool:
    """Whether ``fn`` is a pytree with children (an Equinox or NNX module), not a leaf."""
    return not jax.tree_util.treedef_is_leaf(jax.tree.structure(fn))


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _param_names(fn: Any) -> list[str]:
    sig = _signature(fn)
    return [] if sig is None else list(sig.parameters)


@overload
def amp(
    fn: F,
    *,
    policy: Policy | str | Any = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> F: ...
@overload
def amp(
    fn: None = None,
    *,
    policy: Policy | str | Any = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> Callable[[F], F]: ...


def _brief(value: Any, limit: int = 80) -> str:
    """A short description of ``value`` for an error message (never a whole pytree)."""
    if isinstance(value, Mapping):
        keys = [repr(k) for k in list(value)[:4]]
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} with keys [{', '.join(keys)}{more}]"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({type(value).__name__}, {len(text)} characters)"


class _Decorator:
    """What ``amp(policy=...)`` and ``full_precision()`` return: a decorator.

    Used as a context manager (``with amp():``, the ``torch.autocast`` habit),
    it raises a ``TypeError`` that shows the function form.
    """

    def __init__(self, apply: Callable[[Any], Any], name: str, options: str = ""):
        self._apply, self._name, self._options = apply, name, options

    def __call__(self, fn: Any) -> Any:
        return self._apply(fn)

    def __repr__(self) -> str:
        return f"<decorator {self._name}({self._options})>"

    def __enter__(self):
        at = f"@{self._name}({self._options})" if self._options else f"@{self._name}"
        raise TypeError(
            f"{self._name}() is not a context manager: {self._name} transforms a function, "
            f"as jax.jit does. Decorate the function instead:\n\n    {at}\n"
            f"    def loss(params, batch): ...\n\nor wrap it: {self._name}(loss"
            + (f", {self._options})." if self._options else ").")
        )

    def __exit__(self, *exc: Any) -> bool:
        return False


def _options_by_keyword(fn: Callable[..., Any]) -> Callable[..., Any]:
    """amp(f, "float16") names the keyword rather than Python's positional-count error."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            raise TypeError(
                f"amp() takes its options by keyword: write amp(fn, policy={_brief(args[1])}) "
                f"(got {len(args)} positional arguments: fn and {_brief(args[1])})."
            )
        return fn(*args, **kwargs)

    return checked


@_options_by_keyword
def amp(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    policy: Policy | str | Any = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> Any:
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
        cache key (plain objects by identity and attributes). A plain object
        (not a pytree) that holds arrays is refused with a ``TypeError``, as
        ``jax.jit`` refuses it: amp would bake the arrays into its cached
        trace. ``fn`` may itself be a pytree (an Equinox or Flax NNX module):
        the result is then a pytree over it, and its arrays are traced.
      policy: a [`Policy`][amp_jax.Policy], a preset name (``"bfloat16"``,
        ``"float16"``, ``"float32"``) or a dtype. ``"float32"`` is the
        identity: amp calls ``fn``, so results, gradients and state writes
        are bitwise its own, eagerly and under ``jit``.
      strict: if true, a primitive that is in no class of the policy raises
        ``NotImplementedError`` naming it (default: treat it as ``follow``).
        Overrides ``policy.strict`` when given.
      cache_size: how many input signatures keep their trace (an LRU,
        default 64); a program that cycles through more shapes retraces.

    Returns:
      A function with the signature and output structure of ``fn``. It can
      be used as ``@amp``, ``@amp(policy=...)`` or ``amp(fn, policy=...)``.

    Raises:
      TypeError: ``fn`` is not callable, or the policy was passed by position
        (``amp(f, "float16")``: write ``amp(f, policy="float16")``).
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
        raise ValueError(f"amp(cache_size={cache_size!r}) must be an int >= 1 (default 64).")
    if fn is None:
        return _Decorator(
            functools.partial(amp, policy=pol, cache_size=cache_size),
            "amp",
            "" if isinstance(policy, str) and policy == "bfloat16" else f"policy={_brief(policy)}",
        )
    if not callable(fn):
        raise TypeError(
            f"amp(fn) needs a callable, got {type(fn).__name__}: {_brief(fn)}. Use @amp or "
            "amp(fn, policy=...) on a function, then call it with the arrays: amp(loss)(params, x)."
        )
    return AmpFunction(fn, pol, cache_size)


def full_precision(fn: F | None = None) -> F:
    """Marks ``fn`` to run in its original precision under [`amp`][amp_jax.amp].

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
        return _Decorator(full_precision, "full_precision")
    if not callable(fn):
        raise TypeError(
            f"full_precision(fn) needs a callable, got {type(fn).__name__}: {_brief(fn)}."
        )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return fn(*args, **kwargs)

    return wrapped
