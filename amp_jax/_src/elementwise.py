"""The rules of first-order primitives: how amp binds an eqn as its `Decision` says.

`EqnRule` is the default: bind the primitive on operands cast to its color's
dtype. Broadcasting elementwise ops read implicitly broadcast operands before
casting them (`BroadcastRule`); ops whose derivative sums (broadcasts,
gathers, selections) keep those sums in float32 (`ExpandRule`); ``allow`` ops
run the low-precision *function* of their rule, or of the variant the plan
chose (float32 where the backend has no kernel, fp8 under a float8 policy)
(`AllowRule`). Each rule also answers `EqnRule.reads_low`: whether it reads an
operand only in the compute dtype, which is what the scan cast hoisting needs
to know.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from amp_jax._src import casting, compat
from amp_jax._src.backends import Backend
from amp_jax._src.decision import BodyHints, Color, Decision, Variant
from amp_jax._src.policy import HIGH_DTYPE, Policy, is_managed_float

#: ``rule(eqn, invals, compute_dtype, out_dtype) -> list of outputs``: the
#: low-precision function of an ``allow`` primitive ([`register_rule`][amp_jax.register_rule]).
Rule = Callable[[Any, Sequence[Any], np.dtype, np.dtype], list[Any]]


class RuleContext(Protocol):
    """What a rule reads of the context it binds under (``interpreter.Interpreter``):
    the configuration, the trace's memo, and the planning, rewriting and
    evaluation of sub-jaxprs (for the rules of higher-order primitives)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def backend(self) -> Backend:
        """The backend record planned for (resolved once per trace)."""

    @property
    def vjp_rules(self) -> bool:
        """Whether allow ops use their own rules (off in code JAX will transpose)."""

    @property
    def linear(self) -> RuleContext:
        """This context without the custom_vjp rules."""

    def cached(self, kind: Any, obj: Any, make: Callable[[], Any]) -> Any: ...

    def plan(self, closed: Any, hints: BodyHints = ...) -> Any: ...

    def all_low(self, closed: Any) -> Any: ...

    def rewrite(
        self, closed: Any, in_avals: Sequence[Any] | None = None, hints: BodyHints = ...
    ) -> Any: ...

    def evaluate(self, plan_: Any, args: Sequence[Any], cast_outputs: bool = True) -> list[Any]: ...

    def rule_for(self, eqn: Any, op_class: Any) -> EqnRule: ...


class Env(Protocol):
    """The values of the jaxpr being evaluated (``interpreter._Env``)."""

    vals: dict[Any, Any]
    #: {(var, dtype): cast} of the casts made so far (each once)
    casts: dict[tuple[Any, Any], Any]
    #: the plan's dot layouts (`Plan.layouts`), by the first output of their eqn
    layouts: Mapping[Any, Any]

    def read(self, atom: Any, dtype: Any) -> Any: ...

    def read_broadcast(self, atom: Any, dtype: Any, shape: tuple[int, ...]) -> Any: ...


class EqnRule:
    """How amp binds one primitive. The default: bind it with every operand
    cast to the dtype of the eqn's color (`casting.target`)."""

    def evaluate(self, ctx: RuleContext, eqn: Any, d: Decision, env: Env) -> list[Any]:
        """The outputs of ``eqn`` as decided by ``d``, under ``ctx`` (policy,
        backend), reading operands from ``env``."""
        cd = ctx.policy.compute_dtype
        return compat.bind_eqn(
            eqn, [env.read(v, casting.target(casting.dtype_of(v), d.color, cd)) for v in eqn.invars]
        )

    def reads_low(self, ctx: RuleContext, eqn: Any, d: Decision, atom: Any) -> bool:
        """Whether ``evaluate`` reads operand ``atom`` only in the compute dtype."""
        return d.color is Color.LOW


class BroadcastRule(EqnRule):
    """n-ary elementwise ops (``add``, ``mul``, ``max``, ``select_n``, ...).

    Painted low, such an op with an operand held in float32 that it would
    cast down (a parameter, a float32 result) computes in float32 instead,
    the low operands cast up, and casts its result to the compute dtype (as
    ``torch.autocast`` promotes mixed elementwise ops to the widest input):
    whatever broadcast the float32 operand gets, the implicit one of the op or
    one an outer ``jax.vmap`` adds to an unbatched parameter, its transpose
    -- a sum over the batch -- runs in float32. With only low operands it
    reads a size-1-broadcast operand (a bias of shape [1, n] added to
    [b, n]) broadcast *before* the cast, for the same reason."""

    def evaluate(self, ctx: RuleContext, eqn: Any, d: Decision, env: Env) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        if any(_held_wide(env, v, cd) for v in eqn.invars):
            outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
            return [casting.lower(o, cd) for o in outs]
        shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        return compat.bind_eqn(
            eqn,
            [
                env.read_broadcast(v, casting.target(casting.dtype_of(v), d.color, cd), shape)
                for v in eqn.invars
            ],
        )

    def reads_low(self, ctx: RuleContext, eqn: Any, d: Decision, atom: Any) -> bool:
        # (an operand wider than the compute dtype makes the op compute in it)
        out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        dtype = casting.dtype_of(atom)
        narrow = casting.target(dtype, Color.LOW, ctx.policy.compute_dtype) in (None, dtype)
        return d.color is Color.LOW and tuple(atom.aval.shape) == out_shape and narrow


def _held_wide(env: Env, atom: Any, compute_dtype: np.dtype) -> bool:
    """Whether ``env`` holds variable ``atom`` in a float dtype wider than the
    one a low op reads it in (a float32 value it would cast down)."""
    if isinstance(atom, compat.Literal):
        return False
    low = casting.target(casting.dtype_of(atom), Color.LOW, compute_dtype)
    held = env.read(atom, None).dtype
    return low is not None and np.dtype(held).itemsize > np.dtype(low).itemsize


class ExpandRule(EqnRule):
    """Ops whose derivative adds values: the transpose of ``broadcast_in_dim``
    and ``tile`` (``jnp.tile``, ``jnp.repeat``, ``broadcast_to``, explicit
    bias broadcasts) sums over the copies; of ``gather`` (an embedding lookup,
    indexing with repeated indices), ``sort`` and ``top_k``, it scatter-adds;
    the JVP rules of the selections ``reduce_max``/``reduce_min`` count ties
    and sum the tangents of the chosen elements, those of ``cummax``/``cummin``
    and of overlapping max pooling (``reduce_window_max``/``min``, whose
    transpose is ``select_and_scatter_add``) sum the cotangents of every
    position that chose an element; ``scatter-add`` sums in its forward pass.
    Painted low, such an op reads its float operands in their own dtype
    (float32) and casts its float *results* to the compute dtype, so that
    these sums accumulate in float32, as the implicit broadcasts of
    `BroadcastRule` do; the values are the same (a selection of
    compute-dtype values is exact in float32)."""

    #: the primitives whose derivative sums whatever their shapes
    ALWAYS = frozenset(
        {
            "gather",
            "sort",
            "top_k",
            "reduce_max",
            "reduce_min",
            "cummax",
            "cummin",
            "reduce_window_max",
            "reduce_window_min",
            "scatter-add",
            "scatter_add",
        }
    )

    def evaluate(self, ctx: RuleContext, eqn: Any, d: Decision, env: Env) -> list[Any]:
        if d.color is not Color.LOW or not self.sums_in_transpose(eqn):
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
        return [casting.lower(o, cd) for o in outs]

    @classmethod
    def sums_in_transpose(cls, eqn: Any) -> bool:
        if not any(is_managed_float(casting.dtype_of(v)) for v in eqn.invars):
            return False
        if eqn.primitive.name in cls.ALWAYS:
            return True
        x, out = eqn.invars[0].aval, eqn.outvars[0].aval
        return int(np.prod(out.shape)) > int(np.prod(x.shape))

    def reads_low(self, ctx: RuleContext, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW and not self.sums_in_transpose(eqn)


class AllowRule(EqnRule):
    """An ``allow`` primitive: painted low, it runs ``fn`` (a `Rule`) on
    its operands as stored, or the function of the variant its decision names
    (``variants``, given where the table is built: ``rules.py``); otherwise
    (kept high, or not in the allow class under this policy) it is bound like
    any other op."""

    def __init__(
        self, fn: Rule | None = None, variants: dict[Variant, Callable[[Any], Rule]] | None = None
    ):
        self.fn = fn
        #: variant -> ``make(ctx) -> Rule``
        self.variants: dict[Variant, Callable[[Any], Rule]] = dict(variants or {})

    def low_fn(self, ctx: RuleContext, eqn: Any) -> Rule:
        """The function of a lowered eqn. Inside custom JVP rules (which JAX
        transposes: no custom_vjp may appear) the plain default."""
        return self.fn if self.fn is not None and ctx.vjp_rules else default_allow_rule

    def evaluate(self, ctx: RuleContext, eqn: Any, d: Decision, env: Env) -> list[Any]:
        if not d.lowered:
            return super().evaluate(ctx, eqn, d, env)
        invals = [env.read(v, None) for v in eqn.invars]
        if d.variant is Variant.FLOAT32:  # no compute-dtype kernel on this backend
            return default_allow_rule(eqn, [v.astype(HIGH_DTYPE) for v in invals], HIGH_DTYPE)
        make = self.variants.get(d.variant)
        fn = make(ctx) if make is not None and ctx.vjp_rules else self.low_fn(ctx, eqn)
        return fn(eqn, invals, ctx.policy.compute_dtype, d.out_dtype)

    def reads_low(self, ctx: RuleContext, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW and d.variant is not Variant.FLOAT32


def acc_dtype(eqn: Any, out_dtype: Any = HIGH_DTYPE) -> Any:
    """The result dtype: ``out_dtype`` unless the user asked for a non-float
    one (integer dots) or a wider one (float64)."""
    pet = eqn.params.get("preferred_element_type")
    if pet is not None and not is_managed_float(pet):
        return pet
    return out_dtype


def default_allow_rule(
    eqn: Any, invals: Sequence[Any], compute_dtype: np.dtype, out_dtype: np.dtype = HIGH_DTYPE
) -> list[Any]:
    vals = [casting.lower(v, compute_dtype) for v in invals]
    params = dict(eqn.params)
    if "preferred_element_type" in params:
        params["preferred_element_type"] = acc_dtype(eqn, out_dtype)
    return compat.bind_eqn(eqn, vals, params)


#: n-ary elementwise primitives that broadcast size-1 dimensions implicitly.
BROADCASTING = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "atan2",
        "rem",
        "pow",
        "nextafter",
        "select_n",
        "clamp",
        "copysign",
    }
)


#: primitive name -> rule
RULES: dict[Any, EqnRule] = {
    **dict.fromkeys(BROADCASTING, BroadcastRule()),
    **dict.fromkeys(("broadcast_in_dim", "tile", *ExpandRule.ALWAYS), ExpandRule()),
}
