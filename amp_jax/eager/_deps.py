"""Private: data dependence through a jaxpr, and the optimizer probes built on it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from amp_jax._src import compat, jaxprs
from amp_jax._src.optstate import find_states
from amp_jax.optim import DynamicLossScaleState, ScaledGradients, StaticLossScaleState

# Primitives whose single sub-jaxpr is called once with the eqn's operands and
# returns its results: dependence can be traced through them exactly. Any other
# higher-order primitive (scan, while, cond, ...) is treated conservatively: each
# output depends on every input.
_CALL_LIKE = compat.CALL_LIKE_NAMES

_EMPTY: frozenset = frozenset()


def _no_labels(_: Any) -> frozenset:
    return _EMPTY


def _propagate(i: int, eqn: Any, env: jaxprs.Env) -> list[frozenset]:
    """The `jaxprs.Hook` of `dependencies`: a call-like eqn's body is entered,
    any other eqn's outputs each get the union of its operands' labels."""
    del i
    ins = env.operands(eqn)
    sub = jaxprs.called_jaxpr(eqn) if eqn.primitive.name in _CALL_LIKE else None
    if sub is not None:
        return dependencies(sub, ins)
    return [_EMPTY.union(*ins)] * len(eqn.outvars)


def dependencies(jaxpr: Any, in_deps: Sequence[frozenset]) -> list[frozenset]:
    """For each output of ``jaxpr``, the union of the ``in_deps`` it depends on.

    ``in_deps[i]`` labels input ``i`` (a frozenset of labels). The analysis is
    conservative (it may report a dependence that is not there, never miss one):
    an equation's outputs depend on all of its inputs, except for call-like
    primitives (``jit``, ``checkpoint``, ``custom_jvp/vjp``), which are entered.
    It is `jaxprs.eval_jaxpr` over label sets (constants and literals have none).
    """
    jaxpr = jaxprs.open_jaxpr(jaxpr)[0]
    ins = [*in_deps, *[_EMPTY] * (len(jaxpr.invars) - len(in_deps))]
    consts = [_EMPTY] * len(jaxpr.constvars)
    env = jaxprs.Env(literal=_no_labels)
    return jaxprs.eval_jaxpr(jaxpr, consts, ins, _propagate, env)


def residual_depends_on_input(block_fn: Callable, p_layer: Any, h: Any) -> list[bool] | None:
    """Which residual leaves of ``jax.vjp(block_fn, p, h)`` depend on ``h``.

    ``p_layer`` and ``h`` may be abstract (``jax.ShapeDtypeStruct``). Returns
    None when the pullback is not a pytree of arrays (see
    ``compat.vjp_residuals``); the caller then recomputes the forward pass.
    """
    opaque = []

    def res(p, x):
        _, vjp_fn = jax.vjp(block_fn, p, x)
        got = compat.vjp_residuals(vjp_fn)
        if got is None:
            opaque.append(True)
            return []
        return got[0]

    closed = jax.make_jaxpr(res)(p_layer, h)
    if opaque:
        return None
    n_p = len(jax.tree.leaves(p_layer))
    n_h = len(jax.tree.leaves(h))
    outs = dependencies(closed, [_EMPTY] * n_p + [frozenset({0})] * n_h)
    return [bool(d) for d in outs]


# --------------------------------------------------------- optimizer probes ---

_FIX_GLOBAL = (
    "Eager updates apply each layer's update before the gradients of the other "
    "layers exist, so only optimizers whose update of a parameter depends on "
    "that parameter's own gradient (and shared scalars like a step count) are "
    "supported. Remove the global transformation or replace it by a "
    "per-parameter one (optax.clip, optax.clip_by_block_rms, "
    "optax.adaptive_grad_clip), or train with the standard step."
)


def refuse_by_state(state: Any) -> None:
    """Raise the documented ValueError for state types eager updates cannot run."""
    if find_states(state, DynamicLossScaleState):
        raise ValueError(
            "scan_step: `optimizer` contains amp_jax.optim.dynamic_loss_scale. "
            "Dynamic loss scaling skips a step when any gradient is non-finite, "
            "but with eager updates the later layers are already updated when the "
            "gradient of an earlier layer turns out to be inf/nan, so the step "
            "cannot be skipped. Use amp_jax.optim.static_loss_scale(inner, scale) "
            "(supported: the backward pass is seeded with the scale), a bfloat16 "
            "policy (which needs no loss scaling), or the standard step."
        )
    if find_states(state, optax.MultiStepsState):
        raise ValueError(
            "scan_step: `optimizer` is (or contains) optax.MultiSteps. Gradient "
            "accumulation keeps a full-size accumulator of all gradients, which is "
            "exactly the memory eager updates exist to avoid, and its "
            "should_skip_update_fn would judge each layer alone. Use the plain "
            "optimizer with a larger batch, or train with the standard step and "
            "optax.MultiSteps."
        )


def _labelled_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def refuse_cross_parameter(optimizer: Any, probe_params: Any) -> None:
    """Raise if the update of one leaf of ``probe_params`` reads another's gradient.

    ``probe_params`` is a pytree of ``jax.ShapeDtypeStruct`` holding the embed
    parameters, two separate block layers and the head parameters. The update
    is traced (nothing runs) with the state freshly built by ``init`` inside the
    trace; the dependence of each update leaf on the gradient and parameter
    leaves is read off the jaxpr. Best effort: if the optimizer cannot be traced
    on this probe tree (e.g. a mask callable that expects the real structure),
    the check is skipped.
    """
    tx = optax.with_extra_args_support(optimizer)

    def fn(grads, params):
        state = tx.init(params)
        if find_states(state, StaticLossScaleState):
            grads = ScaledGradients(grads)  # as the step passes them
        return tx.update(grads, state, params)

    try:
        closed, (upd_shape, state_shape) = jax.make_jaxpr(fn, return_shape=True)(
            probe_params, probe_params
        )
    except Exception as e:  # pylint: disable=broad-except
        warnings.warn(
            f"scan_step: `optimizer` could not be traced on a probe tree of the "
            f"parameters ({type(e).__name__}: {e}); the check that refuses "
            f"optimizers mixing parameters (global-norm clipping, ...) was "
            f"skipped. Make sure yours updates each parameter on its own.",
            stacklevel=3,
        )
        return
    leaves = jax.tree.leaves(probe_params)
    n = len(leaves)
    labels = [frozenset({i}) for i in range(n)]
    outs = dependencies(closed, labels + labels)
    n_state = len(jax.tree.leaves(state_shape))
    if len(outs) != n + n_state:
        return
    names = _labelled_paths(probe_params)
    for i, deps in enumerate(outs[:n]):
        others = sorted(deps - {i})
        if others:
            raise ValueError(
                f"scan_step: the update that `optimizer` computes for parameter "
                f"params{names[i]} depends on the gradient or value of "
                f"params{names[others[0]]} (a different parameter), as in "
                f"optax.clip_by_global_norm, optax.apply_if_finite or a global-norm "
                f"scaling. {_FIX_GLOBAL}"
            )
    # The state too: a statistic of all gradients kept for the next step (an
    # EMA of the global norm) would be computed per layer instead.
    state_names = _labelled_paths(state_shape)
    for name, deps in zip(state_names, outs[n:]):
        if len(deps) > 1:
            a, b = sorted(deps)[:2]
            raise ValueError(
                f"scan_step: `optimizer` keeps state{name}, computed from "
                f"params{names[a]} and params{names[b]} together (a statistic of "
                f"several parameters), which eager updates would compute per layer. "
                f"{_FIX_GLOBAL}"
            )
