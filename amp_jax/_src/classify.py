"""Classification: what each eqn of a jaxpr is under a context, before painting.

`classify` gives an eqn its `Kind` (an op to paint, an eqn without floats, a
higher-order eqn), its class under the policy (`effective_class`: the
policy's lists, adjusted for what is slower in low precision on the
backend; a follow op that can leave float16's range is ``deny``), and what
keeps an op amp would lower in its original precision (`stays_high`:
float64, an explicit precision, too small; a full_precision scope; no kernel
on this backend), or the rule of ``Policy.rules`` its path matched. A
``custom_jvp`` function of follow/clear ops only is `is_transparent`: painted
like a follow op. Painting (``painted.py``) starts from these records.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from amp_jax._src import casting, compat, jaxprs
from amp_jax._src.backends import Backend
from amp_jax._src.context import Context
from amp_jax._src.decision import Kind, OpClass, PathRule, Reason, Variant, Why
from amp_jax._src.policy import (
    FULL_PRECISION_SCOPE,
    RANGE_WIDENING,
    Policy,
    has_narrow_range,
    is_managed_float,
    rule_fields,
)
from amp_jax._src.rules.dots import float8


@dataclasses.dataclass(frozen=True)
class Classified:
    """What an eqn is, before painting: its kind, class and any reason decided
    already (a policy scope, a size rule, the backend), and the variant it runs."""

    kind: Kind
    op_class: OpClass | None
    reason: Reason | None = None
    variant: Variant = Variant.COMPUTE
    rule: PathRule | None = None


def classify(ctx: Context, eqn: compat.Eqn, rule: PathRule | None = None) -> Classified:
    """What ``eqn`` is under ``ctx`` (its callers keep the results: the
    painting once per jaxpr, not a memo entry per eqn); ``rule``: the rule of
    ``Policy.rules`` its path matched (`Context.rules_of`)."""
    sub = compat.has_subjaxprs(eqn)
    if ctx.identity:
        why = Reason(Why.IDENTITY, "float32 policy: identity, nothing rewritten")
        if sub:
            return Classified(Kind.AS_WRITTEN, None, why)
        return Classified(Kind.OP, OpClass.NEVER, why)
    scope = ctx.scope_of(eqn)
    if scope is not None:
        # (everything an eqn in a full_precision scope holds is in it too)
        if scope != FULL_PRECISION_SCOPE:
            text = f"policy scope {scope!r} (full_precision_scopes): original dtypes"
        else:
            text = "user scope: full_precision, original dtypes"
        why = Reason(Why.FULL_PRECISION, text)
        if sub:
            return Classified(Kind.AS_WRITTEN, None, why)
        return Classified(Kind.OP, OpClass.NEVER, why)
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if not any(is_managed_float(getattr(a, "dtype", None)) for a in avals):
        if sub:
            return Classified(Kind.NESTED, None)
        return Classified(Kind.NO_FLOAT, None)
    if sub:
        if is_transparent(ctx, eqn):
            return Classified(Kind.OP, OpClass.FOLLOW)
        return Classified(Kind.NESTED, None)
    name = eqn.primitive.name
    if rule is not None and ctx.policy.class_of(name) == "allow":
        return _classify_by_rule(ctx, eqn, rule)
    cls = effective_class(ctx.policy, name, ctx.backend)
    if cls is None:
        if ctx.policy.strict:
            raise NotImplementedError(
                f"amp_jax: primitive {name!r} has no class in the policy and "
                "strict=True. Add it to a class, e.g. "
                f"Policy(overrides={{{name!r}: 'follow'}})."
            )
        cls = "follow"
    if cls == "follow" and _leaves_range(ctx.policy, eqn):
        return Classified(Kind.OP, OpClass.DENY, Reason.kept(Why.FLOAT16_RANGE))
    if cls != "allow":
        return Classified(Kind.OP, OpClass(cls))
    high = _stays_high_here(ctx, eqn)
    if high is not None:
        return high
    if float8.applies(ctx.policy, ctx.vjp_rules, eqn):
        return Classified(Kind.OP, OpClass.ALLOW, variant=Variant.FLOAT8)
    return Classified(Kind.OP, OpClass.ALLOW)


def _stays_high_here(ctx: Context, eqn: compat.Eqn) -> Classified | None:
    """An ``allow`` eqn that stays high for a reason of its own (too small, an
    explicit precision), or whose rule runs it in float32 on this backend
    (XLA:CPU's batched dots); None if it may be lowered."""
    kept = stays_high(eqn, ctx.policy)
    if kept is not None:
        return Classified(Kind.OP, OpClass.NEVER, Reason.kept(kept))
    floats = all(is_managed_float(casting.dtype_of(v)) for v in eqn.invars)
    if floats and not ctx.backend.has_low_kernel(eqn):
        return Classified(Kind.OP, OpClass.ALLOW, Reason.kept(Why.BACKEND_KERNEL), Variant.FLOAT32)
    return None


def _classify_by_rule(ctx: Context, eqn: compat.Eqn, rule: PathRule) -> Classified:
    """An ``allow`` eqn whose path a rule of ``Policy.rules`` matched: kept as
    written (a float32 rule), else lowered to the rule's dtype (or its float8)
    unless it stays high for a reason of its own (too small, an explicit
    precision, no kernel on this backend). A rule overrides the backend-aware
    class (the user named the op)."""
    if rule.target == "float32":
        text = f"{rule.text}: left in its original precision"
        return Classified(Kind.OP, OpClass.NEVER, Reason(Why.RULE, text), rule=rule)
    high = _stays_high_here(ctx, eqn)
    if high is not None:
        return high
    sub = rule_policy(ctx.policy, rule.target)
    if float8.applies(sub, ctx.vjp_rules, eqn):
        return Classified(Kind.OP, OpClass.ALLOW, variant=Variant.FLOAT8, rule=rule)
    return Classified(Kind.OP, OpClass.ALLOW, rule=rule)


def is_transparent(ctx: Context, eqn: compat.Eqn) -> bool:
    """A ``custom_jvp_call`` whose body only has follow/clear ops (``jax.nn.relu``).

    Such a call is painted like a follow op, so an activation between two
    matmuls runs in the compute dtype; its JVP rule still applies.
    """
    if eqn.primitive.name not in compat.CUSTOM_JVP_NAMES:
        return False
    body, _, n_consts = compat.custom_jvp_parts(eqn)
    if n_consts:
        return False
    return ctx.cached(
        "transparent",
        body,
        lambda: all(
            c.kind is Kind.NO_FLOAT or c.op_class in (OpClass.FOLLOW, OpClass.CLEAR)
            for c in (classify(ctx, e) for e in compat.jaxpr_of(ctx.prepare(body)).eqns)
        ),
    )


@functools.lru_cache(maxsize=64)
def rule_policy(policy: Policy, target: str) -> Policy:
    """``policy`` with the compute dtype and float8 recipe of a rule's ``target``
    (what the matmuls the rule matched run under)."""
    return policy.replace(**rule_fields(target), rules=())


def effective_class(policy: Policy, name: str, backend: Backend) -> str | None:
    """``policy.class_of(name)`` with the backend-aware adjustment: an ``allow``
    op measured slower in low precision on ``backend`` (`Backend.slower_low`:
    convolutions on XLA:CPU, dots on a CPU without bfloat16 dot instructions) is
    ``never`` under ``Policy(backend_aware=True)`` (unless the user's overrides
    name it)."""
    cls = policy.class_of(name)
    if (
        cls == "allow"
        and policy.backend_aware
        and name not in dict(policy.overrides)
        and backend.slower_low(name, policy.compute_dtype) is not None
    ):
        return "never"
    return cls


def _leaves_range(policy: Policy, eqn: compat.Eqn) -> bool:
    """A follow eqn whose result can leave the range its operands came in,
    under a compute dtype with float16's range (not a policy override): a
    power or reciprocal (``integer_pow``, ``square``), a division by anything
    but a constant of magnitude >= 1, a product of two non-constant operands.
    (bfloat16 has float32's range: these follow their operands there.)"""
    name = eqn.primitive.name
    if (
        name not in RANGE_WIDENING
        or name in dict(policy.overrides)
        or not has_narrow_range(policy.compute_dtype)
    ):
        return False
    if name == "integer_pow":
        return eqn.params["y"] not in (0, 1)
    if name == "div":
        d = eqn.invars[1]
        if isinstance(d, compat.Literal):
            return bool(np.any(np.abs(np.asarray(compat.literal_value(d), np.float64)) < 1))
        return True
    if name == "mul":
        return not any(isinstance(v, compat.Literal) for v in eqn.invars)
    return True


# -- allow ops that stay in float32 ---------------------------------------------


def stays_high(eqn: compat.Eqn, policy: Policy) -> Why | None:
    """Why an ``allow`` eqn stays in its original precision, or None to lower it."""
    dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
    if any(
        d is not None and np.issubdtype(d, np.inexact) and not is_managed_float(d) for d in dtypes
    ):
        return Why.WIDE_OPERAND
    precision = eqn.params.get("precision")
    parts = precision if isinstance(precision, tuple) else (precision,)
    if any(p is not None and getattr(p, "name", str(p)) != "DEFAULT" for p in parts):
        return Why.EXPLICIT_PRECISION
    sizes = jaxprs.contraction_and_flops(eqn)
    if sizes is not None and (
        sizes[0] < policy.min_low_contraction or sizes[1] < policy.min_low_flops
    ):
        return Why.TOO_SMALL
    if eqn.primitive.name == "dot_general" and policy.min_low_flops:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = jaxprs.shape_of(eqn.invars[0]), jaxprs.shape_of(eqn.invars[1])
        free = [n for d, n in enumerate(lhs) if d not in (*lc, *lb)]
        free += [n for d, n in enumerate(rhs) if d not in (*rc, *rb)]
        if int(np.prod(free, dtype=np.int64)) == 1:  # a (batch of) vector-vector dot product(s)
            return Why.TOO_SMALL
    return None


__all__ = (
    "Classified",
    "classify",
    "effective_class",
    "is_transparent",
    "rule_policy",
    "stays_high",
)
