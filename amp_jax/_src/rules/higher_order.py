"""The rules of higher-order primitives (``cond``, ``while``, ``scan``, ``jit``,
``remat``, ``shard_map``, ``custom_jvp_call``, ``custom_vjp_call``, ...).

The plans of their sub-jaxprs are in their eqn's decision (`Decision.bodies`,
made when the eqn was planned); the rules rewrite and evaluate them through
the context (``ctx.rewrite``, ``ctx.evaluate``: ``context.Context``, which calls the interpreter).
Only a body JAX traces later -- a custom derivative rule, a ``scan`` body
retraced with its concrete masks -- is planned here, through its `LazyBody`.
A ``scan``'s casts of stacked weights are hoisted out of the loop, a
``shard_map`` is rebuilt as a public one, a transparent ``custom_jvp_call``
runs its body low and keeps the user's JVP rule.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import primitives as P

from amp_jax._src import casting, compat
from amp_jax._src.context import Context
from amp_jax._src.decision import (
    BodyPlan,
    Color,
    Decision,
    Kind,
    LazyBody,
    body_at,
    body_hints,
    body_plan,
    lazy_body,
)
from amp_jax._src.rules.base import CastingEnv, EqnRule


class HigherOrderRule(EqnRule):
    """A primitive with sub-jaxprs (``cond``, ``while``, ``remat``, ``pjit``,
    ``custom_vjp_call``, ...): unless the policy keeps it as written (a
    full_precision scope, the float32 policy), its operands keep their dtypes
    and its sub-jaxprs are rewritten with the same policy."""

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        if d.kind is Kind.AS_WRITTEN or d.color is not Color.ORIG:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.ORIG, cd)) for v in eqn.invars
        ]
        return self.bind_rewritten(ctx, eqn, d, invals)

    def bind_rewritten(
        self, ctx: Context, eqn: compat.Eqn, d: Decision, invals: list[Any]
    ) -> list[Any]:
        """Binds ``eqn`` on ``invals`` with its sub-jaxprs rewritten as their
        plans in ``d`` say (`decision.body_plan`); the bodies of a custom
        derivative rule are planned when JAX traces them (their `LazyBody`)."""

        def rewrite(sub: Any) -> Any:
            found = body_plan(d, sub)
            if found is None:  # a custom_vjp's forward, traced under differentiation
                found = ctx.plan_lazy(_lazy(d, "fwd_jaxpr_thunk", eqn), sub)
            return ctx.rewrite(found)

        def rewrite_jvp_rule(rule: Any) -> Any:
            return ctx.linear.rewrite(ctx.plan_lazy(_lazy(d, "jvp_jaxpr_fun", eqn), rule))

        params = ctx.cached(
            ("params", d.hints),  # (a body planned twice, with two hints, has two)
            eqn,
            lambda: compat.map_subjaxprs(
                eqn,
                rewrite,
                rewrite_jvp_rule,
                functools.partial(_run_bwd, ctx, lazy_body(d, "bwd")),
            ),
        )
        return _bind(eqn, invals, params)

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        return False


def _bind(eqn: compat.Eqn, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """``eqn`` bound on ``invals`` with ``params``; a ``ValueError`` when it
    gives another number of results than the traced program has."""
    outs = compat.bind_eqn(eqn, invals, params)
    if len(outs) == len(eqn.outvars):
        return outs
    why = ""
    if eqn.primitive.name in compat.CUSTOM_JVP_NAMES:
        why = (
            " Its JVP rule gives other outputs than its function: JAX's own "
            "jax.jvp(jax.jit(f)) fails on this function too (checkify.checkify of a "
            "custom_jvp function, once traced, keeps a rule that expects the error "
            "values tracing dropped). Apply amp inside the other transformation: "
            "checkify.checkify(amp(f)) rather than amp(checkify.checkify(f))."
        )
    raise ValueError(
        f"amp_jax: binding {eqn.primitive.name!r} gave {len(outs)} results where the "
        f"traced program has {len(eqn.outvars)}.{why}"
    )


#: a ``scan`` body retraced with the loop's concrete boolean constants
_MASKED_BODY = LazyBody("scan body with its concrete boolean constants (masks) made constants")


def _lazy(d: Decision, where: str, eqn: compat.Eqn) -> LazyBody:
    """The `LazyBody` ``d`` holds at ``where``."""
    lazy = lazy_body(d, where)
    if lazy is None:
        raise AssertionError(
            f"amp_jax: the plan of {eqn.primitive.name!r} holds no body {where!r}; "
            "planning._bodies and the rules of higher_order.py disagree."
        )
    return lazy


class ScanRule(HigherOrderRule):
    """``scan``: the casts of scanned-over inputs read only in the compute
    dtype are hoisted out of the loop (`_plan_hoisted_casts`)."""

    def bind_rewritten(
        self, ctx: Context, eqn: compat.Eqn, d: Decision, invals: list[Any]
    ) -> list[Any]:
        masked = ctx.cached("masks", eqn, lambda: _with_constant_masks(eqn, invals))
        if masked is not eqn:
            # (its body, retraced with the masks as constants, is planned
            # without the scan's hints: the loop carry is not kept)
            body = masked.params["jaxpr"]
            d = dataclasses.replace(
                d, hints=(), bodies=(BodyPlan("jaxpr", ctx.plan_lazy(_MASKED_BODY, body), body),)
            )
        eqn = masked
        hints = body_hints(eqn, d, eqn.params["jaxpr"])
        hoisted = ctx.cached(("hoist", hints), eqn, lambda: _plan_hoisted_casts(ctx, eqn, d))
        if not hoisted:
            return super().bind_rewritten(ctx, eqn, d, invals)
        hoist, new_params = hoisted
        cd = ctx.policy.compute_dtype
        invals = [casting.cast(x, cd) if i in hoist else x for i, x in enumerate(invals)]
        return compat.bind_eqn(eqn, invals, new_params)


def _with_constant_masks(eqn: compat.Eqn, invals: list[Any]) -> Any:
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

    def bind_rewritten(
        self, ctx: Context, eqn: compat.Eqn, d: Decision, invals: list[Any]
    ) -> list[Any]:
        return ctx.cached("shard_map", eqn, lambda: _shard_map_fn(ctx, eqn, d))(*invals)


class CustomJvpRule(HigherOrderRule):
    """``custom_jvp_call``: a transparent one (``jax.nn.relu``: only follow
    and clear ops) painted low runs its body in the compute dtype and keeps
    the user's JVP rule (`_custom_jvp_low`)."""

    def evaluate(self, ctx: Context, eqn: compat.Eqn, d: Decision, env: CastingEnv) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.LOW, cd)) for v in eqn.invars
        ]
        avals = tuple(compat.aval_of(x) for x in invals)
        params = ctx.cached(
            ("custom_jvp_low", avals), eqn, lambda: _custom_jvp_low(ctx, eqn, d, avals)
        )
        return _bind(eqn, invals, params)

    def reads_low(self, ctx: Context, eqn: compat.Eqn, d: Decision, atom: compat.Atom) -> bool:
        return d.color is Color.LOW


def _custom_jvp_low(
    ctx: Context, eqn: compat.Eqn, d: Decision, low_avals: Sequence[Any]
) -> dict[str, Any]:
    """Params to bind a transparent ``custom_jvp_call`` on compute-dtype operands.

    The body is evaluated with every op low. The JVP rule is the user's,
    evaluated in the original dtypes: primals and tangents are cast up, the
    output tangents cast back down to the dtypes of the low primal outputs.
    The primal outputs of the rule are the low body's, so the forward values
    are the same with and without differentiation.
    """
    call_jaxpr, rule_fun, _ = compat.custom_jvp_parts(eqn)
    low = body_plan(d, call_jaxpr)  # (its plan with every op low, `planning.all_low`)
    jvp_rule = _lazy(d, "jvp_jaxpr_fun", eqn)
    orig_avals: list[Any] = [v.aval for v in eqn.invars]  # (ShapedArrays)

    def primal(*xs):
        return ctx.evaluate(low, xs, cast_outputs=False)

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
            t_out = ctx.linear.evaluate(ctx.plan_lazy(jvp_rule, rule), up)[len(out_zeros) :]
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


#: what a ``custom_vjp`` backward rule takes and returns as a value (else a symbolic zero)
_ARRAYS = (jax.Array, compat.Tracer, np.ndarray, np.generic)
_SCALARS = (bool, int, float, complex)


def _run_bwd(ctx: Context, lazy: LazyBody | None, key: Any, bwd: Any, args: Sequence[Any]) -> Any:
    """A ``custom_vjp`` backward rule ``bwd(*args)`` run under ``ctx``'s policy,
    planned (``lazy``: the decision's `LazyBody` of it) when JAX runs it.

    A rule that recomputes primal values (diffrax's checkpointed adjoint
    re-runs the solver's steps) must see the policy its forward ran under,
    or it recomputes other values -- an adaptive solver accepts other steps
    -- than the forward did (PyTorch's ``custom_bwd`` does the same for
    autocast). Symbolic zeros (in and out) pass through as they are.
    """
    # (a NumPy cotangent -- what ``vjp`` was handed, what a rule before this
    # one returned -- is a value like any array: taken as a static, the
    # trace baked it in and the cache, keyed by its aval, gave it back for the
    # next call's cotangent)
    is_val = [isinstance(a, _ARRAYS) for a in args]
    vals = [a for a, v in zip(args, is_val) if v]
    others = tuple((i, a) for i, (a, v) in enumerate(zip(args, is_val)) if not v)
    avals = tuple(compat.aval_of(a) for a in vals)

    def make() -> tuple[Any, dict[int, Any], Any]:
        # The rule's output is a pytree (the cotangents; from JAX 0.11 the
        # pair (cotangents, logs)) whose non-array leaves are symbolic zeros.
        zeros: dict[int, Any] = {}
        tree: list[Any] = []

        def traced(*xs):
            it = iter(xs)
            full = [a if not v else next(it) for a, v in zip(args, is_val)]
            leaves, treedef = jax.tree_util.tree_flatten(bwd(*full))
            tree.append(treedef)
            arrays: list[Any] = []
            for i, o in enumerate(leaves):
                if isinstance(o, np.ndarray):
                    # a constant the rule returns: the cached plan keeps a
                    # copy, so that the rule's own array (a cotangent the
                    # next rule reads) is dropped once used, as JAX drops it
                    arrays.append(np.array(o))
                elif isinstance(o, _ARRAYS):
                    arrays.append(o)
                else:
                    zeros[i] = o  # a symbolic zero: no value to compute
            return arrays

        closed = compat.trace_to_closed_jaxpr(traced, avals)
        if lazy is None:
            raise AssertionError("amp_jax: a custom_vjp_call's plan holds no 'bwd' body")
        return ctx.plan_lazy(lazy, closed), zeros, tree[0]

    # (a Python scalar -- a cotangent ``vjp`` was handed as a float -- is baked
    # into the trace: keyed by its value, or the next call's would get this one's)
    zkey = tuple(
        (i, type(a).__name__, repr(a) if isinstance(a, _SCALARS) else str(getattr(a, "aval", "")))
        for i, a in others
    )
    plan_, zeros, treedef = ctx.cached(("bwd", avals, zkey), key, make)
    # (a constant the rule returned comes out of the plan as JAX's literal
    # class: an Array, as under jit)
    evaluated = ctx.evaluate(plan_, vals)
    outs = iter(jax.numpy.asarray(o) if isinstance(o, np.ndarray) else o for o in evaluated)
    leaves = [zeros[i] if i in zeros else next(outs) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _shard_map_fn(ctx: Context, eqn: compat.Eqn, d: Decision) -> Any:
    """The public ``jax.shard_map`` of ``eqn``'s body, evaluated under the
    policy as its plan in ``d`` says."""
    plan_ = body_at(d, "jaxpr")  # (the body compat.shard_map_body closes, as planned)
    return compat.shard_map_of(eqn, lambda *a: ctx.evaluate(plan_, a))


def _plan_hoisted_casts(
    ctx: Context, eqn: compat.Eqn, d: Decision
) -> tuple[list[int], dict[str, Any]] | None:
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
    ``d``: the scan's decision, which holds the body's plan.
    """
    found = compat.scan_xs(eqn)
    if found is None or ctx.policy.is_identity:
        return None
    body, xs = found
    planned = body_plan(d, body)
    bj = planned.jaxpr
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
            (e, de) for e, de in zip(bj.eqns, planned.decisions) if any(v is a for a in e.invars)
        ]
        if uses and all(ctx.rule_for(e, de.op_class).reads_low(ctx, e, de, v) for e, de in uses):
            hoist.append(i)
    if not hoist:
        return None
    avals = compat.in_avals(body)
    avals = [a.update(dtype=cd) if i in hoist else a for i, a in enumerate(avals)]
    return hoist, compat.scan_params_with_body(eqn, ctx.rewrite(planned, avals))


#: the rule of higher-order primitives without one of their own
GENERIC = HigherOrderRule()

#: primitive (or its name, where it is not public) -> rule
RULES: dict[Any, EqnRule] = {
    P.scan_p: ScanRule(),
    P.custom_jvp_call_p: CustomJvpRule(),
    **dict.fromkeys(compat.SHARD_MAP_NAMES, ShardMapRule()),
}
