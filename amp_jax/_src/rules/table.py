"""The rule table: how amp binds each primitive.

Every eqn of a rewritten jaxpr is bound through one `EqnRule`, looked up by
its primitive in `TABLE` (`rule_for`), as the eqn's `Decision` says. The
table is built here, once, from the rules each module defines beside its
primitives (the rule base is ``base.py``): first-order ops (``elementwise.py``), dots, transposes and
convolutions (the ``dots/`` package: ``dots/lowering.py``, with the fp8 variant of
``dots/float8.py``), higher-order primitives (``higher_order.py``). Primitives without an entry
get the generic rule of higher-order primitives, the default ``allow`` rule,
or the plain bind.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import primitives as P

from amp_jax._src import compat
from amp_jax._src.decision import OpClass, Variant
from amp_jax._src.rules import elementwise, higher_order
from amp_jax._src.rules.base import AllowRule, EqnRule, Rule
from amp_jax._src.rules.dots import float8, lowering


def _by_name(rules: dict[Any, EqnRule]) -> dict[str, EqnRule]:
    return {k if isinstance(k, str) else k.name: v for k, v in rules.items()}


#: primitive name -> its rule
TABLE: dict[str, EqnRule] = _by_name(
    {
        **elementwise.RULES,
        **lowering.RULES,
        P.dot_general_p: lowering.DotRule(variants={Variant.FLOAT8: float8.variant_rule}),
        **higher_order.RULES,
    }
)

_BIND = EqnRule()
_ALLOW = AllowRule()


def rule_for(eqn: compat.Eqn, op_class: OpClass | None) -> EqnRule:
    """The rule that binds ``eqn`` (of class ``op_class``): its primitive's entry
    in `TABLE`, else the generic rule of higher-order primitives, the
    default ``allow`` rule, or the plain bind."""
    rule = TABLE.get(eqn.primitive.name)
    if rule is not None:
        return rule
    if compat.has_subjaxprs(eqn):
        return higher_order.GENERIC
    return _ALLOW if op_class is OpClass.ALLOW else _BIND


def register_rule(primitive_name: str, rule: Rule) -> None:
    """Registers the rule amp uses for an ``allow`` primitive.

    Args:
      primitive_name: the primitive's name, e.g. ``jax.lax.dot_general_p.name``.
      rule: ``rule(eqn, invals, compute_dtype, out_dtype) -> list`` of
        outputs. ``invals`` are the operands in their current dtypes;
        ``eqn.params`` are the original params; ``out_dtype`` is the dtype
        the policy wants the op to write on this backend
        (`outputs.allow_output_dtype`), e.g. its
        ``preferred_element_type``. It runs for eqns of the primitive that
        the policy puts in the ``allow`` class and amp lowers.
    """
    if not isinstance(primitive_name, str):
        raise TypeError(
            f"primitive_name must be a str such as 'dot_general', got {primitive_name!r}."
        )
    if not callable(rule):
        raise TypeError(
            f"rule must be a function rule(eqn, invals, compute_dtype, out_dtype), got {rule!r}."
        )
    current = TABLE.get(primitive_name)
    if current is not None and not isinstance(current, AllowRule):
        raise ValueError(
            f"amp_jax binds {primitive_name!r} with its own structural rule "
            f"({type(current).__name__}); register_rule is for allow primitives "
            "(matmul-like ops that have a low-precision form)."
        )
    TABLE[primitive_name] = AllowRule(rule)
