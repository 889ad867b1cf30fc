"""Rewriting a jaxpr under a mixed-precision policy: evaluation.

`rewrite` (and `evaluate`, its eager form) evaluate the
`Plan` of a jaxpr (``plans.py``, made by ``planning.py``: one typed
`Decision` per eqn) under the caller's trace:
every eqn is bound through its rule in the primitive-keyed table of
``rules/table.py`` (`table.rule_for`), under the named scopes that carry its
reason (``decision.scopes``). A rule casts its operands (`casting`:
each (value, dtype) cast is made once and shared) and says which operands it
reads only in the compute dtype. Higher-order primitives get their
sub-jaxprs rewritten with the same policy and keep their boundary dtypes:
their rules (``rules/higher_order.py``) rewrite the plans of those bodies
that the eqn's decision holds (the plan is a tree) through the context
(``ctx.rewrite``, ``ctx.evaluate``), which hands them to this module's
functions (`EVALUATOR`, the context's `Evaluator`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax

from amp_jax._src import casting, compat, decision, jaxprs, planning
from amp_jax._src.context import Context, Evaluator
from amp_jax._src.decision import Color, Fused
from amp_jax._src.plans import Plan
from amp_jax._src.rules import table
from amp_jax._src.rules.base import CastingEnv

# -- evaluation -----------------------------------------------------------------


def rewrite(ctx: Context, plan_: Plan, in_avals: Sequence[Any] | None = None) -> Any:
    """The jaxpr ``plan_`` is of (a body's, from its eqn's decision) rewritten
    under ``ctx``: a closed jaxpr with the same output avals, taking
    ``in_avals`` (default: the jaxpr's own). Once per plan and context."""

    def make() -> Any:
        avals = compat.in_avals(plan_.closed) if in_avals is None else in_avals
        return compat.trace_to_closed_jaxpr(lambda *a: evaluate(ctx, plan_, a), avals)

    key = "rewrite" if in_avals is None else ("rewrite", tuple(in_avals))
    return ctx.cached(key, plan_, make)


def evaluate(
    ctx: Context, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True
) -> list[Any]:
    """Evaluates a planned jaxpr on ``args`` under the caller's trace; outputs
    keep their dtypes (unless ``cast_outputs`` is false: then as computed)."""
    jaxpr = plan_.jaxpr
    env = CastingEnv({jaxpr.eqns[i].outvars[0]: lay for i, lay in plan_.layouts.items()})
    cd = ctx.policy.compute_dtype

    def bind(i: int, eqn: compat.Eqn, d: decision.Decision, env: CastingEnv) -> Sequence[Any]:
        if d.fused is Fused.HERE:
            match, impl = plan_.fused[i]
            return [match.evaluate(env.read, cd, impl)]
        return table.rule_for(eqn, d.op_class).evaluate(ctx, eqn, d, env)

    def by_decision(i: int, eqn: compat.Eqn, env: CastingEnv) -> Sequence[Any]:
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


#: the interpreter's functions, handed down in the `Context` of a trace that
#: evaluates (``transform.py``): how a rule of a higher-order primitive
#: rewrites, evaluates or plans the bodies of its eqn (`Context.rewrite`, ...)
EVALUATOR = Evaluator(rewrite, evaluate, planning.plan_lazy, table.rule_for)
