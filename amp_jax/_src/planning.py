"""Planning: one `Decision` for every eqn of a jaxpr.

`plan` runs, once per (trace, closed jaxpr, hints), under a `Context`: a
frozen `Config` (policy, backend) and the `Memo` of the trace:

1. *Prepare* (`Context.prepare`): inline ``jit`` eqns that carry no
   shardings, so that the analysis sees through ``jax.nn``/``jnp`` helpers
   that are jitted internally.
2. *Classify* (`Context.classify`, once per eqn): its kind, its class
   under the policy, and what keeps an op amp would lower in its original
   precision (`stays_high`: float64, an explicit precision, too small;
   a full_precision scope; no kernel on this backend).
3. *Paint* (``painting.py``, pure): colors after TensorFlow's
   auto-mixed-precision pass; an op that reads a constant the compute dtype
   cannot represent stays as written; what decides control flow (a while
   predicate, a cond index, the loop-carried values that feed them) and what
   a loop carries to its next iteration is kept out of the compute dtype.
4. *Attention* (``attention.py``): which attentions run fused.

Every reason is recorded where its decision is made; the `Plan` is
then read by the interpreter and its rules, by ``explain`` and (through the
named scopes of ``decision.py``) by ``dtype_report``. A higher-order eqn's
decision carries the `BodyHints` of its sub-jaxprs (which outputs decide a
loop, which it carries) and the plans of those sub-jaxprs, made with those
hints when the eqn is planned (`BodyPlan`): the plan is a tree, a complete
value, printed whole by `format_plan` without tracing. Only a body that
exists after planning (a custom derivative rule JAX traces later, a ``scan``
body retraced with the loop's concrete masks) is a `LazyBody`, planned by its
rule when it has the jaxpr (`Context.plan_lazy`).

What decides control flow (`decision_seeds`, `decision_slice`) and the loop
fixed point that follows it through a loop's carry (`_loop_reads`) live here,
beside the painting they start from.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self

import jax.numpy as jnp
import numpy as np

from amp_jax._src import attention, casting, compat, float8, jaxprs, painting, paths
from amp_jax._src.backends import Backend
from amp_jax._src.decision import (
    NO_HINTS,
    AttentionPath,
    BodyHints,
    BodyPlan,
    Color,
    Decision,
    Fused,
    Kind,
    LazyBody,
    OpClass,
    PathRule,
    Reason,
    Variant,
    Why,
    body_hints,
    low_allow_text,
)
from amp_jax._src.policy import (
    FULL_PRECISION_SCOPE,
    HIGH_DTYPE,
    RANGE_WIDENING,
    SOLVES,
    Policy,
    has_narrow_range,
    is_managed_float,
    rule_fields,
    scope_in,
)
from amp_jax._src.rules import dots


@dataclasses.dataclass(frozen=True)
class Classified:
    """What an eqn is, before painting: its kind, class and any reason decided
    already (a policy scope, a size rule, the backend), and the variant it runs."""

    kind: Kind
    op_class: OpClass | None
    reason: Reason | None = None
    variant: Variant = Variant.COMPUTE
    rule: PathRule | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """What a plan depends on besides its jaxpr: frozen and hashable.

    Attributes:
      policy: the mixed-precision policy.
      backend: what amp knows of the backend planned for (``backends/``),
        resolved once per trace (``backends.current()``) and handed down to
        every rule, plan and reason that depends on it.
      vjp_rules: allow ops use their custom_vjp rules; off in code JAX will
        transpose (custom JVP rules), where a custom_vjp cannot appear.
      in_paths: the key paths of the traced function's inputs (``paths.input_paths``),
        what ``Policy.rules`` match parameters by; empty without rules.
    """

    policy: Policy
    backend: Backend
    vjp_rules: bool = True
    in_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            raise TypeError(
                f"Config(policy, backend) takes a backends.Backend record, got "
                f"{type(self.backend).__name__} {self.backend!r}; pass backends.current() "
                "(or backends.backend_for(name) where a test plans for another platform)."
            )

    @property
    def identity(self) -> bool:
        return self.policy.is_identity

    @functools.cached_property
    def scopes(self) -> tuple[str, ...]:
        """The full-precision scope names: the user's and the policy's."""
        return (FULL_PRECISION_SCOPE, *self.policy.full_precision_scopes)

    @property
    def linear(self) -> Config:
        """This configuration without the custom_vjp rules (for JVP-rule jaxprs)."""
        return dataclasses.replace(self, vjp_rules=False) if self.vjp_rules else self


class Memo:
    """What one trace derives from its jaxprs and eqns, each made once.

    Keyed by (key, id(object)); the object is kept with its entry so that the
    id stays unique while the trace lives.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[Any, int], tuple[Any, Any]] = {}
        #: every plan made in this trace, in the order its planning began (a
        #: parent before its bodies); None while it is being made
        self.plans: list[Plan | None] = []
        #: the paths of the trace's matmuls, under a policy with rules (`paths.Paths`)
        self.paths: paths.Paths | None = None

    @property
    def attention_log(self) -> list[tuple[str, str | None, str]]:
        """`Plan.attentions` of every plan made in this trace, in order."""
        return [a for p in self.plans if p is not None for a in p.attentions]

    def get(self, key: Any, obj: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``obj`` (by identity) and ``key``."""
        k = (key, id(obj))
        hit = self.table.get(k)
        if hit is None or hit[0] is not obj:
            hit = self.table[k] = (obj, make())
        return hit[1]


@dataclasses.dataclass(frozen=True)
class Context:
    """A `Config` and the `Memo` of the trace it plans: what planning reads.

    ``linear`` shares the memo; its entries are keyed apart by ``vjp_rules``.
    """

    config: Config
    memo: Memo = dataclasses.field(default_factory=Memo, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, Config) or not isinstance(self.memo, Memo):
            raise TypeError(
                f"{type(self).__name__}(config, memo) takes a planning.Config and a Memo, got "
                f"{type(self.config).__name__} and {type(self.memo).__name__}; build one as "
                f"{type(self).__name__}(Config(policy, backend))."
            )

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def backend(self) -> Backend:
        return self.config.backend

    @property
    def vjp_rules(self) -> bool:
        return self.config.vjp_rules

    @property
    def identity(self) -> bool:
        return self.config.identity

    @property
    def linear(self) -> Self:
        """This context without the custom_vjp rules, sharing its memo (of the
        same class: an interpreter's is an interpreter)."""
        return self if not self.vjp_rules else dataclasses.replace(self, config=self.config.linear)

    def cached(self, kind: Any, obj: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``obj`` (by identity) and ``kind`` in this trace."""
        return self.memo.get((self.vjp_rules, kind), obj, make)

    def prepare(self, closed: compat.ClosedJaxpr) -> Any:
        """Inlines sharding-free jits (not under the identity policy, which keeps
        the structure exactly so that results stay bitwise equal). Once per
        ``closed``: the eqns keep their identity for the per-eqn records."""
        if self.identity:
            return closed
        return self.cached("prepare", closed, lambda: inline_jits(closed))

    def plan(self, closed: compat.ClosedJaxpr, hints: BodyHints = NO_HINTS) -> Plan:
        """The plan of closed jaxpr ``closed`` under this context (`plan`)."""
        return plan(self, closed, hints)

    def plan_lazy(self, closed: compat.ClosedJaxpr, hints: BodyHints = NO_HINTS) -> Plan:
        """The plan of a `LazyBody`'s jaxpr, traced after planning (`LazyBody.plan`)."""
        return _plan(self, closed, hints)

    def all_low(self, closed: compat.ClosedJaxpr) -> Plan:
        """The plan of a transparent function painted low (`all_low`), prepared."""
        return all_low(self, self.prepare(closed))

    # -- classification -------------------------------------------------
    def classify(self, eqn: compat.Eqn, rule: PathRule | None = None) -> Classified:
        """What ``eqn`` is under this context (its callers keep the results:
        the painting once per jaxpr, not a memo entry per eqn); ``rule``: the
        rule of ``Policy.rules`` its path matched (`rules_of`)."""
        return _classify(self, eqn, rule)

    def rules_of(self, jaxpr: compat.Jaxpr) -> list[PathRule | None]:
        """The rule of ``Policy.rules`` each eqn of (prepared) ``jaxpr`` matched, if any."""
        found = self.memo.paths
        if found is None or not self.policy.rules:
            return [None] * len(jaxpr.eqns)
        return [found.rule_of(e, jaxpr) for e in jaxpr.eqns]

    def is_transparent(self, eqn: compat.Eqn) -> bool:
        """A ``custom_jvp_call`` whose body only has follow/clear ops (``jax.nn.relu``).

        Such a call is painted like a follow op, so an activation between two
        matmuls runs in the compute dtype; its JVP rule still applies.
        """
        if eqn.primitive.name not in compat.CUSTOM_JVP_NAMES:
            return False
        body, _, n_consts = compat.custom_jvp_parts(eqn)
        if n_consts:
            return False
        return self.cached(
            "transparent",
            body,
            lambda: all(
                c.kind is Kind.NO_FLOAT or c.op_class in (OpClass.FOLLOW, OpClass.CLEAR)
                for c in (self.classify(e) for e in compat.jaxpr_of(self.prepare(body)).eqns)
            ),
        )

    def in_full_precision(self, eqn: compat.Eqn) -> bool:
        return self.scope_of(eqn) is not None

    def scope_of(self, eqn: compat.Eqn) -> str | None:
        """The full-precision scope (whole name) ``eqn`` is traced in, or None."""
        return scope_in(compat.name_stack_str(eqn), self.config.scopes)


def _classify(ctx: Context, eqn: compat.Eqn, rule: PathRule | None = None) -> Classified:
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
        if ctx.is_transparent(eqn):
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


@functools.lru_cache(maxsize=64)
def rule_policy(policy: Policy, target: str) -> Policy:
    """``policy`` with the compute dtype and float8 recipe of a rule's ``target``
    (what the matmuls the rule matched run under)."""
    return policy.replace(**rule_fields(target), rules=())


def _rule_reason(ctx: Context, eqn: compat.Eqn, c: Classified) -> Reason:
    """Why an ``allow`` eqn a rule lowered runs as it does: the rule, then its dtype."""
    rule = c.rule
    assert rule is not None
    sub = rule_policy(ctx.policy, rule.target)
    fp8 = float8.reason(sub, ctx.backend, eqn, c.variant)
    if fp8 is not None:
        return Reason(Why.RULE, f"{rule.text}: {fp8.text}")
    cd = sub.compute_dtype.name
    return Reason(Why.RULE, f"{rule.text}: runs in {cd} (float32 accumulation)")


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


def allow_output_dtype(policy: Policy, backend: Backend) -> np.dtype:
    """The dtype ``allow`` ops write on ``backend`` (``Policy.allow_outputs``)."""
    low = policy.allow_outputs == "compute" or (
        policy.allow_outputs == "auto" and backend.low_outputs
    )
    return policy.compute_dtype if low else HIGH_DTYPE


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


# -- the plan -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What amp decided for one (prepared) closed jaxpr, eqn by eqn: a tree,
    whose higher-order eqns' decisions hold the plans of their bodies
    (`Decision.bodies`). Compared by identity (one per jaxpr, hints and
    context in a trace)."""

    closed: compat.ClosedJaxpr
    decisions: tuple[Decision, ...]
    #: the fused attentions, by the index of the eqn that computes each one
    fused: dict[int, tuple[attention.Match, str]] = dataclasses.field(default_factory=dict)
    #: the backend's layouts of lowered dots, by eqn index (XLA:CPU: `cpu.DotLayout`)
    layouts: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: (source line of the scores matmul, implementation or None, reason) of
    #: every attention recognised in the jaxpr (``attention.py``)
    attentions: tuple[tuple[str, str | None, str], ...] = ()

    @property
    def jaxpr(self) -> Any:
        return compat.jaxpr_of(self.closed)

    def __str__(self) -> str:
        return format_plan(self)


def format_plan(p: Plan) -> str:
    """The plan tree as text: a line per eqn (index, primitive, class, color,
    what an allow op writes, variant and fused part where not the default, the
    reason), under a higher-order eqn the hints of its sub-jaxprs and each
    sub-jaxpr's plan, indented (a body JAX traces later, `LazyBody`, as one
    line), under a dot or transpose the backend's layout record; then the
    attentions found."""
    return "\n".join(_plan_lines(p, ""))


def _plan_lines(p: Plan, indent: str) -> Iterator[str]:
    for i, (eqn, d) in enumerate(zip(p.jaxpr.eqns, p.decisions)):
        what = d.op_class.value if d.op_class is not None else d.kind.value
        out = "" if d.out_dtype is None else f"-> {np.dtype(d.out_dtype).name}"
        extra = [f"variant={d.variant.value}"] if d.variant is not Variant.COMPUTE else []
        extra += [f"fused={d.fused.value}"] if d.fused is not Fused.NO else []
        yield (
            f"{indent}{i:>4} {eqn.primitive.name:<22} {what:<10} {d.color.value:<4} {out:<11} "
            + " ".join([*extra, f"{d.reason.why.value}: {d.reason.text}"])
        )
        hints = dict(d.hints)
        planned = {b.where for b in d.bodies}
        for where, h in d.hints:
            if where not in planned:
                yield f"{indent}{'':>9}{where}: {h}"
        if i in p.layouts:
            yield f"{indent}{'':>9}layout: {p.layouts[i]}"
        for b in d.bodies:
            if isinstance(b.plan, LazyBody):
                yield f"{indent}{'':>9}{b.where}: planned when traced ({b.plan.what})"
                continue
            head = f"{indent}{'':>9}{b.where}:"
            yield f"{head} {hints[b.where]}" if b.where in hints else head
            yield from _plan_lines(b.plan, indent + " " * 9)
    for line, impl, why in p.attentions:
        yield f"{indent}attention at {line}: {impl or 'left as written'} ({why})"


def plan(ctx: Context, closed: compat.ClosedJaxpr, hints: BodyHints = NO_HINTS) -> Plan:
    """The plan tree of closed jaxpr ``closed`` (prepared, painted, attention
    found, the plans of its sub-jaxprs in the decisions of their eqns), once
    per context and ``hints`` (what its parent's plan says of its outputs, for
    a sub-jaxpr: `BodyHints`). The planner's entry: amp plans each trace once,
    and the interpreter, ``explain`` and ``dtype_report`` read the tree.
    Under a policy with rules, the paths of the program's matmuls are found
    first (`paths.Paths`)."""
    if ctx.policy.rules and not ctx.identity and ctx.memo.paths is None:
        found = ctx.memo.paths = paths.Paths(ctx.policy, ctx.config.in_paths)
        top = compat.jaxpr_of(ctx.prepare(closed))
        found.start(top)
        found.walk(top, ctx.prepare)
    return _plan(ctx, closed, hints)


def _plan(ctx: Context, closed: compat.ClosedJaxpr, hints: BodyHints) -> Plan:
    def make() -> Plan:
        slot = len(ctx.memo.plans)
        ctx.memo.plans.append(None)
        flat = ctx.prepare(closed)
        draft = _paint(ctx, compat.jaxpr_of(flat), hints)
        att = _plan_attention(ctx, flat)
        decisions = draft.decisions(ctx, compat.jaxpr_of(flat), att)
        layouts = dots.plan_layouts(
            compat.jaxpr_of(flat),
            decisions,
            backend=ctx.backend,
            vjp_rules=ctx.vjp_rules,
        )
        made = ctx.memo.plans[slot] = Plan(flat, decisions, att.fused, layouts, tuple(att.log))
        return made

    return ctx.cached(("plan", hints), closed, make)


#: the sub-jaxprs of custom derivative calls that JAX traces after planning
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
        out = [BodyPlan("call_jaxpr", ctx.all_low(body), body)]
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
    for c in (ctx.classify(e) for e in eqns):
        color = Color.ORIG if c.kind is Kind.NO_FLOAT else Color.LOW
        decisions.append(Decision(c.kind, c.op_class, color, reason))
    layouts = dots.plan_layouts(
        compat.jaxpr_of(closed), decisions, backend=ctx.backend, vjp_rules=ctx.vjp_rules
    )
    return Plan(closed, tuple(decisions), layouts=layouts)


@dataclasses.dataclass
class _Draft:
    """A plan being made: classes, colors, the reasons and outputs decided so far."""

    classified: list[Classified]
    colors: list[Color]
    #: eqns kept in their original precision by the painting, with the reason
    kept: dict[int, Reason] = dataclasses.field(default_factory=dict)
    #: low allow eqns whose results decide control flow or a carry: they write float32
    f32_out: set[int] = dataclasses.field(default_factory=set)
    #: {eqn index: {sub-jaxpr param: its hints}} of the higher-order eqns
    bodies: dict[int, dict[str, BodyHints]] = dataclasses.field(default_factory=dict)

    def hint(self, i: int, where: str, hints: BodyHints) -> None:
        """Adds ``hints`` to those of sub-jaxpr ``where`` of eqn ``i``."""
        at = self.bodies.setdefault(i, {})
        at[where] = at.get(where, NO_HINTS) | hints

    @property
    def classes(self) -> list[OpClass | None]:
        return [c.op_class for c in self.classified]

    @property
    def kinds(self) -> list[Kind]:
        return [c.kind for c in self.classified]

    def decisions(
        self, ctx: Context, jaxpr: compat.Jaxpr, att: attention.AttentionPlan
    ) -> tuple[Decision, ...]:
        """One per eqn; equal decisions (the same op in every layer) are one
        object: a plan holds as many objects as it has different decisions."""
        out: list[Decision] = []
        seen: dict[Decision, Decision] = {}
        for i, (eqn, c, color) in enumerate(zip(jaxpr.eqns, self.classified, self.colors)):
            fused = Fused.HERE if i in att.fused else Fused.INSIDE if i in att.skip else Fused.NO
            reason = self.kept.get(i) or c.reason
            if fused is not Fused.NO and reason is not None and reason.why is Why.BACKEND_KERNEL:
                reason = None  # (an attention's own path is its reason)
            out_dtype = None
            if color is Color.LOW and c.op_class is OpClass.ALLOW:  # what its rule writes
                f32 = i in self.f32_out or c.variant is Variant.FLOAT32
                # (a rule's dtype other than the policy's: float32 results, which
                # the policy's low ops around it read in their own dtype)
                f32 = f32 or (c.rule is not None and c.rule.dtype != ctx.policy.compute_dtype)
                out_dtype = HIGH_DTYPE if f32 else allow_output_dtype(ctx.policy, ctx.backend)
            d = Decision(
                c.kind,
                c.op_class,
                color,
                reason or _reason(ctx, eqn, c, color),
                out_dtype,
                c.variant,
                att.paths.get(i),
                fused,
                tuple(self.bodies.get(i, {}).items()),
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
        return Reason(Why.PAINTING if base != "allow" else Why.POLICY_CLASS, _low_text(ctx, eqn))
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


def _low_text(ctx: Context, eqn: compat.Eqn) -> str:
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


def _paint(ctx: Context, jaxpr: compat.Jaxpr, hints: BodyHints = NO_HINTS) -> _Draft:
    """Classes and colors of ``jaxpr``'s eqns, and the hints of their
    sub-jaxprs; ``hints``: what ``jaxpr``'s outputs are to its parent (it is
    a loop body, a while predicate, a cond branch)."""
    classified, colors = _painted(ctx, jaxpr)
    draft = _Draft(list(classified), list(colors))
    if ctx.identity:
        return draft
    # A while loop's exit test (a convergence test: |z' - z| < tol) and what
    # it reads through the carry are computed in float32, matmuls included:
    # compute-dtype operands put a floor of the compute dtype's rounding
    # under the tested difference, and the loop never stops.
    exits = [jaxpr.outvars[k] for k in hints.exits]
    _keep_slice(ctx, draft, jaxpr, exits, Why.DECIDES_EXIT, keep_matmuls=True)
    # What a factorization or solve reads stays out of the compute dtype back
    # to the matmuls (those next to the solve were kept by _painted).
    _keep_slice(ctx, draft, jaxpr, _solve_operands(jaxpr), Why.FEEDS_SOLVE)
    seeds = decision_seeds(ctx, jaxpr, hints.decides)
    _keep_slice(ctx, draft, jaxpr, seeds, Why.DECIDES_CONTROL)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name in ("while", "scan"):
            for where, body in _loop_reads(ctx, eqn).bodies:
                draft.hint(i, where, body)
    # A loop-carried float keeps its dtype through the ops that compute the
    # next carry (an EMA, an Euler step, a residual stream): rounding it in
    # every iteration compounds. The matmuls on the way still read
    # compute-dtype operands but write float32, as for decisions.
    outs = jaxpr.outvars
    carried = [outs[k] for k in hints.carries if is_managed_float(casting.dtype_of(outs[k]))]
    for i, k in _keep_slice(ctx, draft, jaxpr, carried, Why.LOOP_CARRY):
        for where in _carry_bodies(jaxpr.eqns[i]):  # a cond's branches compute the carry too
            draft.hint(i, where, BodyHints(carries=frozenset({k})))
    return draft


def _painted(ctx: Context, jaxpr: compat.Jaxpr) -> tuple[tuple[Classified, ...], tuple[Color, ...]]:
    """The classes of ``jaxpr``'s eqns (an op reading a constant the compute
    dtype cannot hold is kept as written) and their painting, before any
    decision or carry is kept; once per jaxpr (the plan and the loop-decision
    fixed point both start from it)."""

    def make() -> tuple[tuple[Classified, ...], tuple[Color, ...]]:
        seen: dict[Classified, Classified] = {}  # (equal ones shared, as decisions)
        rules = ctx.rules_of(jaxpr)
        classified = [seen.setdefault(c, c) for c in map(ctx.classify, jaxpr.eqns, rules)]
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
        colors = painting.paint(classes, jaxpr, low_follow=in_f32 is None)
        if in_f32 is not None:  # (the follow ops it kept out of the compute dtype say so)
            why = Reason(Why.BACKEND_CLASS, f"backend-aware: {in_f32}")
            for i in painting.follows_between(classes, jaxpr):
                if colors[i] is Color.ORIG:
                    classified[i] = dataclasses.replace(classified[i], reason=why)
        return tuple(classified), tuple(colors)

    return ctx.cached("painted", jaxpr, make)


def _backend_kept(c: Classified) -> bool:
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


# -- what decides control flow: the slice, and the loop fixed point -----------------------


def decision_seeds(ctx: Context, jaxpr: compat.Jaxpr, decide_outs: Iterable[int]) -> list[Any]:
    """The vars of ``jaxpr`` whose values decide control flow: the outputs at
    ``decide_outs`` (a while predicate, or a loop body's carry that feeds one),
    every ``cond`` index, and the operands of each loop that its decisions
    read (the initial carry and consts: `_loop_reads`)."""
    seeds = [jaxpr.outvars[k] for k in decide_outs]
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            seeds.append(eqn.invars[0])
        elif eqn.primitive.name in ("while", "scan"):
            seeds.extend(eqn.invars[k] for k in _loop_reads(ctx, eqn).operands)
    return seeds


def decision_slice(
    jaxpr: compat.Jaxpr,
    kinds: Sequence[Kind],
    classes: Sequence[OpClass | None],
    colors: Sequence[Color],
    seeds: Iterable[Any],
    stops: list[tuple[int, int]] | None = None,
    keep_matmuls: bool = False,
) -> tuple[set[int], set[int], set[int]]:
    """What the values ``seeds`` are computed from, back to the matmuls.

    Returns ``(kept, f32_out, reached)``: the eqns on the way (to be computed
    in their original precision), the low ``allow`` eqns where the slice stops
    (their operands stay low -- that is where the speed is -- but they write
    float32), and the positions of ``jaxpr.invars`` reached. The slice also
    stops at higher-order eqns (whose outputs keep their original dtype);
    ``stops``, if given, collects ``(eqn index, output position)`` of each.

    With ``keep_matmuls`` the low ``allow`` eqns are kept whole too (operands
    included) and the slice goes on through their operands: what a
    convergence test reads must not carry the compute dtype's rounding.
    """
    todo = collections.deque(v for v in seeds if not isinstance(v, compat.Literal))
    if not todo:  # (most jaxprs decide nothing: no def-use map of a whole program for that)
        return set(), set(), set()
    producer, _ = jaxprs.def_use(jaxpr)
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    kept: set[int] = set()
    f32_out: set[int] = set()
    reached: set[int] = set()
    seen: set[Any] = set()
    while todo:
        v = todo.popleft()
        if v in seen:
            continue
        seen.add(v)
        if v in position:
            reached.add(position[v])
        i = producer.get(v)
        if i is None:
            continue
        if colors[i] is Color.LOW and classes[i] is OpClass.ALLOW and not keep_matmuls:
            f32_out.add(i)
        elif kinds[i] is Kind.NESTED:
            if stops is not None:
                stops.append((i, jaxpr.eqns[i].outvars.index(v)))
        elif kinds[i] is not Kind.AS_WRITTEN and i not in kept:
            kept.add(i)
            todo.extend(a for a in jaxpr.eqns[i].invars if not isinstance(a, compat.Literal))
    return kept, f32_out, reached


def _keep_slice(
    ctx: Context,
    draft: _Draft,
    jaxpr: compat.Jaxpr,
    seeds: list[Any],
    why: Why,
    keep_matmuls: bool = False,
) -> list[tuple[int, int]]:
    """Keeps what ``seeds`` are computed from out of the compute dtype (back
    to the matmuls, which write float32, or with ``keep_matmuls`` through
    them, kept whole), recording ``why`` as the reason.
    Returns the (eqn index, output position) of the higher-order eqns reached."""
    stops: list[tuple[int, int]] = []
    kept, f32_out, _ = decision_slice(
        jaxpr, draft.kinds, draft.classes, draft.colors, seeds, stops, keep_matmuls
    )
    for i in kept:
        if draft.colors[i] is Color.LOW:
            draft.colors[i] = Color.ORIG
            _keep(draft, i, why)
        elif _backend_kept(draft.classified[i]):  # (``why`` holds on every backend)
            _keep(draft, i, why)
    for i in f32_out:  # (its operands stay low: the reason says both)
        draft.f32_out.add(i)
        _keep(draft, i, why, _low_text(ctx, jaxpr.eqns[i]))
    return stops


def _keep(draft: _Draft, i: int, why: Why, low_text: str | None = None) -> None:
    """Records ``why`` for eqn ``i`` unless it was kept for a reason already;
    ``low_text``: it reads compute-dtype operands for that reason, and writes float32."""
    c = draft.classified[i]
    if i not in draft.kept and not (c.reason is not None and c.reason.keeps_high):
        draft.kept[i] = (
            Reason.kept(why) if low_text is None else Reason.low_f32_result(why, low_text)
        )


def _carry_bodies(eqn: compat.Eqn) -> list[str]:
    """The params of ``eqn`` holding the closed sub-jaxprs whose outputs are
    ``eqn``'s outputs (``cond`` branches, a ``jit``'s body); none for loops and
    custom rules."""
    if eqn.primitive.name == "cond":
        return [f"branches[{j}]" for j in range(len(eqn.params["branches"]))]
    if eqn.primitive.name in compat.JIT_NAMES and compat.is_closed_jaxpr(eqn.params["jaxpr"]):
        return ["jaxpr"]
    return []


def _reached_inputs(
    ctx: Context, closed: compat.ClosedJaxpr, outs: Iterable[int], exit: bool
) -> set[int]:
    """Input positions of ``closed`` that its decisions (and outputs ``outs``)
    read; ``exit``: ``outs`` decide when a while loop stops, and reach through
    the matmuls too."""
    jaxpr = compat.jaxpr_of(ctx.prepare(closed))
    classified, colors = _painted(ctx, jaxpr)
    kinds = [c.kind for c in classified]
    classes = [c.op_class for c in classified]
    reached = set()
    if exit:
        exits = [jaxpr.outvars[k] for k in outs]
        reached = decision_slice(jaxpr, kinds, classes, colors, exits, None, True)[2]
    seeds = decision_seeds(ctx, jaxpr, outs)
    return reached | decision_slice(jaxpr, kinds, classes, colors, seeds)[2]


def _solve_operands(jaxpr: compat.Jaxpr) -> list[Any]:
    """The operands of ``jaxpr``'s factorizations and solves (`SOLVES`)."""
    return [
        v
        for e in jaxpr.eqns
        if e.primitive.name in SOLVES
        for v in e.invars
        if not isinstance(v, compat.Literal) and is_managed_float(casting.dtype_of(v))
    ]


@dataclasses.dataclass(frozen=True)
class LoopReads:
    """What decides a ``while``/``scan`` eqn's control flow, through its carry.

    Attributes:
      operands: the eqn's operand positions whose values decide it.
      bodies: ``(param, hints)`` of its sub-jaxprs: the outputs of the body
        (and of a while's predicate) that decide it, and those the body carries.
    """

    operands: tuple[int, ...]
    bodies: tuple[tuple[str, BodyHints], ...]


def _loop_reads(ctx: Context, eqn: compat.Eqn) -> LoopReads:
    """What decides the control flow of ``while``/``scan`` eqn ``eqn`` (once per eqn)."""

    def make() -> LoopReads:
        p = eqn.params
        is_while = eqn.primitive.name == "while"
        if is_while:
            cn, bn = compat.while_split(p)
            body, n_body_consts, where = p["body_jaxpr"], bn, "body_jaxpr"
            first = _reached_inputs(ctx, p["cond_jaxpr"], [0], exit=True)
            carry = {k - cn for k in first if k >= cn}
            reads = [k for k in first if k < cn]
            carry_at = cn + bn  # carry operands follow the cond and body consts
            n_carry = len(eqn.outvars)
        else:  # scan: consts, carry, xs
            n_consts, n_carry = compat.scan_split(p)
            body, n_body_consts, where, reads = p["jaxpr"], n_consts, "jaxpr", []
            carry, carry_at = set(), n_consts
        body_reads: set[int] = set()
        while True:  # loop-carried: a carry read by a decision is one too
            body_reads = _reached_inputs(ctx, body, sorted(carry), exit=is_while)
            new = carry | {k - n_body_consts for k in body_reads if k >= n_body_consts}
            if not is_while:
                new = {k for k in new if k < n_carry}
            if new == carry:
                break
            carry = new
        decides = frozenset(carry)
        bodies = [
            (
                where,
                BodyHints(decides, decides if is_while else frozenset(), frozenset(range(n_carry))),
            )
        ]
        if is_while:
            bodies.insert(0, ("cond_jaxpr", BodyHints(frozenset({0}), frozenset({0}))))
        consts = [k for k in body_reads if k < n_body_consts]
        if is_while:
            consts = [cn + k for k in consts]
        operands = tuple(sorted({*reads, *consts, *(carry_at + k for k in carry)}))
        return LoopReads(operands, tuple(bodies))

    return ctx.cached("loop_reads", eqn, make)


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
    for i, eqn in enumerate(jaxpr.eqns):
        reads_bad = any(
            (isinstance(v, compat.Literal) and _unrepresentable(compat.literal_value(v), dtype))
            or (not isinstance(v, compat.Literal) and v in bad)
            for v in eqn.invars
        )
        if not reads_bad:
            continue
        if eqn.primitive.name in _CONSTANT_PASSTHROUGH and len(eqn.invars) == 1:
            bad.update(eqn.outvars)  # still a constant: judged where it is used
        else:
            found.append(i)
    return found


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


# -- preparing: inlining jits ----------------------------------------------------------


def inline_jits(closed: compat.ClosedJaxpr) -> Any:
    """``closed`` with every sharding-free ``jit`` eqn inlined (recursively),
    spliced in place (`jaxprs.inline`): no re-trace, the other eqns kept."""
    return jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)


__all__ = (
    "AttentionPath",
    "BodyHints",
    "Classified",
    "Config",
    "Context",
    "LoopReads",
    "Memo",
    "Plan",
    "all_low",
    "format_plan",
    "plan",
    "stays_high",
)
