"""Planning: one `Decision` for every eqn of a jaxpr, made into a `Plan` tree.

`plan` runs, once per (trace, closed jaxpr, hints), under a `Context`
(``context.py``: a frozen record of policy and backend, with the `Memo` of
the trace). Its stages, a module each, bottom up:

1. *Prepare* (``context.py``, `Context.prepare`): inline ``jit`` eqns that
   carry no shardings, so that the analysis sees through ``jax.nn``/``jnp``
   helpers that are jitted internally.
2. *Classify* (``classify.py``, once per eqn): its kind, its class under the
   policy, and what keeps an op amp would lower in its original precision
   (`stays_high`: float64, an explicit precision, too small; a
   full_precision scope; no kernel on this backend).
3. *Paint* (``painted.py`` over the pure graph functions of ``painting.py``):
   colors after TensorFlow's auto-mixed-precision pass; an op that reads a
   constant the compute dtype cannot represent stays as written.
4. *Keep control flow* (``control.py``): what decides control flow (a while
   predicate, a cond index, the loop-carried values that feed them, found by
   a fixed point through a loop's carry) and what a loop carries to its next
   iteration is kept out of the compute dtype.
5. *Attention* (``attention/``): which attentions run fused.
6. *Decide* (here): each eqn's `Decision` -- its reason (recorded where it is
   made), the dtype an ``allow`` op writes (``rules/dots/outputs.py``), the
   plans of its sub-jaxprs -- and the backend's dot layouts
   (``rules/dots/lowering.py``),
   into a `Plan` (``plans.py``, with its printer `format_plan`).

The `Plan` is then read by the interpreter and its rules, by ``explain`` and
(through the named scopes of ``decision.py``) by ``dtype_report``. A
higher-order eqn's decision carries the `BodyHints` of its sub-jaxprs (which
outputs decide a loop, which it carries) and the plans of those sub-jaxprs,
made with those hints when the eqn is planned (`BodyPlan`): the plan is a
tree, a complete value, printed whole without tracing. Only a body that
exists after planning (a custom derivative rule JAX traces later, a ``scan``
body retraced with the loop's concrete masks) is a `LazyBody`, planned by its
rule when it has the jaxpr (`plan_lazy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from amp_jax._src import attention, compat, paths
from amp_jax._src.classify import Classified, classify, rule_policy
from amp_jax._src.context import Context
from amp_jax._src.control import Draft, make_draft
from amp_jax._src.decision import (
    NO_HINTS,
    BodyHints,
    BodyPlan,
    Color,
    Decision,
    Fused,
    Kind,
    LazyBody,
    OpClass,
    Reason,
    Variant,
    Why,
    body_hints,
)
from amp_jax._src.painted import low_text
from amp_jax._src.plans import Plan
from amp_jax._src.policy import HIGH_DTYPE
from amp_jax._src.rules.dots import float8, lowering, outputs


def plan(ctx: Context, closed: compat.ClosedJaxpr, hints: BodyHints = NO_HINTS) -> Plan:
    """The plan tree of closed jaxpr ``closed`` (prepared, painted, attention
    found, the plans of its sub-jaxprs in the decisions of their eqns), once
    per context and ``hints`` (what its parent's plan says of its outputs, for
    a sub-jaxpr: `BodyHints`). The planner's entry: amp plans each trace once,
    and the interpreter, ``explain`` and ``dtype_report`` read the tree.
    Under a policy with rules, the paths of the program's matmuls are found
    first (`paths.Paths`)."""
    if ctx.policy.rules and not ctx.identity and ctx.memo.paths is None:
        found = ctx.memo.paths = paths.Paths(ctx.policy, ctx.in_paths)
        top = compat.jaxpr_of(ctx.prepare(closed))
        found.start(top)
        found.walk(top, ctx.prepare)
    return _plan(ctx, closed, hints)


def _plan(ctx: Context, closed: compat.ClosedJaxpr, hints: BodyHints) -> Plan:
    def make() -> Plan:
        slot = len(ctx.memo.plans)
        ctx.memo.plans.append(None)
        flat = ctx.prepare(closed)
        draft = make_draft(ctx, compat.jaxpr_of(flat), hints)
        att = _plan_attention(ctx, flat)
        decisions = _decisions(ctx, draft, compat.jaxpr_of(flat), att)
        layouts = lowering.plan_layouts(
            compat.jaxpr_of(flat),
            decisions,
            backend=ctx.backend,
            vjp_rules=ctx.vjp_rules,
        )
        made = ctx.memo.plans[slot] = Plan(flat, decisions, att.fused, layouts, tuple(att.log))
        return made

    return ctx.cached(("plan", hints), closed, make)


def plan_lazy(ctx: Context, closed: compat.ClosedJaxpr) -> Plan:
    """The plan of a `LazyBody`'s jaxpr, traced after planning (a rule plans it
    through ``ctx.plan_lazy``: `Context.plan_lazy`, ``interpreter.EVALUATOR``)."""
    return _plan(ctx, closed, NO_HINTS)


_JVP_RULE = LazyBody("custom_jvp rule, traced when JAX differentiates the call", linear=True)
_VJP_FWD = LazyBody("custom_vjp forward, traced when JAX differentiates the call")
_VJP_BWD = LazyBody("custom_vjp backward rule, traced when JAX transposes the call")


def subjaxprs(eqn: compat.Eqn) -> Iterator[tuple[str, Any]]:
    """``(param, closed jaxpr)`` of each sub-jaxpr of ``eqn``'s params (an
    open one closed, but for an open one with constvars: values of the
    enclosing trace), in the order of the params (``jaxprs_in_params``'s)."""
    for k, v in eqn.params.items():
        vals = v if isinstance(v, tuple) else (v,)
        for j, x in enumerate(vals):
            where = f"{k}[{j}]" if isinstance(v, tuple) else k
            if compat.is_closed_jaxpr(x):
                yield where, x
            elif compat.is_open_jaxpr(x) and not x.constvars:
                yield where, compat.close(x, [])


def _bodies(ctx: Context, eqn: compat.Eqn, d: Decision) -> tuple[BodyPlan, ...]:
    """The plans of ``eqn``'s sub-jaxprs that its rule rewrites as ``d``
    says, made now: each with the hints ``d`` gives it; a transparent
    ``custom_jvp`` function painted low, its body with every op low
    (`all_low`); the bodies of custom derivative rules, lazy."""
    name = eqn.primitive.name
    # (higher-order eqns are NESTED, or a transparent custom_jvp function an OP)
    if d.kind is not Kind.NESTED and not (d.kind is Kind.OP and name in compat.CUSTOM_JVP_NAMES):
        return ()
    if d.color is Color.LOW and name in compat.CUSTOM_JVP_NAMES:
        body = compat.custom_jvp_parts(eqn)[0]
        out = [BodyPlan("call_jaxpr", all_low(ctx, ctx.prepare(body)), body)]
    elif d.color is Color.ORIG:
        out = [BodyPlan(w, _plan(ctx, s, body_hints(eqn, d, s)), s) for w, s in subjaxprs(eqn)]
    else:
        return ()
    if name in compat.CUSTOM_JVP_NAMES:
        out.append(BodyPlan("jvp_jaxpr_fun", _JVP_RULE))
    if name in compat.CUSTOM_VJP_NAMES:
        out += [BodyPlan("fwd_jaxpr_thunk", _VJP_FWD), BodyPlan("bwd", _VJP_BWD)]
    return tuple(out)


def all_low(ctx: Context, closed: compat.ClosedJaxpr) -> Plan:
    """The plan of a transparent function painted low (``custom_jvp``'s body):
    every op low."""
    eqns = compat.jaxpr_of(closed).eqns
    reason = Reason(Why.PAINTING, "in a function of follow/clear ops painted low")
    decisions = []
    for c in (classify(ctx, e) for e in eqns):
        color = Color.ORIG if c.kind is Kind.NO_FLOAT else Color.LOW
        decisions.append(Decision(c.kind, c.op_class, color, reason))
    layouts = lowering.plan_layouts(
        compat.jaxpr_of(closed), decisions, backend=ctx.backend, vjp_rules=ctx.vjp_rules
    )
    return Plan(closed, tuple(decisions), layouts=layouts)


def _decisions(
    ctx: Context, draft: Draft, jaxpr: compat.Jaxpr, att: attention.AttentionPlan
) -> tuple[Decision, ...]:
    """One per eqn of ``draft``; equal decisions (the same op in every layer)
    are one object: a plan holds as many objects as it has different decisions."""
    out: list[Decision] = []
    seen: dict[Decision, Decision] = {}
    for i, (eqn, c, color) in enumerate(zip(jaxpr.eqns, draft.classified, draft.colors)):
        fused = Fused.HERE if i in att.fused else Fused.INSIDE if i in att.skip else Fused.NO
        reason = draft.kept.get(i) or c.reason
        if fused is not Fused.NO and reason is not None and reason.why is Why.BACKEND_KERNEL:
            reason = None  # (an attention's own path is its reason)
        out_dtype = None
        if color is Color.LOW and c.op_class is OpClass.ALLOW:  # what its rule writes
            f32 = i in draft.f32_out or c.variant is Variant.FLOAT32
            # (a rule's dtype other than the policy's: float32 results, which
            # the policy's low ops around it read in their own dtype)
            f32 = f32 or (c.rule is not None and c.rule.dtype != ctx.policy.compute_dtype)
            out_dtype = HIGH_DTYPE if f32 else outputs.allow_output_dtype(ctx.policy, ctx.backend)
        d = Decision(
            c.kind,
            c.op_class,
            color,
            reason or _reason(ctx, eqn, c, color),
            out_dtype,
            c.variant,
            att.paths.get(i),
            fused,
            tuple(draft.bodies.get(i, {}).items()),
            rule=c.rule,
        )
        bodies = _bodies(ctx, eqn, d)
        if bodies:
            d = dataclasses.replace(d, bodies=bodies)
        out.append(seen.setdefault(d, d))
    return tuple(out)


def _reason(ctx: Context, eqn: compat.Eqn, c: Classified, color: Color) -> Reason:
    """Why an eqn that nothing kept as written got ``color``: its class and the painting."""
    if c.kind is Kind.NO_FLOAT:
        return Reason(Why.NO_FLOAT, "no floating operand")
    if c.kind is Kind.NESTED:
        return Reason(Why.HIGHER_ORDER, "higher-order op: body rewritten, boundary dtypes kept")
    if c.rule is not None:
        return _rule_reason(ctx, eqn, c)
    pol, name = ctx.policy, eqn.primitive.name
    cd = pol.compute_dtype.name
    base = pol.class_of(name)
    if base == "allow" and c.op_class is OpClass.NEVER:
        slower = ctx.backend.slower_low(name, pol.compute_dtype)
        return Reason(Why.BACKEND_CLASS, f"backend-aware: {slower}, kept as written")
    if c.op_class is OpClass.ALLOW and base == "allow":
        fp8 = float8.reason(ctx.policy, ctx.backend, eqn, c.variant)
        if fp8 is not None:
            return fp8
    if color is Color.LOW:
        return Reason(Why.PAINTING if base != "allow" else Why.POLICY_CLASS, low_text(ctx, eqn))
    if color is Color.HIGH:
        src = "policy override" if name in dict(pol.overrides) else "deny class"
        return Reason(Why.POLICY_CLASS, f"{src}: numerically sensitive, runs in float32")
    if base == "never":
        return Reason(Why.POLICY_CLASS, "never class: left as written")
    if base is None:
        return Reason(Why.POLICY_CLASS, "no class (treated as follow): keeps its operands' dtypes")
    if base in ("follow", "clear"):
        text = f"{base} class: not between two {cd} ops, keeps its operands' dtypes"
        return Reason(Why.PAINTING, text)
    return Reason(Why.POLICY_CLASS, f"{base} class, kept as written")


def _rule_reason(ctx: Context, eqn: compat.Eqn, c: Classified) -> Reason:
    """Why an ``allow`` eqn a rule lowered runs as it does: the rule, then its dtype."""
    rule = c.rule
    assert rule is not None
    sub = rule_policy(ctx.policy, rule.target)
    return outputs.rule_reason(rule.text, sub, ctx.backend, eqn, c.variant)


_NO_ATTENTION = attention.AttentionPlan({}, [], {})


def _plan_attention(ctx: Context, closed: compat.ClosedJaxpr) -> attention.AttentionPlan:
    """The attentions of ``closed``: which run fused, and the path of each one's ops."""
    if ctx.identity or ctx.policy.attention == "off" or not ctx.vjp_rules:
        return _NO_ATTENTION
    jaxpr = compat.jaxpr_of(closed)
    consts = dict(zip(jaxpr.constvars, compat.consts_of(closed)))
    plan_ = attention.plan_attention(
        jaxpr,
        consts,
        mode=ctx.policy.attention,
        backend=ctx.backend,
        compute_dtype=ctx.policy.compute_dtype,
        in_full_precision=ctx.in_full_precision,
    )
    return plan_


__all__ = ("all_low", "plan", "plan_lazy", "subjaxprs")
