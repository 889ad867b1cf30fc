"""Rewriting a jaxpr under a mixed-precision policy: evaluation.

:func:`rewrite` (and :func:`evaluate`, its eager form) evaluate the
:class:`~amp_jax._src.planning.Plan` of a jaxpr (``planning.py``: one typed
:class:`~amp_jax._src.decision.Decision` per eqn) under the caller's trace:
every eqn is bound through its rule in the primitive-keyed table of
``rules.py`` (:func:`rules.rule_for`), under the named scopes that carry its
reason (``decision.scopes``). A rule casts its operands (:mod:`casting`:
each (value, dtype) cast is made once and shared) and says which operands it
reads only in the compute dtype. Higher-order primitives get their
sub-jaxprs rewritten with the same policy and keep their boundary dtypes
(the rules of this module, registered in the table).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from amp_jax._src import casting, compat, decision, rules
from amp_jax._src.decision import Color, Decision, Fused, Kind
from amp_jax._src.planning import Context, Plan, all_low, plan

# -- evaluation -----------------------------------------------------------------


class _Env:
    """Values of a jaxpr being evaluated, and the casts made of them (each once)."""

    def __init__(self):
        self.vals: dict[Any, Any] = {}
        self.casts: dict[tuple[Any, Any], Any] = {}

    def write(self, v: Any, val: Any) -> None:
        if type(v).__name__ != "DropVar":
            self.vals[v] = val

    def read_broadcast(self, atom: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Reads ``atom`` broadcast to ``shape`` *before* casting it to ``dtype``.

        For an operand that a low-precision op broadcasts implicitly (a bias
        of shape [1, n] added to [b, n]): the transpose of the broadcast -- a
        sum over the batch -- then runs in the operand's float32, not bf16.
        """
        if isinstance(atom, compat.Literal) or tuple(atom.aval.shape) == tuple(shape):
            return self.read(atom, dtype)
        # Broadcast in the operand's own dtype, upcasting a value that its
        # producer already wrote low (a bias reshaped in bf16), so that the
        # backward sum accumulates in float32.
        orig = casting.dtype_of(atom)
        in_shape = tuple(atom.aval.shape)
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

    def read(self, atom: Any, dtype: Any) -> Any:
        if isinstance(atom, compat.Literal):
            val = compat.literal_value(atom)
            if dtype is not None and np.dtype(getattr(val, "dtype", type(val))) != dtype:
                return compat.cast_constant(val, dtype)
            return val
        val = self.vals[atom]
        if dtype is None or np.dtype(val.dtype) == dtype:
            return val
        key = (atom, dtype)
        if key not in self.casts:
            self.casts[key] = casting.cast(val, dtype)
        return self.casts[key]


def rewrite(ctx: Context, closed: Any, in_avals: Sequence[Any] | None = None) -> Any:
    """``closed`` rewritten under ``ctx``: a closed jaxpr with the same output
    avals, taking ``in_avals`` (default: ``closed``'s own). Once per context."""

    def make() -> Any:
        plan_ = plan(ctx, closed)
        avals = compat.in_avals(closed) if in_avals is None else in_avals
        return compat.trace_to_closed_jaxpr(lambda *a: evaluate(ctx, plan_, a), avals)

    key = "rewrite" if in_avals is None else ("rewrite", tuple(in_avals))
    return ctx.cached(key, closed, make)


def evaluate(
    ctx: Context, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True
) -> list[Any]:
    """Evaluates a planned jaxpr on ``args`` under the caller's trace; outputs
    keep their dtypes (unless ``cast_outputs`` is false: then as computed)."""
    jaxpr = plan_.jaxpr
    env = _Env()
    for v, c in zip(jaxpr.constvars, compat.consts_of(plan_.closed)):
        env.write(v, c)
    for v, a in zip(jaxpr.invars, args):
        env.write(v, a)
    for idx, (eqn, d) in enumerate(zip(jaxpr.eqns, plan_.decisions)):
        if d.fused is Fused.INSIDE:
            continue  # computed by the fused attention
        with contextlib.ExitStack() as stack:
            for m in compat.eqn_context(eqn):
                stack.enter_context(m)
            for scope in decision.scopes(d):  # its reason, for the ops it becomes
                stack.enter_context(jax.named_scope(scope))
            if d.fused is Fused.HERE:
                match, impl = plan_.fused[idx]
                outs = [match.evaluate(env.read, ctx.policy.compute_dtype, impl)]
            else:
                outs = rules.rule_for(eqn, d.op_class).evaluate(ctx, eqn, d, env)
        for v, o in zip(eqn.outvars, outs):
            env.write(v, o)
    cd = ctx.policy.compute_dtype
    return [
        env.read(v, casting.target(casting.dtype_of(v), Color.ORIG, cd) if cast_outputs else None)
        for v in jaxpr.outvars
    ]


# -- the rules of higher-order primitives --------------------------------------------


class HigherOrderRule(rules.EqnRule):
    """A primitive with sub-jaxprs (``cond``, ``while``, ``remat``, ``pjit``,
    ``custom_vjp_call``, ...): unless the policy keeps it as written (a
    full_precision scope, the float32 policy), its operands keep their dtypes
    and its sub-jaxprs are rewritten with the same policy."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.kind is Kind.AS_WRITTEN or d.color is not Color.ORIG:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.ORIG, cd)) for v in eqn.invars
        ]
        return self.bind_rewritten(ctx, eqn, invals)

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        params = ctx.cached(
            "params",
            eqn,
            lambda: compat.map_subjaxprs(
                eqn,
                functools.partial(rewrite, ctx),
                functools.partial(rewrite, ctx.linear),
                functools.partial(_run_bwd, ctx),
            ),
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return False


class ScanRule(HigherOrderRule):
    """``scan``: the casts of scanned-over inputs read only in the compute
    dtype are hoisted out of the loop (:func:`_plan_hoisted_casts`)."""

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        eqn = ctx.cached("masks", eqn, lambda: _with_constant_masks(eqn, invals))
        hoisted = ctx.cached("hoist", eqn, lambda: _plan_hoisted_casts(ctx, eqn))
        if not hoisted:
            return super().bind_rewritten(ctx, eqn, invals)
        hoist, new_params = hoisted
        cd = ctx.policy.compute_dtype
        invals = [casting.cast(x, cd) if i in hoist else x for i, x in enumerate(invals)]
        return compat.bind_eqn(eqn, invals, new_params)


def _with_constant_masks(eqn: Any, invals: list[Any]) -> Any:
    """``eqn`` (a scan) with its concrete boolean loop constants -- a causal mask
    closed over by the loop body -- made constants of its body, so that the
    body's plan sees their values (a constant causal mask becomes cuDNN's
    ``is_causal``, which skips the masked blocks, instead of a bias it must
    read). The operands stay; the body no longer reads them."""
    n_consts, _ = compat.scan_split(eqn.params)
    known = {
        i: x
        for i, x in enumerate(invals[:n_consts])
        if not isinstance(x, compat.Tracer) and np.dtype(x.dtype) == np.bool_
    }
    if not known:
        return eqn
    body = eqn.params["jaxpr"]
    run = compat.jaxpr_as_fun(body)
    new_body = compat.trace_to_closed_jaxpr(
        lambda *a: run(*[known.get(i, x) for i, x in enumerate(a)]), compat.in_avals(body)
    )
    return eqn.replace(params=compat.scan_params_with_body(eqn, new_body))


class ShardMapRule(HigherOrderRule):
    """``shard_map``: rebuilt as a public ``jax.shard_map`` whose body is
    evaluated under the policy (collectives need the manual-axes context)."""

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        return ctx.cached("shard_map", eqn, lambda: _shard_map_fn(ctx, eqn))(*invals)


class CustomJvpRule(HigherOrderRule):
    """``custom_jvp_call``: a transparent one (``jax.nn.relu``: only follow
    and clear ops) painted low runs its body in the compute dtype and keeps
    the user's JVP rule (:func:`_custom_jvp_low`)."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.LOW, cd)) for v in eqn.invars
        ]
        avals = tuple(compat.aval_of(x) for x in invals)
        params = ctx.cached(
            ("custom_jvp_low", avals), eqn, lambda: _custom_jvp_low(ctx, eqn, avals)
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW


rules.register_eqn_rule(rules.HIGHER_ORDER, HigherOrderRule())
rules.register_eqn_rule("scan", ScanRule())
rules.register_eqn_rule(compat.SHARD_MAP_NAMES, ShardMapRule())
rules.register_eqn_rule(compat.CUSTOM_JVP_NAMES, CustomJvpRule())


def _custom_jvp_low(ctx: Context, eqn: Any, low_avals: Sequence[Any]) -> dict[str, Any]:
    """Params to bind a transparent ``custom_jvp_call`` on compute-dtype operands.

    The body is evaluated with every op low. The JVP rule is the user's,
    evaluated in the original dtypes: primals and tangents are cast up, the
    output tangents cast back down to the dtypes of the low primal outputs.
    The primal outputs of the rule are the low body's, so the forward values
    are the same with and without differentiation.
    """
    call_jaxpr, rule_fun, _ = compat.custom_jvp_parts(eqn)
    low = all_low(ctx, ctx.prepare(call_jaxpr))
    orig_avals = [v.aval for v in eqn.invars]

    def primal(*xs):
        return evaluate(ctx, low, xs, cast_outputs=False)

    new_call = compat.trace_to_closed_jaxpr(primal, low_avals)

    def jvp_jaxpr(*zeros):
        jaxpr, consts, out_zeros = compat.call_thunk(rule_fun, *zeros)
        rule = compat.close(jaxpr, consts)
        tan_in = [
            (lo.to_tangent_aval(), hi.to_tangent_aval())
            for lo, hi, z in zip(low_avals, orig_avals, zeros)
            if not z
        ]

        def jvp(*xs):
            prims, tans = xs[: len(low_avals)], xs[len(low_avals) :]
            p_out = primal(*prims)
            up = [casting.cast(x, hi.dtype) for x, hi in zip(prims, orig_avals)]
            up += [casting.cast(t, hi.dtype) for t, (_, hi) in zip(tans, tan_in)]
            t_out = evaluate(ctx.linear, plan(ctx.linear, rule), up)[len(out_zeros) :]
            nz = [p for p, z in zip(p_out, out_zeros) if not z]
            return [
                *p_out,
                *(
                    casting.cast(t, compat.aval_of(p).to_tangent_aval().dtype)
                    for t, p in zip(t_out, nz)
                ),
            ]

        new = compat.trace_to_closed_jaxpr(jvp, [*low_avals, *(lo for lo, _ in tan_in)])
        return compat.jaxpr_of(new), compat.consts_of(new), out_zeros

    return compat.custom_jvp_params(eqn, new_call, compat.memoized_fun(jvp_jaxpr, rule_fun))


def _run_bwd(ctx: Context, key: Any, bwd: Any, args: Sequence[Any]) -> list[Any]:
    """A ``custom_vjp`` backward rule ``bwd(*args)`` run under ``ctx``'s policy.

    A rule that recomputes primal values (diffrax's checkpointed adjoint
    re-runs the solver's steps) must see the policy its forward ran under,
    or it recomputes other values -- an adaptive solver accepts other steps
    -- than the forward did (PyTorch's ``custom_bwd`` does the same for
    autocast). Symbolic zeros (in and out) pass through as they are.
    """
    is_val = [isinstance(a, (jax.Array, compat.Tracer)) for a in args]
    vals = [a for a, v in zip(args, is_val) if v]
    others = tuple((i, a) for i, (a, v) in enumerate(zip(args, is_val)) if not v)
    avals = tuple(compat.aval_of(a) for a in vals)

    def make() -> tuple[Plan, dict[int, Any], int]:
        zeros: dict[int, Any] = {}
        n_out: list[int] = []

        def traced(*xs):
            it = iter(xs)
            full = [a if not v else next(it) for a, v in zip(args, is_val)]
            outs = list(bwd(*full))
            n_out.append(len(outs))
            arrays = []
            for i, o in enumerate(outs):
                if isinstance(o, (jax.Array, compat.Tracer)):
                    arrays.append(o)
                else:
                    zeros[i] = o  # a symbolic zero: no value to compute
            return arrays

        closed = compat.trace_to_closed_jaxpr(traced, avals)
        return plan(ctx, closed), zeros, n_out[0]

    zkey = tuple((i, type(a).__name__, str(getattr(a, "aval", ""))) for i, a in others)
    plan_, zeros, n = ctx.cached(("bwd", avals, zkey), key, make)
    outs = iter(evaluate(ctx, plan_, vals))
    return [zeros[i] if i in zeros else next(outs) for i in range(n)]


def _shard_map_fn(ctx: Context, eqn: Any) -> Any:
    """The public ``jax.shard_map`` of ``eqn``'s body, evaluated under the policy."""
    plan_ = plan(ctx, compat.shard_map_body(eqn))
    return compat.shard_map_of(eqn, lambda *a: evaluate(ctx, plan_, a))


def _plan_hoisted_casts(ctx: Context, eqn: Any) -> tuple[list[int], dict[str, Any]] | None:
    """For a ``scan`` whose scanned-over inputs are read only in the compute
    dtype (stacked per-layer weights): the indices of those inputs, to be cast
    once outside the loop, and the scan's params with the body retyped.

    Cast inside the body, each layer's low copy of its weights would be a
    new value that the backward pass saves: a stacked copy of all weights.
    Cast outside, the residual is the (already low) input slice. As with
    hand-cast bf16 models and ``torch.autocast``, each layer's weight
    gradient then leaves its matmul rounded to the compute dtype before it is
    cast back to the parameter's dtype. None when nothing can be hoisted
    (the caller then rewrites the body as for any higher-order primitive).
    """
    found = compat.scan_xs(eqn)
    if found is None or ctx.identity:
        return None
    body, xs = found
    body_plan = plan(ctx, body)
    bj = body_plan.jaxpr
    cd = ctx.policy.compute_dtype
    hoist = []
    for i in xs:
        v = bj.invars[i]
        if (
            casting.target(casting.dtype_of(v), Color.LOW, cd)
            in (None, np.dtype(casting.dtype_of(v)))
            or v in bj.outvars
        ):
            continue
        uses = [
            (e, d) for e, d in zip(bj.eqns, body_plan.decisions) if any(v is a for a in e.invars)
        ]
        if uses and all(rules.rule_for(e, d.op_class).reads_low(ctx, e, d, v) for e, d in uses):
            hoist.append(i)
    if not hoist:
        return None
    avals = compat.in_avals(body)
    avals = [a.update(dtype=cd) if i in hoist else a for i, a in enumerate(avals)]
    return hoist, compat.scan_params_with_body(eqn, rewrite(ctx, body, avals))
