"""The rules of first-order primitives (the base, `EqnRule`, is ``base.py``).

Broadcasting elementwise ops read implicitly broadcast operands before
casting them (`BroadcastRule`); ops whose derivative sums (broadcasts,
gathers, selections) keep those sums in float32 (`ExpandRule`). Each rule
also answers `EqnRule.reads_low`: whether it reads an operand only in the
compute dtype, which is what the scan cast hoisting needs to know.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from amp_jax._src import casting, compat, jaxprs
from amp_jax._src.context import Context
from amp_jax._src.decision import Color, Decision
from amp_jax._src.policy import is_managed_float
from amp_jax._src.rules.base import CastingEnv, EqnRule


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

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        if any(_held_wide(env, v, cd) for v in eqn.invars):
            outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
            return [casting.lower(o, cd) for o in outs]
        shape = jaxprs.shape_of(eqn.outvars[0])
        return compat.bind_eqn(
            eqn,
            [
                env.read_broadcast(v, casting.target(casting.dtype_of(v), d.color, cd), shape)
                for v in eqn.invars
            ],
        )

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        # (an operand wider than the compute dtype makes the op compute in it)
        dtype = casting.dtype_of(atom)
        narrow = casting.target(dtype, Color.LOW, ctx.policy.compute_dtype) in (None, dtype)
        same_shape = jaxprs.shape_of(atom) == jaxprs.shape_of(eqn.outvars[0])
        return d.color is Color.LOW and same_shape and narrow


def _held_wide(env: CastingEnv, atom: compat.Atom, compute_dtype: np.dtype) -> bool:
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

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        if d.color is not Color.LOW or not self.sums_in_transpose(eqn):
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
        return [casting.lower(o, cd) for o in outs]

    @classmethod
    def sums_in_transpose(cls, eqn: compat.Eqn) -> bool:
        if not any(is_managed_float(casting.dtype_of(v)) for v in eqn.invars):
            return False
        if eqn.primitive.name in cls.ALWAYS:
            return True
        x, out = jaxprs.shape_of(eqn.invars[0]), jaxprs.shape_of(eqn.outvars[0])
        return int(np.prod(out)) > int(np.prod(x))

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        return d.color is Color.LOW and not self.sums_in_transpose(eqn)


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
