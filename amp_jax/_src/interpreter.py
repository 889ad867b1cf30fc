"""Rewriting a jaxpr under a mixed-precision policy: evaluation.

`rewrite` (and `evaluate`, its eager form) evaluate the
`Plan` of a jaxpr (``planning.py``: one typed
`Decision` per eqn) under the caller's trace:
every eqn is bound through its rule in the primitive-keyed table of
``rules.py`` (`rules.rule_for`), under the named scopes that carry its
reason (``decision.scopes``). A rule casts its operands (`casting`:
each (value, dtype) cast is made once and shared) and says which operands it
reads only in the compute dtype. Higher-order primitives get their
sub-jaxprs rewritten with the same policy and keep their boundary dtypes:
their rules (``higher_order.py``) call back through the
`Interpreter` (``ctx.plan``, ``ctx.rewrite``, ``ctx.evaluate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from amp_jax._src import casting, compat, decision, jaxprs, rules
from amp_jax._src.decision import NO_HINTS, BodyHints, Color, Fused, OpClass
from amp_jax._src.planning import Context, Plan, plan

# -- evaluation -----------------------------------------------------------------


class _Env:
    """Values of a jaxpr being evaluated, and the casts made of them (each once)."""

    def __init__(self, layouts: Mapping[Any, Any] | None = None):
        self.vals: dict[Any, Any] = {}
        self.casts: dict[tuple[Any, Any], Any] = {}
        #: the plan's dot layouts (`Plan.layouts`), by the first output of their eqn
        self.layouts = layouts or {}

    def write(self, v: Any, val: Any) -> None:
        if not compat.is_drop_var(v):
            self.vals[v] = val

    def read_broadcast(self, atom: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Reads ``atom`` broadcast to ``shape`` *before* casting it to ``dtype``.

        For an operand that a low-precision op broadcasts implicitly (a bias
        of shape [1, n] added to [b, n]): the transpose of the broadcast -- a
        sum over the batch -- then runs in the operand's float32, not bf16.
        """
        if isinstance(atom, compat.Literal) or tuple(atom.aval.shape) == tuple(shape):
            return self.read(atom, dtype)
        # Broadcast in the operand's own dtype, upcasting a value that its
        # producer already wrote low (a bias reshaped in bf16), so that the
        # backward sum accumulates in float32.
        orig = casting.dtype_of(atom)
        in_shape = tuple(atom.aval.shape)
        if (
            dtype is None
            or np.dtype(orig) == dtype
            or len(shape) != len(in_shape)
            or any(a not in (b, 1) for a, b in zip(in_shape, shape))
        ):
            return self.read(atom, dtype)
        key = (atom, dtype, tuple(shape))
        if key not in self.casts:
            val = self.read(atom, orig)
            full = lax.broadcast_in_dim(val, shape, tuple(range(val.ndim)))
            self.casts[key] = lax.convert_element_type(full, dtype)
        return self.casts[key]

    def read(self, atom: Any, dtype: Any) -> Any:
        if isinstance(atom, compat.Literal):
            val = compat.literal_value(atom)
            if dtype is not None and np.dtype(getattr(val, "dtype", type(val))) != dtype:
                return compat.cast_constant(val, dtype)
            return val
        val = self.vals[atom]
        if not hasattr(val, "dtype"):
            # a Python scalar, as some primitives give (a psum over a vmap axis
            # of an unbatched Python float): read like a literal
            return val if dtype is None else compat.cast_constant(val, dtype)
        if dtype is None or np.dtype(val.dtype) == dtype:
            return val
        key = (atom, dtype)
        if key not in self.casts:
            self.casts[key] = casting.cast(val, dtype)
        return self.casts[key]


@dataclasses.dataclass(frozen=True)
class Interpreter(Context):
    """A planning `Context` that also rewrites and evaluates: what the rules
    (``elementwise.RuleContext``) are handed, for the rules of higher-order
    primitives (``higher_order.py``) to rewrite their sub-jaxprs."""

    def rewrite(
        self, closed: Any, in_avals: Sequence[Any] | None = None, hints: BodyHints = NO_HINTS
    ) -> Any:
        return rewrite(self, closed, in_avals, hints)

    def evaluate(self, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True) -> list[Any]:
        return evaluate(self, plan_, args, cast_outputs)

    def rule_for(self, eqn: Any, op_class: OpClass | None) -> Any:
        """The rule that binds ``eqn`` (`rules.rule_for`)."""
        return rules.rule_for(eqn, op_class)


def rewrite(
    ctx: Context,
    closed: Any,
    in_avals: Sequence[Any] | None = None,
    hints: BodyHints = NO_HINTS,
) -> Any:
    """``closed`` rewritten under ``ctx``: a closed jaxpr with the same output
    avals, taking ``in_avals`` (default: ``closed``'s own), planned with
    ``hints`` (`planning.plan`). Once per context."""

    def make() -> Any:
        plan_ = plan(ctx, closed, hints)
        avals = compat.in_avals(closed) if in_avals is None else in_avals
        return compat.trace_to_closed_jaxpr(lambda *a: evaluate(ctx, plan_, a), avals)

    key = ("rewrite", hints) if in_avals is None else ("rewrite", hints, tuple(in_avals))
    return ctx.cached(key, closed, make)


def evaluate(
    ctx: Context, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True
) -> list[Any]:
    """Evaluates a planned jaxpr on ``args`` under the caller's trace; outputs
    keep their dtypes (unless ``cast_outputs`` is false: then as computed)."""
    jaxpr = plan_.jaxpr
    env = _Env({jaxpr.eqns[i].outvars[0]: lay for i, lay in plan_.layouts.items()})
    cd = ctx.policy.compute_dtype

    def bind(i: int, eqn: Any, d: decision.Decision, env: _Env) -> Sequence[Any]:
        if d.fused is Fused.HERE:
            match, impl = plan_.fused[i]
            return [match.evaluate(env.read, cd, impl)]
        return rules.rule_for(eqn, d.op_class).evaluate(ctx, eqn, d, env)

    def by_decision(i: int, eqn: Any, env: _Env) -> Sequence[Any]:
        d = plan_.decisions[i]
        if d.fused is Fused.INSIDE:
            return ()  # computed by the fused attention
        names = decision.scopes(d)  # its reason, for the ops it becomes
        if not names:
            return bind(i, eqn, d, env)
        with contextlib.ExitStack() as stack:
            for scope in names:
                stack.enter_context(jax.named_scope(scope))
            return bind(i, eqn, d, env)

    def output(v: Any) -> Any:
        return env.read(
            v, casting.target(casting.dtype_of(v), Color.ORIG, cd) if cast_outputs else None
        )

    consts = compat.consts_of(plan_.closed)
    return jaxprs.eval_jaxpr(jaxpr, consts, args, by_decision, env, output)
