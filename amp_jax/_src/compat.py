"""Every JAX-version difference amp_jax depends on, and nothing else.

Supported: JAX 0.10.2 and up: 0.10, 0.11 and 0.12 (CI runs 0.10.2, 0.11.2 and
the newest JAX, noxfile.py). What changed between those versions:

- 0.10 -> 0.11: ``ClosedJaxpr`` and ``Jaxpr`` are one class (a closed jaxpr
  is a ``Jaxpr`` with ``consts``; the params that held open jaxprs, ``remat``'s
  and ``shard_map``'s, hold that class too); ``scan`` describes its operands by
  flat trees ``ft_in``/``ft_out`` of (consts, carry, xs) instead of
  ``num_consts``/``num_carry``; ``jit``'s ``inline`` is an ``Inline`` enum, not
  a bool.
- 0.11 -> 0.12: none in what amp_jax reads.

Only public API is used: ``jax.extend.core``, ``jax.extend.linear_util``,
``jax.extend.source_info_util``, ``jax.make_jaxpr``.

It also names JAX's jaxpr objects for annotations (`Eqn`, `Var`, `Literal`,
`Atom`, `Jaxpr`, `ClosedJaxpr`, `Primitive`, `AbstractValue`, `ShapedArray`,
`PyTreeDef`, `KeyPath`, `WrappedFun`): the rest of amp_jax types its parameters with
these, never with ``jax._src`` classes. From JAX 0.11 ``ClosedJaxpr`` is
``Jaxpr``; a parameter that takes a closed jaxpr says `ClosedJaxpr` all the
same, for the reader and for JAX 0.10.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeAlias, TypeGuard

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import linear_util as jex_lu
from jax.extend import source_info_util
from jax.typing import ArrayLike

#: A closed jaxpr: a `Jaxpr` with the values of its constants (one class from JAX 0.11).
ClosedJaxpr: TypeAlias = jex_core.ClosedJaxpr
#: An open jaxpr: ``eqns``, ``invars``, ``outvars``, ``constvars``.
Jaxpr: TypeAlias = jex_core.Jaxpr
#: One equation of a jaxpr (``JaxprEqn``): ``primitive``, ``params``, ``invars``, ``outvars``.
Eqn: TypeAlias = jex_core.JaxprEqn
#: A jaxpr variable (an equation's result, a jaxpr's input).
Var: TypeAlias = jex_core.Var
#: A constant operand written into a jaxpr (``Literal.val``).
Literal: TypeAlias = jex_core.Literal
#: An equation's operand or a jaxpr's output: a variable or a literal.
Atom: TypeAlias = Var | Literal
#: A JAX primitive (``lax.dot_general_p``...): ``name``, ``bind``, ``multiple_results``.
Primitive: TypeAlias = jex_core.Primitive
#: The abstract value of a jaxpr variable (``Var.aval``).
AbstractValue: TypeAlias = jax.core.AbstractValue
#: The abstract value of an array: ``shape``, ``dtype``, ``weak_type``, ``sharding``.
ShapedArray: TypeAlias = jax.core.ShapedArray
#: The structure of a flattened pytree (``jax.tree.flatten``'s second result).
PyTreeDef: TypeAlias = jax.tree_util.PyTreeDef
#: Where a leaf sits in a pytree (``jax.tree_util.tree_flatten_with_path``'s paths).
KeyPath: TypeAlias = jax.tree_util.KeyPath
#: A function wrapped for JAX's tracing (the thunks in ``custom_jvp_call`` /
#: ``custom_vjp_call`` params).
WrappedFun: TypeAlias = jex_lu.WrappedFun
Tracer: TypeAlias = jax.core.Tracer
#: what ``jax.lax.create_token()`` returns outside a trace (effects ordering)
Token: TypeAlias = jex_core.Token
AbstractToken: TypeAlias = jex_core.AbstractToken
#: a mutable array (``jax.new_ref``), concrete or a tracer of one (JAX 0.10 and 0.12)
Ref: TypeAlias = jax.Ref

#: ``(major, minor)`` of the running JAX.
JAX_VERSION: tuple[int, int] = tuple(jax.__version_info__[:2])
#: True from JAX 0.11 on, where the two classes are one: a "closed" jaxpr is a
#: Jaxpr with consts, and no jaxpr is open in the sense of `is_open_jaxpr`.
ONE_JAXPR_CLASS = ClosedJaxpr is Jaxpr


def is_closed_jaxpr(x: object) -> TypeGuard[ClosedJaxpr]:
    return isinstance(x, ClosedJaxpr) and (not ONE_JAXPR_CLASS or hasattr(x, "consts"))


def is_open_jaxpr(x: object) -> TypeGuard[Jaxpr]:
    return isinstance(x, Jaxpr) and not isinstance(x, ClosedJaxpr)


def jaxpr_of(cj: ClosedJaxpr) -> Jaxpr:
    """The open jaxpr (eqns, invars, outvars) of a closed jaxpr."""
    return cj if ONE_JAXPR_CLASS else cj.jaxpr


def consts_of(cj: ClosedJaxpr) -> list[Any]:
    return list(cj.consts)


def close(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, list(consts))


def in_avals(cj: ClosedJaxpr) -> list[AbstractValue]:
    return list(cj.in_avals)


def aval_of(x: object) -> Any:
    return jax.typeof(x)


def _sharding_of(x: object) -> jax.sharding.Sharding | None:
    """The sharding to trace ``x`` with: a concrete array's own, if it spans devices."""
    if isinstance(x, jax.Array) and not isinstance(x, Tracer):
        try:
            s = x.sharding
        except Exception:  # deleted or otherwise unusable arrays
            return None
        return s if len(s.device_set) > 1 else None
    return None


def abstractify(x: object) -> AbstractValue | jax.ShapeDtypeStruct:
    """The abstract value to trace ``fn`` at for argument ``x``.

    The aval carries dtype, weak type and (explicit-mode) sharding; a concrete
    array spread over several devices also passes its own sharding, which
    ``shard_map`` checks against its ``in_specs``.
    """
    s = _sharding_of(x)
    aval = jax.typeof(x)
    if s is None:
        return aval
    return jax.ShapeDtypeStruct(np.shape(x), aval.dtype, weak_type=aval.weak_type, sharding=s)


def abstract_key(x: object) -> tuple[Any, ...]:
    """Hashable description of ``x``'s abstract type, for the trace cache."""
    aval = jax.typeof(x)
    s = _sharding_of(x)
    return (aval, s)


def trace_to_closed_jaxpr(fn: Callable[..., Any], avals: Sequence[Any]) -> ClosedJaxpr:
    """Traces ``fn`` at abstract values ``avals`` into a closed jaxpr."""
    return jax.make_jaxpr(fn)(*avals)


def trace_with_shape(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
    """Traces ``fn(*args)`` (ShapeDtypeStructs) returning (closed jaxpr, out shape tree)."""
    return jax.make_jaxpr(fn, return_shape=True)(*args)


def trace_with_shape_kw(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[ClosedJaxpr, Any]:
    """Like `trace_with_shape` with keyword arguments too (pytrees of
    ShapeDtypeStructs); the jaxpr's invars are the leaves of ``(args, kwargs)``.
    JAX names ``fn`` (and its ``__wrapped__`` function's arguments) in its errors."""
    return jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)


def closed_to_open_no_consts(cj: ClosedJaxpr, what: str) -> Jaxpr:
    """Returns the open jaxpr of ``cj``; it must not capture constants."""
    if consts_of(cj):
        raise NotImplementedError(
            f"amp_jax: rewriting the sub-jaxpr of {what} produced captured constants; "
            "please report this with the function that triggers it."
        )
    return jaxpr_of(cj)


def bind_eqn(eqn: Eqn, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive (with ``params`` if given) under the current trace."""
    prim = eqn.primitive
    params = eqn.params if params is None else params
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):  # (subfuns, params) in some versions
        subfuns, bind_params = bind_params
        out = prim.bind(*subfuns, *invals, **bind_params)
    else:
        out = prim.bind(*invals, **bind_params)
    return list(out) if prim.multiple_results else [out]


def eqn_context(eqn: Eqn) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """Context managers that reproduce ``eqn``'s source info and ctx while binding."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    )


def eqn_source_line(eqn: Eqn) -> AbstractContextManager[Any]:
    """A context in which ops bound get ``eqn``'s source line (its traceback), in
    the current name stack: for an op amp binds for another eqn than the one
    it evaluates (a dot written at the transpose of its result)."""
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack()
    )


def current_name_stack_str() -> str:
    """The ``jax.named_scope`` names the caller is tracing in, joined by ``/``."""
    return str(source_info_util.current_name_stack())


def _axis_env() -> tuple[tuple[str, int], ...]:
    """The named axes in scope (``vmap(axis_name=...)``, ``shard_map``, ``pmap``) and their sizes."""
    names = getattr(jex_core, "unsafe_get_axis_names_DO_NOT_USE", lambda: ())()
    return tuple((n, int(jax.lax.axis_size(n))) for n in names)


def jit_disabled() -> bool:
    """Whether the caller is inside ``jax.disable_jit()`` (jit runs functions as Python)."""
    return bool(jax.config.values["jax_disable_jit"])


def trace_context() -> tuple[Any, ...]:
    """Everything besides the arguments that can change what tracing a function gives.

    What ``jax.jit`` keys its trace cache on (its "trace context"), from public
    API: every config value as the caller sees it (contexts such as
    ``jax.numpy_rank_promotion("raise")`` or ``jax.default_matmul_precision``
    included), the named axes in scope with their sizes (``psum(1, "b")``
    traces to the size of ``b``), and the abstract mesh. Hashable.
    """
    return (
        tuple(jax.config.values.items()),
        _axis_env(),
        jax.sharding.get_abstract_mesh(),
    )


def name_stack_str(eqn: Eqn) -> str:
    return str(source_info_util.current_name_stack() + eqn.source_info.name_stack)


# -- higher-order primitives ------------------------------------------------

JIT_NAMES = frozenset({"jit", "pjit"})
CUSTOM_JVP_NAMES = frozenset({"custom_jvp_call"})
CUSTOM_VJP_NAMES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Primitives whose one sub-jaxpr is called once with the eqn's operands and
#: gives its results (``jax.checkpoint`` is ``remat2`` in JAX 0.10).
CALL_LIKE_NAMES = (
    JIT_NAMES
    | CUSTOM_JVP_NAMES
    | CUSTOM_VJP_NAMES
    | frozenset({"closed_call", "core_call", "remat", "remat2", "checkpoint"})
)


def _is_unspecified(s: object) -> bool:
    return s is None or type(s).__name__ == "UnspecifiedValue"


def jit_is_inlinable(eqn: Eqn) -> bool:
    """A ``jit`` eqn without shardings, layouts, donation or compiler options."""
    if eqn.primitive.name not in JIT_NAMES:
        return False
    p = eqn.params
    return (
        all(_is_unspecified(s) for s in p.get("in_shardings", ()))
        and all(_is_unspecified(s) for s in p.get("out_shardings", ()))
        and all(l is None for l in p.get("in_layouts", ()))
        and all(l is None for l in p.get("out_layouts", ()))
        and not any(p.get("donated_invars", ()))
        and not p.get("compiler_options_kvs", ())
    )


def jit_inlined_by_jax(eqn: Eqn) -> bool:
    """A ``jit`` eqn that JAX inlines itself (``jax.jit(..., inline=True)``):
    when it stages it (JAX 0.10-0.11) or when it lowers it (``Inline.JAX_LATE``,
    JAX 0.12, which keeps it in jaxprs)."""
    inline = eqn.params.get("inline") if eqn.primitive.name in JIT_NAMES else None
    return inline is True or getattr(inline, "value", None) in ("jax_early", "jax_late")


def is_drop_var(v: object) -> bool:
    """A result var nothing reads (``_`` in a printed jaxpr)."""
    return isinstance(v, jex_core.DropVar)


def jit_jaxpr(eqn: Eqn) -> ClosedJaxpr:
    return eqn.params["jaxpr"]


def has_subjaxprs(eqn: Eqn) -> bool:
    return any(True for _ in jex_core.jaxprs_in_params(eqn.params)) or (
        eqn.primitive.name in CUSTOM_JVP_NAMES | CUSTOM_VJP_NAMES
    )


def _is_jaxpr(x: object) -> bool:
    return is_closed_jaxpr(x) or is_open_jaxpr(x)


def map_subjaxprs(
    eqn: Eqn,
    rewrite_closed: Callable[[ClosedJaxpr], ClosedJaxpr],
    rewrite_jvp_rule: Callable[[ClosedJaxpr], ClosedJaxpr] | None = None,
    run_bwd: Callable[[WrappedFun, Callable[..., Any], Sequence[Any]], Any] | None = None,
) -> dict[str, Any]:
    """New params for ``eqn`` with every sub-jaxpr rewritten by ``rewrite_closed``.

    ``rewrite_closed`` maps a closed jaxpr to a closed jaxpr with the same
    input and output avals. Open jaxprs in params are closed (no consts),
    rewritten and opened again. The thunks of ``custom_jvp_call`` /
    ``custom_vjp_call`` (the JVP rule's jaxpr, the forward under
    differentiation) are wrapped so their jaxprs are rewritten too. The JVP
    rule's jaxpr is rewritten by ``rewrite_jvp_rule`` (it gets transposed by
    JAX, so it must not contain ``custom_vjp`` calls). The user's backward
    rule of a ``custom_vjp_call`` is run through ``run_bwd(key, bwd, args)``
    (``bwd(*residuals, *cotangents)`` returns the input cotangents; from JAX
    0.11 the pair (cotangents, logs)), so that
    a rule that recomputes the forward sees the forward's policy.
    """
    name = eqn.primitive.name

    def one(v: object) -> Any:
        if is_closed_jaxpr(v):
            return rewrite_closed(v)
        if is_open_jaxpr(v):
            if v.constvars:
                return v  # not expected in params; leave untouched
            return closed_to_open_no_consts(rewrite_closed(close(v, [])), name)
        if isinstance(v, tuple) and v and all(x is None or _is_jaxpr(x) for x in v):
            new = [one(x) for x in v]  # keep NamedTuples (custom_linear_solve's jaxprs)
            return type(v)(*new) if hasattr(v, "_fields") else tuple(new)
        # (a jaxpr among other values is data of the primitive -- an Equinox
        # filter primitive's flattened operands, a closure-converted function
        # whose arguments are checked by identity: left as it is)
        return v

    params = {k: one(v) for k, v in eqn.params.items()}
    if name in CUSTOM_JVP_NAMES and "jvp_jaxpr_fun" in params:
        params["jvp_jaxpr_fun"] = _wrap_thunk(
            params["jvp_jaxpr_fun"],
            rewrite_jvp_rule or rewrite_closed,
            n_extra=1,
            scope=lambda: x64_of(eqn),
        )
    if name in CUSTOM_VJP_NAMES and "fwd_jaxpr_thunk" in params:
        params["fwd_jaxpr_thunk"] = _wrap_thunk(
            params["fwd_jaxpr_thunk"], rewrite_closed, n_extra=0, scope=lambda: x64_of(eqn)
        )
    if name in CUSTOM_VJP_NAMES and run_bwd is not None and "bwd" in params:
        bwd = params["bwd"]
        params["bwd"] = jex_lu.wrap_init(
            lambda *args: run_bwd(bwd, lambda *a: call_thunk(bwd, *a), args),
            debug_info=bwd.debug_info,
        )
    return params


def custom_jvp_parts(eqn: Eqn) -> tuple[ClosedJaxpr, WrappedFun, int]:
    """(body closed jaxpr, JVP-rule thunk, number of leading consts) of a
    ``custom_jvp_call`` eqn. The thunk maps the operands' symbolic-zero flags
    to ``(jaxpr, consts, output zero flags)`` (`call_thunk`)."""
    p = eqn.params
    return p["call_jaxpr"], p["jvp_jaxpr_fun"], p.get("num_consts", 0)


def custom_jvp_params(eqn: Eqn, body: ClosedJaxpr, jvp_thunk: WrappedFun) -> dict[str, Any]:
    """``eqn``'s params with a new body and JVP-rule thunk (see `custom_jvp_parts`)."""
    return dict(eqn.params, call_jaxpr=body, jvp_jaxpr_fun=jvp_thunk)


def call_thunk(thunk: WrappedFun, *args: Any) -> Any:
    return thunk.call_wrapped(*args)


def memoized_fun(fn: Callable[..., Any], like: WrappedFun) -> WrappedFun:
    """``fn`` (of hashable args) memoized, wrapped like the thunk ``like``."""
    memo: dict[tuple[Any, ...], Any] = {}

    def wrapped(*args: Any) -> Any:
        if args not in memo:
            memo[args] = fn(*args)
        return memo[args]

    return jex_lu.wrap_init(wrapped, debug_info=like.debug_info)


_X64_DTYPES = frozenset(np.dtype(t) for t in ("float64", "int64", "uint64", "complex128"))


def x64_of(eqn: Eqn) -> AbstractContextManager[Any]:
    """``jax.enable_x64()`` when ``eqn`` has a 64-bit operand or result and the
    caller runs without 64-bit types: the eqn was traced inside a user's
    ``with jax.enable_x64():``, so the Python rules JAX runs when it binds
    or differentiates it (a ``custom_vjp``'s forward, a ``custom_jvp``'s
    rule) must run there too, as they do without amp, or they build
    32-bit values a 64-bit primal does not match. Else a null context."""
    if jax.config.values["jax_enable_x64"]:
        return contextlib.nullcontext()
    for v in (*eqn.invars, *eqn.outvars):
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and dtype in _X64_DTYPES:
            return jax.enable_x64(True)
    return contextlib.nullcontext()


def _wrap_thunk(
    thunk: WrappedFun,
    rewrite_closed: Callable[[ClosedJaxpr], ClosedJaxpr],
    n_extra: int,
    scope: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> WrappedFun:
    """Wraps a ``(*zeros) -> (jaxpr, consts, *extra)`` thunk to rewrite its
    jaxpr; the thunk (the user's rule) runs inside ``scope()``."""

    def rewrite(*zeros: bool) -> tuple[Any, ...]:
        with scope():
            jaxpr, consts, *extra = call_thunk(thunk, *zeros)
        assert len(extra) == n_extra
        new = rewrite_closed(close(jaxpr, consts))
        return (jaxpr_of(new), consts_of(new), *extra)

    return memoized_fun(rewrite, thunk)


def scan_xs(eqn: Eqn) -> tuple[ClosedJaxpr, range] | None:
    """(body closed jaxpr, indices of the scanned-over inputs) of a ``scan`` eqn."""
    if eqn.primitive.name != "scan":
        return None
    return eqn.params["jaxpr"], range(len(eqn.invars) - scan_num_xs(eqn.params), len(eqn.invars))


def scan_num_xs(params: dict[str, Any]) -> int:
    """How many of a ``scan``'s operands are scanned over (the trailing ones).

    JAX 0.10 gives ``num_consts``/``num_carry`` and the operand count; JAX 0.11
    describes the operands by a flat tree ``ft_in`` of (consts, carry, xs).
    """
    if "ft_in" in params:
        _, _, xs = params["ft_in"].unpack()
        return len(xs)
    n_in = len(jaxpr_of(params["jaxpr"]).invars)
    return n_in - params["num_consts"] - params["num_carry"]


def jaxpr_as_fun(cj: ClosedJaxpr) -> Callable[..., list[Any]]:
    """A closed jaxpr as a function of its inputs (``jax.extend.core.jaxpr_as_fun``)."""
    return jex_core.jaxpr_as_fun(cj)


def scan_params_with_body(eqn: Eqn, body: ClosedJaxpr) -> dict[str, Any]:
    """``eqn``'s params with the body jaxpr replaced (its input types may differ)."""
    return dict(eqn.params, jaxpr=body)


SHARD_MAP_NAMES = frozenset({"shard_map"})


def shard_map_body(eqn: Eqn) -> ClosedJaxpr:
    """The body of a ``shard_map`` eqn, as a closed jaxpr."""
    return close(eqn.params["jaxpr"], [])


def shard_map_of(eqn: Eqn, body: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """A ``shard_map`` eqn as a public ``jax.shard_map`` function with a new body.

    The body must be traced inside the manual-axes context (collectives name
    the mesh axes), so its jaxpr cannot be rewritten on its own like the
    other sub-jaxprs: ``body(*args)`` evaluates the original body jaxpr.
    """
    p = eqn.params
    kwargs = dict(
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p.get("check_vma", True),
    )
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    if axes is not None and frozenset(axes) != frozenset(p["mesh"].axis_names):
        kwargs["axis_names"] = set(axes)
    # Under jit, as the shard_map was: amp inlines a jit around it, and JAX
    # 0.10 refuses an eager shard_map with some axes left automatic on an
    # Explicit mesh ("out_specs refers to 'b'").
    fn = jax.jit(jax.shard_map(lambda *a: tuple(body(*a)), **kwargs))
    return lambda *invals: list(fn(*invals))


def literal_value(lit: Literal) -> Any:
    return lit.val


def cast_constant(value: ArrayLike, dtype: np.dtype) -> np.ndarray | np.generic:
    """Casts a literal constant without creating a traced op (stays a literal)."""
    return (
        np.asarray(value, dtype=dtype)[()]
        if np.ndim(value) == 0
        else np.asarray(value, dtype=dtype)
    )


def vjp_residuals(vjp_fn: Callable[..., Any]) -> tuple[list[Any], PyTreeDef] | None:
    """The residual arrays of a ``jax.vjp`` pullback and its treedef, or None.

    In JAX 0.10-0.11 the pullback returned by ``jax.vjp`` is a pytree whose
    leaves are the residuals (``jax.tree.unflatten`` rebuilds a working
    pullback from new leaves). Where it is not (an opaque callable), None:
    callers then recompute the forward pass instead of storing residuals.
    """
    leaves, treedef = jax.tree.flatten(vjp_fn)
    if not all(isinstance(x, (jax.Array, Tracer)) for x in leaves):
        return None
    return leaves, treedef


def scan_split(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` eqn's operands (then the xs)."""
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def while_split(params: dict[str, Any]) -> tuple[int, int]:
    """``(cond_nconsts, body_nconsts)`` of a ``while`` eqn (then the carry)."""
    return params["cond_nconsts"], params["body_nconsts"]


def source_line(eqn: Eqn) -> str:
    """The user's source line of ``eqn`` (``file:line:col (function)``), or ``"-"``;
    files under the working directory are named relative to it (``train.py:12:5``)."""
    return _line_of(eqn.source_info)


def current_source_line() -> str:
    """The user's source line an op bound now would get (`source_line`)."""
    return _line_of(source_info_util.current())


def _line_of(info: source_info_util.SourceInfo) -> str:
    try:
        where = source_info_util.summarize(info) or "-"
    except Exception:  # no traceback
        return "-"
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return where[len(cwd) :] if where.startswith(cwd) else where


def explicit_sharding_in_order(x: ArrayLike | ShapedArray, order: Sequence[int]) -> Any:
    """``x``'s (an array's or an aval's) explicit-mode sharding with its dims
    taken in ``order``, or None.

    For a dot that produces an operand's cotangent with its axes in ``order``
    (then transposed back), as JAX's own dot_general transpose rule does: in
    ``AxisType.Explicit`` mode a dot whose contracting dims are sharded needs
    an ``out_sharding``, and the cotangent must be sharded like the operand.
    None unless ``x``'s mesh has an explicit axis (auto, manual or
    single-device): the dot then derives its output sharding as before.
    """
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    s: Any = getattr(aval, "sharding", None)
    spec = getattr(s, "spec", None)
    types = getattr(getattr(s, "mesh", None), "axis_types", None) or ()
    if spec is None or jax.sharding.AxisType.Explicit not in tuple(types):
        return None
    parts = tuple(spec) + (None,) * (len(order) - len(spec))
    return s.update(spec=spec.update(partitions=tuple(parts[o] for o in order)))


def nnx_set_key(nnx: Any, impl: Any, node: object, key: Any, old: object, new: object) -> None:
    """Sets the attribute ``key`` of the Flax NNX graph node ``node`` to ``new``
    (``old`` the value it holds). Flax 0.12.2 assigns a Variable onto a
    Variable attribute by value (the old object stays, with the new value):
    there the old one is removed first, so that the attribute holds ``new``."""
    if (
        getattr(nnx.graph, "DataElem", None) is None
        and isinstance(old, nnx.Variable)
        and isinstance(new, nnx.Variable)
    ):
        impl.pop_key(node, key)
    impl.set_key(node, key, new)


def nnx_node_items(nnx: Any, impl: Any, node: object) -> list[tuple[Any, Any, bool]]:
    """``(key, value, is_data)`` for each attribute of the Flax NNX graph node
    ``node`` (``impl``: its ``nnx.graph.get_node_impl``). Flax 0.12.8 and newer
    wrap each in ``graph.DataElem``/``StaticElem``; older ones (0.12.2) give
    the plain value, and the node's ``_pytree__nodes`` entry (an item too)
    says which attributes are data."""
    items, _ = impl.flatten(node)
    data_elem = getattr(nnx.graph, "DataElem", None)
    if data_elem is None:
        return [(key, value, False) for key, value in items]
    wrapped = (data_elem, nnx.graph.StaticElem)
    return [
        (key, elem.value if isinstance(elem, wrapped) else elem, isinstance(elem, data_elem))
        for key, elem in items
    ]
