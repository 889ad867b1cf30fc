"""The context a trace is planned under: what a plan depends on, and its memo.

A `Context` is a frozen `Config` (the policy, the backend record resolved
once per trace, whether allow ops use their custom_vjp rules, the key paths
of the traced function's inputs) and the `Memo` of the trace: what the trace
derives from its jaxprs and eqns, each made once (`Context.cached`), and the
plans made so far. Preparing a jaxpr (`Context.prepare`: its sharding-free
``jit`` eqns inlined) is the first stage of planning (``planning.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Self

from amp_jax._src import compat, jaxprs, paths
from amp_jax._src.backends import Backend
from amp_jax._src.decision import PathRule
from amp_jax._src.plans import Plan
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, scope_in


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
                f"{type(self).__name__}(config, memo) takes a context.Config and a Memo, got "
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
        return scope_in(compat.name_stack_str(eqn), self.config.scopes)


# -- preparing: inlining jits ----------------------------------------------------------


def inline_jits(closed: compat.ClosedJaxpr) -> Any:
    """``closed`` with every sharding-free ``jit`` eqn inlined (recursively),
    spliced in place (`jaxprs.inline`): no re-trace, the other eqns kept."""
    return jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)


__all__ = ("Config", "Context", "Memo", "inline_jits")
