"""The params of JAX's higher-order primitives: ``jit`` (inlinable or not), calls,
``custom_jvp``/``custom_vjp`` thunks, ``scan`` (``num_consts``/``num_carry`` in JAX 0.10,
``ft_in`` from 0.11), ``while``, ``shard_map``; their sub-jaxprs mapped to new ones."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import linear_util as jex_lu

from amp_jax._src.compat.context import x64_of
from amp_jax._src.compat.jaxpr import (
    ClosedJaxpr,
    Eqn,
    PyTreeDef,
    Tracer,
    WrappedFun,
    close,
    closed_to_open_no_consts,
    consts_of,
    is_closed_jaxpr,
    is_open_jaxpr,
    jaxpr_of,
)

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


@functools.cache
def inline_jits_staged() -> bool:
    """Whether JAX inlines a ``jax.jit(..., inline=True)`` call where it stages
    it, leaving no ``jit`` eqn (JAX 0.10), rather than keeping the call in the
    jaxpr (JAX 0.11.2; 0.12 until lowering, ``Inline.JAX_LATE``). Probed once."""
    jaxpr = jax.make_jaxpr(jax.jit(lambda x: x + 1, inline=True))(np.float32(1))
    return not any(e.primitive.name in JIT_NAMES for e in jaxpr.jaxpr.eqns)


def is_staged(x: Any) -> bool:
    """Whether ``x`` is a tracer of a program being staged (under ``jit``,
    ``make_jaxpr``, ``vmap``), not of an eager transformation (``jax.grad``
    outside ``jit``: its values are concrete)."""
    return isinstance(x, Tracer) and x.to_concrete_value() is None


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
