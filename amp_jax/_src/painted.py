"""The painted draft of a plan: classes and colors, before control flow is kept.

`painted` classifies the eqns of a jaxpr (``classify.py``), keeps as written
an op that reads a constant the compute dtype cannot represent and a matmul
next to a factorization or solve, and paints the rest (``painting.py``,
pure): once per jaxpr, the start of both the plan and the loop-decision fixed
point (``control.py``, whose `Draft` starts from it); `low_text` says why an
eqn painted low runs in the compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from amp_jax._src import compat, painting
from amp_jax._src.classify import Classified, classify
from amp_jax._src.context import Context
from amp_jax._src.decision import (
    Color,
    OpClass,
    Reason,
    Why,
    low_allow_text,
)
from amp_jax._src.policy import SOLVES


def painted(ctx: Context, jaxpr: compat.Jaxpr) -> tuple[tuple[Classified, ...], tuple[Color, ...]]:
    """The classes of ``jaxpr``'s eqns (an op reading a constant the compute
    dtype cannot hold is kept as written) and their painting, before any
    decision or carry is kept; once per jaxpr (the plan and the loop-decision
    fixed point both start from it)."""

    def make() -> tuple[tuple[Classified, ...], tuple[Color, ...]]:
        seen: dict[Classified, Classified] = {}  # (equal ones shared, as decisions)
        rules = ctx.rules_of(jaxpr)
        made = (classify(ctx, e, r) for e, r in zip(jaxpr.eqns, rules))
        classified = [seen.setdefault(c, c) for c in made]
        if ctx.identity:
            return tuple(classified), (Color.ORIG,) * len(classified)
        for i in _reads_unrepresentable_constant(jaxpr, ctx.policy.compute_dtype):
            c = classified[i]
            if c.op_class in (OpClass.ALLOW, OpClass.FOLLOW, OpClass.CLEAR):
                classified[i] = Classified(c.kind, OpClass.NEVER, Reason.kept(Why.CONSTANT_RANGE))
        # A matmul whose result a factorization or solve reads (a Gram matrix
        # X^T X), or that reads a solve's result (its backward product is the
        # cotangent the solve's transpose solves), stays float32: the solve
        # amplifies rounding by the matrix's condition number.
        solves = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name in SOLVES]
        for i in painting.matmuls_around(jaxpr, [c.op_class for c in classified], solves):
            reason = classified[i].reason
            if reason is None or not reason.keeps_high:
                c = classified[i]
                classified[i] = Classified(c.kind, OpClass.NEVER, Reason.kept(Why.FEEDS_SOLVE))
        classes = [c.op_class for c in classified]
        in_f32 = _elementwise_in_float32(ctx)
        high_clear = ctx.backend.clear_in_float32 if in_f32 is not None else frozenset()
        colors = painting.paint(classes, jaxpr, low_follow=in_f32 is None, high_clear=high_clear)
        if in_f32 is not None:  # (the follow ops it kept out of the compute dtype say so)
            why = Reason(Why.BACKEND_CLASS, f"backend-aware: {in_f32}")
            for i in painting.follows_between(classes, jaxpr):
                if colors[i] is Color.ORIG:
                    classified[i] = dataclasses.replace(classified[i], reason=why)
        return tuple(classified), tuple(colors)

    return ctx.cached("painted", jaxpr, make)


def backend_kept(c: Classified) -> bool:
    """A follow op the painting kept out of the compute dtype for the backend's sake."""
    return (
        c.op_class is OpClass.FOLLOW and c.reason is not None and c.reason.why is Why.BACKEND_CLASS
    )


def _elementwise_in_float32(ctx: Context) -> str | None:
    """Why ``follow`` ops stay out of the compute dtype on this backend
    (`Backend.low_elementwise`, ``Policy(backend_aware=True)``), or None."""
    if not ctx.policy.backend_aware:
        return None
    return ctx.backend.elementwise_in_float32(ctx.policy.compute_dtype)


def low_text(ctx: Context, eqn: compat.Eqn) -> str:
    """Why ``eqn``, painted low, runs in the compute dtype: its class, or the painting."""
    pol, name = ctx.policy, eqn.primitive.name
    cd = pol.compute_dtype.name
    base = pol.class_of(name)
    if base == "allow":
        return low_allow_text(cd, name in dict(pol.overrides))
    if compat.has_subjaxprs(eqn):
        return f"painting: function of follow/clear ops between {cd} ops, runs in {cd}"
    if base == "clear":
        return f"painting: clear op next to a {cd} op"
    if base is None:
        return f"no class (treated as follow); painting: between two {cd} ops"
    return f"painting: {base} op on a path between two {cd} ops"


def _unrepresentable(value: Any, dtype: np.dtype) -> bool:
    """A float constant that ``dtype`` turns into inf, 0 or a subnormal (off by more than its eps)."""
    v = np.asarray(value)
    if not np.issubdtype(v.dtype, np.floating) or v.size > 64:
        return False
    v = v.astype(np.float64)
    finite = np.isfinite(v)
    v = np.where(finite, v, 0.0)  # inf/nan constants are what they are in any dtype
    with np.errstate(all="ignore"):
        c = v.astype(dtype).astype(np.float64)
        bad = ~np.isfinite(c)
        # (more than normal rounding: flushed to zero or a subnormal's lost digits)
        bad |= (v != 0) & (np.abs(c - v) > float(jnp.finfo(dtype).eps) * np.abs(v))
    return bool(bad.any())


_CONSTANT_PASSTHROUGH = frozenset(
    {"broadcast_in_dim", "reshape", "convert_element_type", "copy", "squeeze", "expand_dims"}
)


def _reads_unrepresentable_constant(jaxpr: compat.Jaxpr, dtype: np.dtype) -> list[int]:
    """Eqns that read a constant (a literal, or a broadcast of one) that
    ``dtype`` cannot represent: they keep their original precision."""
    if np.dtype(dtype).itemsize >= 4:
        return []
    bad: set[Any] = set()
    found = []
    judged: dict[tuple[Any, ...], bool] = {}  # (a model's constants repeat at every layer)

    def unrepresentable(lit: compat.Literal) -> bool:
        value = np.asarray(compat.literal_value(lit))
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in judged:
            judged[key] = _unrepresentable(value, dtype)
        return judged[key]

    for i, eqn in enumerate(jaxpr.eqns):
        reads_bad = any(
            unrepresentable(v) if isinstance(v, compat.Literal) else v in bad for v in eqn.invars
        )
        if not reads_bad:
            continue
        if eqn.primitive.name in _CONSTANT_PASSTHROUGH and len(eqn.invars) == 1:
            bad.update(eqn.outvars)  # still a constant: judged where it is used
        else:
            found.append(i)
    return found


__all__ = ("low_text", "painted")
