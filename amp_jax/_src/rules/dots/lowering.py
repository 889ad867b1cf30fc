"""The rules of ``dot_general``, ``transpose`` and ``conv_general_dilated``.

A lowered ``dot_general`` or ``conv_general_dilated`` gets a ``jax.custom_jvp``
whose tangent products take compute-dtype operands (a dot's are ``lowdot``'s
linear dot; a conv's write compute-dtype results), so that under ``jax.grad``
their cotangent products also take compute-dtype operands (JAX's own transpose
rules would multiply a float32 cotangent with a bf16 operand: a mixed, slow,
float32 product), and forward mode works. The backend writes each product
(`Backend.dot`: on XLA:CPU in the operand layouts it runs fast, ``backends/cpu.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import primitives as P
from jax.typing import DTypeLike

from amp_jax._src import casting, compat, mesh
from amp_jax._src.backends import Backend
from amp_jax._src.context import Context
from amp_jax._src.decision import Decision, Fused, OpClass, Variant
from amp_jax._src.policy import HIGH_DTYPE, is_managed_float
from amp_jax._src.rules.base import (
    AllowRule,
    CastingEnv,
    EqnRule,
    Rule,
    acc_dtype,
    default_allow_rule,
)
from amp_jax._src.rules.dots import lowdot


class DotRule(AllowRule):
    """``dot_general``: low-precision forward and backward, written by the
    backend (`Backend.dot`); dots the backend has no compute-dtype kernel for
    stay float32 (`Backend.has_low_kernel`); the fp8 products of a float8 policy are
    its ``FLOAT8`` variant (``float8.py``).

    A dot the plan gives a layout record (`Plan.layouts`; XLA:CPU's
    `cpu.DotLayout`) contracts the operand of a ``transpose`` that feeds it,
    so that the weight gradient comes out in the weight's own layout.
    """

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        lay = _layout(eqn, env)
        if lay is not None:
            return _layout_dot(ctx, lay, env)
        return super().evaluate(ctx, eqn, d, env)

    def low_fn(self, ctx: Context, eqn: compat.Eqn) -> Rule:
        if not ctx.vjp_rules:
            return default_allow_rule
        return functools.partial(dot_general_rule, backend=ctx.backend)


class TransposeRule(EqnRule):
    """``transpose``: bound as written, unless the plan writes it as a lowered
    dot with its operands swapped (`Plan.layouts`: the transpose of the dot's
    result, on XLA:CPU) and amp's own rule binds that dot. A transpose that
    only lowered dots read, through it (XLA:CPU's `cpu.ReadThrough`), is
    bound on its operand as stored where amp's own rule binds those dots:
    they cast the operand themselves."""

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        lay = _layout(eqn, env)
        if lay is not None and not lay.binds_dot:
            if all(isinstance(ctx.rule_for(e, OpClass.ALLOW), DotRule) for e in lay.eqns):
                return compat.bind_eqn(eqn, [env.read(eqn.invars[0], None)])
            return super().evaluate(ctx, eqn, d, env)  # (the user's own dot rule)
        if lay is None or not isinstance(ctx.rule_for(lay.eqn, OpClass.ALLOW), DotRule):
            return super().evaluate(ctx, eqn, d, env)  # (or the user's own dot rule)
        with compat.eqn_source_line(lay.eqn):  # (the dot's line, as explain shows it)
            out = _layout_dot(ctx, lay, env)[0]
        want = casting.target(casting.dtype_of(eqn.invars[0]), d.color, ctx.policy.compute_dtype)
        return [out if want is None else casting.cast(out, want)]


def _layout(eqn: compat.Eqn, env: CastingEnv) -> Any:
    """The plan's layout record of ``eqn``, if any, unless the trace is
    partitioned by a mesh (jit's partitioner then chooses the layouts)."""
    lay = env.layouts.get(eqn.outvars[0])
    return None if lay is None or mesh.partitioned_by_mesh() else lay


def _layout_dot(ctx: Context, lay: Any, env: CastingEnv) -> list[Any]:
    """The lowered dot of layout record ``lay``: an operand read through a
    transpose is the transpose's operand as stored, cast inside the dot's
    custom JVP like any other operand (not a compute-dtype cast made outside
    it for the transpose: the gradient would flow through that cast and come
    out rounded to the compute dtype, and XLA:CPU would round the float32
    weight gradient in a kernel of its own; XLA merges the two casts)."""
    invals = [env.read(v, None) for v in lay.operands]
    cd = ctx.policy.compute_dtype
    return dot_general_rule(lay.eqn, invals, cd, lay.out_dtype, backend=ctx.backend, dims=lay.dims)


def plan_layouts(
    jaxpr: compat.Jaxpr, decisions: Sequence[Decision], *, backend: Backend, vjp_rules: bool
) -> dict[int, Any]:
    """The backend's layout records of a plan's lowered dots (`Backend.plan_layouts`),
    by eqn index: for the dots amp's dot rule lowers to the compute dtype (none
    in custom JVP rules, whose dots JAX transposes, nor for a dot a rule of
    ``Policy.rules`` decided: a layout may bind it at the eqn of the transpose
    of its result, outside the rule's scope). A dot rule the user registered
    ignores them."""
    lowered, skip = {}, set()
    for i, (eqn, d) in enumerate(zip(jaxpr.eqns, decisions)):
        if d.fused is not Fused.NO:
            skip.add(i)
        elif (
            eqn.primitive is P.dot_general_p
            and d.lowered
            and d.variant is Variant.COMPUTE
            and d.rule is None
            and all(is_managed_float(casting.dtype_of(v)) for v in eqn.invars)
        ):
            lowered[i] = d.out_dtype
    if not lowered or not vjp_rules:
        return {}
    return backend.plan_layouts(jaxpr, lowered, skip)


#: a tangent a custom JVP rule with ``symbolic_zeros=True`` is handed
Tangent = jax.Array | SymbolicZero


def _tangent_sum(out: jax.Array, parts: list[jax.Array]) -> jax.Array:
    """The tangent of a bilinear op: the sum of its products (zeros when no
    operand has a tangent; JAX skips the rule then, this is for safety)."""
    return functools.reduce(lambda a, b: a + b, parts) if parts else jax.numpy.zeros_like(out)


@functools.cache
def _amp_dot(
    dims: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    out_sharding: jax.sharding.Sharding | None,
    compute_dtype: np.dtype,
    x_dtype: np.dtype,
    y_dtype: np.dtype,
    backend: Backend,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    dot = backend.dot

    def cast(v: jax.Array) -> jax.Array:
        return casting.lower(v, compute_dtype)

    def amp_dot(x: jax.Array, y: jax.Array) -> jax.Array:
        return dot(cast(x), cast(y), dims, precision, acc, out_sharding)

    # A custom JVP (not VJP) rule, so forward mode works too: the tangent
    # products are lowdot's linear dots, whose transpose rule writes the
    # cotangent products amp wants (see lowdot.py beside this module).
    f = jax.custom_jvp(amp_dot)
    lin = dict(
        dimension_numbers=dims,
        precision=precision,
        acc=acc,
        out_sharding=out_sharding,
        compute_dtype=compute_dtype,
        backend=backend,
    )

    def jvp(
        primals: Sequence[jax.Array], tangents: Sequence[Tangent]
    ) -> tuple[jax.Array, jax.Array]:
        x, y = primals
        tx, ty = tangents
        xl, yl = cast(x), cast(y)
        out = dot(xl, yl, dims, precision, acc, out_sharding)
        # (symbolic zeros: no product for an operand that is not differentiated)
        parts = [
            lowdot.linear_dot(t, o, t_is_lhs=is_lhs, **lin)
            for t, o, is_lhs in ((tx, yl, True), (ty, xl, False))
            if not isinstance(t, SymbolicZero)
        ]
        return out, _tangent_sum(out, parts)

    f.defjvp(jvp, symbolic_zeros=True)
    return _jitted(f)


def _jitted(f: Callable[..., jax.Array]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``f`` jitted (and inlined by JAX where it stages it), once per caller's
    source line: JAX linearizes, transposes and lowers it once per signature
    and line instead of once per call (a layer's dots, called once per layer,
    share a line), and the eqns of the trace it reuses name the line they
    are run for (what ``explain`` and profilers read)."""

    def amp_call(x: jax.Array, y: jax.Array, line: str) -> jax.Array:
        del line  # (a static argument: a trace of its own per line)
        return f(x, y)

    jitted = jax.jit(amp_call, static_argnums=2, inline=True)
    return lambda x, y: jitted(x, y, compat.current_source_line())


def dot_general_rule(
    eqn: compat.Eqn,
    invals: Sequence[jax.Array],
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
    *,
    backend: Backend,
    dims: lax.DotDimensionNumbers | None = None,
) -> list[Any]:
    """``dims``: dimension numbers that replace ``eqn``'s (for operands read
    through their transposes, or swapped: `Plan.layouts`)."""
    x, y = invals
    p = eqn.params
    if dims is not None:
        p = {**p, "dimension_numbers": dims}
    if not (is_managed_float(x.dtype) and is_managed_float(y.dtype)):
        return default_allow_rule(eqn, invals, compute_dtype, out_dtype)
    f = _amp_dot(
        p["dimension_numbers"],
        p.get("precision"),
        acc_dtype(eqn, out_dtype),
        p.get("out_sharding"),
        compute_dtype,
        np.dtype(x.dtype),
        np.dtype(y.dtype),
        backend,
    )
    return [f(x, y)]


# -- conv_general_dilated ------------------------------------------------------


def _freeze(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


@functools.cache
def _amp_conv(
    frozen: tuple[tuple[str, Any], ...],
    acc: DTypeLike | None,
    compute_dtype: np.dtype,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    params = dict(frozen)
    prim = P.conv_general_dilated_p

    def conv(x: jax.Array, w: jax.Array, out_dtype: DTypeLike | None) -> jax.Array:
        return prim.bind(x, w, **{**params, "preferred_element_type": out_dtype})

    def amp_conv(x: jax.Array, w: jax.Array) -> jax.Array:
        return conv(casting.lower(x, compute_dtype), casting.lower(w, compute_dtype), acc)

    # A custom JVP (so forward mode works): the tangent convolutions take
    # compute-dtype operands and write compute-dtype results, which JAX's conv
    # transpose rules turn into compute-dtype cotangent convolutions (the
    # cotangent rounded to the compute dtype first: the transpose of the cast).
    f = jax.custom_jvp(amp_conv)

    def jvp(
        primals: Sequence[jax.Array], tangents: Sequence[Tangent]
    ) -> tuple[jax.Array, jax.Array]:
        x, w = primals
        tx, tw = tangents
        xl, wl = casting.lower(x, compute_dtype), casting.lower(w, compute_dtype)
        out = conv(xl, wl, acc)
        parts: list[jax.Array] = []
        if not isinstance(tx, SymbolicZero):
            parts.append(conv(casting.lower(tx, compute_dtype), wl, None).astype(out.dtype))
        if not isinstance(tw, SymbolicZero):
            parts.append(conv(xl, casting.lower(tw, compute_dtype), None).astype(out.dtype))
        return out, _tangent_sum(out, parts)

    f.defjvp(jvp, symbolic_zeros=True)
    return _jitted(f)


def conv_rule(
    eqn: compat.Eqn,
    invals: Sequence[jax.Array],
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
) -> list[Any]:
    x, w = invals
    if not (is_managed_float(x.dtype) and is_managed_float(w.dtype)):
        return default_allow_rule(eqn, invals, compute_dtype, out_dtype)
    params = {k: v for k, v in eqn.params.items() if k != "preferred_element_type"}
    f = _amp_conv(_freeze(params), acc_dtype(eqn, out_dtype), compute_dtype)
    return [f(x, w)]


#: primitive -> rule (the fp8 variant of the dot rule is added where the table is built)
RULES: dict[Any, EqnRule] = {
    P.transpose_p: TransposeRule(),
    P.conv_general_dilated_p: AllowRule(conv_rule),
}
