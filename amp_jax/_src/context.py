"""The context a trace is planned and evaluated under: one frozen record.

A `Context` holds what a plan depends on besides its jaxpr -- the policy, the
backend record resolved once per trace, whether allow ops use their custom_vjp
rules, the key paths of the traced function's inputs -- and, outside its
equality, the `Memo` of the trace (what the trace derives from its jaxprs and
eqns, each made once: `Context.cached`, and the plans made so far) and the
`Evaluator` it evaluates with. Planning (``planning.py``) reads the record;
the rules (``rules/``) read it too, and a rule of a higher-order primitive
rewrites, evaluates or plans the bodies of its eqn through it
(`Context.rewrite`, `Context.evaluate`, `Context.plan_lazy`), which call the
interpreter's functions its `Evaluator` holds: the rules sit below the
interpreter that runs them, so the interpreter hands its functions down as
values, as optax hands a transformation's ``init`` and ``update``. Preparing a
jaxpr (`Context.prepare`: its sharding-free ``jit`` eqns inlined) is the
first stage of planning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self

from amp_jax._src import compat, jaxprs, paths
from amp_jax._src.backends import Backend
from amp_jax._src.decision import LazyBody, OpClass, PathRule
from amp_jax._src.plans import Plan
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, scope_in


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


class Evaluator(NamedTuple):
    """The interpreter's functions, handed down in a `Context` (``interpreter.EVALUATOR``).

    Attributes:
      rewrite: ``rewrite(ctx, plan, in_avals)``: a planned body as a closed jaxpr.
      evaluate: ``evaluate(ctx, plan, args, cast_outputs)``: a planned body's outputs.
      plan_lazy: ``plan_lazy(ctx, closed)``: the plan of a body traced after
        planning (``planning.plan_lazy``).
      rule_for: ``rule_for(eqn, op_class)``: the rule that binds ``eqn`` (``rules/table.py``).
    """

    rewrite: Callable[[Context, Plan, Sequence[Any] | None], Any]
    evaluate: Callable[[Context, Plan, Sequence[Any], bool], list[Any]]
    plan_lazy: Callable[[Context, compat.ClosedJaxpr], Plan]
    rule_for: Callable[[compat.Eqn, OpClass | None], Any]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a plan depends on besides its jaxpr (frozen, compared and hashed by
    these), and the trace's memo and evaluator.

    Attributes:
      policy: the mixed-precision policy.
      backend: what amp knows of the backend planned for (``backends/``),
        resolved once per trace (``backends.current()``) and handed down to
        every rule, plan and reason that depends on it.
      vjp_rules: allow ops use their custom_vjp rules; off in code JAX will
        transpose (custom JVP rules), where a custom_vjp cannot appear.
      in_paths: the key paths of the traced function's inputs (``paths.input_paths``),
        what ``Policy.rules`` match parameters by; empty without rules.
      memo: the `Memo` of the trace (``linear`` shares it; its entries are
        keyed apart by ``vjp_rules``).
      evaluator: the interpreter's functions (``interpreter.EVALUATOR``); None
        in a context that only plans.
    """

    policy: Policy
    backend: Backend
    vjp_rules: bool = True
    in_paths: tuple[str, ...] = ()
    memo: Memo = dataclasses.field(default_factory=Memo, compare=False, repr=False)
    evaluator: Evaluator | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            raise TypeError(
                f"Context(policy, backend) takes a backends.Backend record, got "
                f"{type(self.backend).__name__} {self.backend!r}; pass backends.current() "
                "(or backends.backend_for(name) where a test plans for another platform)."
            )
        if not isinstance(self.memo, Memo):
            raise TypeError(
                f"Context(..., memo=) takes a context.Memo, got {type(self.memo).__name__}; "
                "leave it out for a new trace's."
            )

    @property
    def identity(self) -> bool:
        return self.policy.is_identity

    @functools.cached_property
    def lowers_nothing(self) -> bool:
        """Whether no op can run in the compute dtype in this context: a
        backend-aware policy without float8, rules or overrides, on a backend
        where each of its ``allow`` ops is slower low (`Backend.lowers_nothing`)."""
        p = self.policy
        return (
            p.backend_aware
            and p.float8 == "off"
            and not p.rules
            and not p.overrides
            and self.backend.lowers_nothing(p.allow, p.compute_dtype)
        )

    @functools.cached_property
    def scopes(self) -> tuple[str, ...]:
        """The full-precision scope names: the user's and the policy's."""
        return (FULL_PRECISION_SCOPE, *self.policy.full_precision_scopes)

    @property
    def linear(self) -> Self:
        """This context without the custom_vjp rules (for JVP-rule jaxprs), sharing
        its memo and evaluator."""
        return dataclasses.replace(self, vjp_rules=False) if self.vjp_rules else self

    def cached(self, kind: Any, obj: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``obj`` (by identity) and ``kind`` in this trace."""
        return self.memo.get((self.vjp_rules, kind), obj, make)

    def prepare(self, closed: compat.ClosedJaxpr) -> Any:
        """Inlines sharding-free jits (not under the identity policy, which keeps
        the structure exactly so that results stay bitwise equal, nor where no
        op can run low, `lowers_nothing`: there amp's program keeps the jits
        as calls, as ``fn``'s does, and JAX differentiates and lowers each
        once). Once per ``closed``: the eqns keep their identity for the
        per-eqn records."""
        if self.identity or self.lowers_nothing:
            return closed
        return self.cached("prepare", closed, lambda: inline_jits(closed))

    def rules_of(self, jaxpr: compat.Jaxpr) -> list[PathRule | None]:
        """The rule of ``Policy.rules`` each eqn of (prepared) ``jaxpr`` matched, if any."""
        found = self.memo.paths
        if found is None or not self.policy.rules:
            return [None] * len(jaxpr.eqns)
        return [found.rule_of(e, jaxpr) for e in jaxpr.eqns]

    def in_full_precision(self, eqn: compat.Eqn) -> bool:
        return self.scope_of(eqn) is not None

    def scope_of(self, eqn: compat.Eqn) -> str | None:
        """The full-precision scope (whole name) ``eqn`` is traced in, or None."""
        return scope_in(compat.name_stack_str(eqn), self.scopes)

    # -- evaluating, through the interpreter's functions ---------------------------------
    def _evaluator(self) -> Evaluator:
        if self.evaluator is None:
            raise TypeError(
                "amp_jax: this Context only plans (evaluator=None); build it with "
                "evaluator=interpreter.EVALUATOR to rewrite or evaluate plans."
            )
        return self.evaluator

    def rewrite(self, plan_: Plan, in_avals: Sequence[Any] | None = None) -> Any:
        """The jaxpr ``plan_`` is of, rewritten under this context (`interpreter.rewrite`)."""
        return self._evaluator().rewrite(self, plan_, in_avals)

    def evaluate(self, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True) -> list[Any]:
        """``plan_`` evaluated on ``args`` under the caller's trace (`interpreter.evaluate`)."""
        return self._evaluator().evaluate(self, plan_, args, cast_outputs)

    def plan_lazy(self, body: LazyBody, closed: compat.ClosedJaxpr) -> Plan:
        """The plan of ``closed``, the jaxpr of ``body`` traced after planning, under
        this context or, for code JAX transposes (``body.linear``), its `linear` form."""
        ctx = self.linear if body.linear else self
        return self._evaluator().plan_lazy(ctx, closed)

    def rule_for(self, eqn: compat.Eqn, op_class: OpClass | None) -> Any:
        """The rule that binds ``eqn`` (``rules/table.py``'s `rule_for`)."""
        return self._evaluator().rule_for(eqn, op_class)


# -- preparing: inlining jits ----------------------------------------------------------


def inline_jits(closed: compat.ClosedJaxpr) -> Any:
    """``closed`` with every sharding-free ``jit`` eqn inlined (recursively),
    spliced in place (`jaxprs.inline`): no re-trace, the other eqns kept."""
    return jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)


__all__ = ("Context", "Evaluator", "Memo", "inline_jits")
