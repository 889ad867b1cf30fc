"""The rule base: how amp binds one eqn as its `Decision` says.

An `EqnRule` binds one primitive (the default: on operands cast to its
color's dtype), reading its operands from a `CastingEnv` (the values of the
jaxpr being rewritten, each cast made once), under a `Context` (the
policy, the backend, and the rewriting of the plans of sub-jaxprs). An
``allow`` primitive runs the low-precision *function* of its `AllowRule`
(a `Rule`: ``default_allow_rule`` unless one is registered). The table of
rules by primitive is ``table.py``; the rules of each family are beside it
(``elementwise.py``, ``dots/``, ``higher_order.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
from jax import lax

from amp_jax._src import casting, compat, jaxprs
from amp_jax._src.context import Context
from amp_jax._src.decision import Color, Decision, Variant
from amp_jax._src.policy import HIGH_DTYPE, is_managed_float

#: ``rule(eqn, invals, compute_dtype, out_dtype) -> list of outputs``: the
#: low-precision function of an ``allow`` primitive ([`register_rule`][amp_jax.register_rule]).
Rule = Callable[[Any, Sequence[Any], np.dtype, np.dtype], list[Any]]


class CastingEnv(jaxprs.Env):
    """The values of a jaxpr being rewritten (`jaxprs.Env`), and the casts made
    of them, each once: what a rule reads its operands from, in the dtype it
    asks for (``read(atom, dtype)``; ``None``: as held)."""

    def __init__(self, layouts: Mapping[Any, Any] | None = None):
        super().__init__()
        self.casts: dict[tuple[Any, ...], Any] = {}
        #: the plan's dot layouts (`Plan.layouts`), by the first output of their eqn
        self.layouts = layouts or {}

    def read_broadcast(self, atom: compat.Atom, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Reads ``atom`` broadcast to ``shape`` *before* casting it to ``dtype``.

        For an operand that a low-precision op broadcasts implicitly (a bias
        of shape [1, n] added to [b, n]): the transpose of the broadcast -- a
        sum over the batch -- then runs in the operand's float32, not bf16.
        """
        if isinstance(atom, compat.Literal) or jaxprs.shape_of(atom) == tuple(shape):
            return self.read(atom, dtype)
        # Broadcast in the operand's own dtype, upcasting a value that its
        # producer already wrote low (a bias reshaped in bf16), so that the
        # backward sum accumulates in float32.
        orig = casting.dtype_of(atom)
        in_shape = jaxprs.shape_of(atom)
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

    def read(self, atom: compat.Atom, dtype: Any = None) -> Any:
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


class EqnRule:
    """How amp binds one primitive. The default: bind it with every operand
    cast to the dtype of the eqn's color (`casting.target`)."""

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        """The outputs of ``eqn`` as decided by ``d``, under ``ctx`` (policy,
        backend), reading operands from ``env``."""
        cd = ctx.policy.compute_dtype
        invals = [env.read(v, casting.target(casting.dtype_of(v), d.color, cd)) for v in eqn.invars]
        out = jaxprs.bind_jitted(eqn, invals)  # (JAX linearizes it once per jaxpr)
        return compat.bind_eqn(eqn, invals) if out is None else out

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        """Whether ``evaluate`` reads operand ``atom`` only in the compute dtype."""
        return d.color is Color.LOW


class AllowRule(EqnRule):
    """An ``allow`` primitive: painted low, it runs ``fn`` (a `Rule`) on
    its operands as stored, or the function of the variant its decision names
    (``variants``, given where the table is built: ``table.py``); otherwise
    (kept high, or not in the allow class under this policy) it is bound like
    any other op."""

    def __init__(
        self,
        fn: Rule | None = None,
        variants: dict[Variant, Callable[[Any, Decision], Rule]] | None = None,
    ):
        self.fn = fn
        #: variant -> ``make(ctx, decision) -> Rule``
        self.variants: dict[Variant, Callable[[Any, Decision], Rule]] = dict(variants or {})

    def low_fn(self, ctx: Context, eqn: compat.Eqn) -> Rule:
        """The function of a lowered eqn. Inside custom JVP rules (which JAX
        transposes: no custom_vjp may appear) the plain default."""
        return self.fn if self.fn is not None and ctx.vjp_rules else default_allow_rule

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        if not d.lowered:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        if d.rule is not None and d.rule.dtype != cd:  # (Policy.rules: its own dtype)
            cd = d.rule.dtype
            invals = [
                env.read(v, cd if is_managed_float(casting.dtype_of(v)) else None)
                for v in eqn.invars
            ]
        else:
            invals = [env.read(v, None) for v in eqn.invars]
        if d.variant is Variant.FLOAT32:  # no compute-dtype kernel on this backend
            return default_allow_rule(eqn, [v.astype(HIGH_DTYPE) for v in invals], HIGH_DTYPE)
        make = self.variants.get(d.variant)
        fn = make(ctx, d) if make is not None and ctx.vjp_rules else self.low_fn(ctx, eqn)
        # (a lowered allow op's decision names what its rule writes)
        return fn(eqn, invals, cd, cast(np.dtype, d.out_dtype))

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        own = d.rule is None or d.rule.dtype == ctx.policy.compute_dtype
        return d.color is Color.LOW and d.variant is not Variant.FLOAT32 and own


def acc_dtype(eqn: compat.Eqn, out_dtype: Any = HIGH_DTYPE) -> Any:
    """The result dtype: ``out_dtype`` unless the user asked for a non-float
    one (integer dots) or a wider one (float64)."""
    pet = eqn.params.get("preferred_element_type")
    if pet is not None and not is_managed_float(pet):
        return pet
    return out_dtype


def default_allow_rule(
    eqn: compat.Eqn,
    invals: Sequence[Any],
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
) -> list[Any]:
    vals = [casting.lower(v, compute_dtype) for v in invals]
    params = dict(eqn.params)
    if "preferred_element_type" in params:
        params["preferred_element_type"] = acc_dtype(eqn, out_dtype)
    return compat.bind_eqn(eqn, vals, params)
