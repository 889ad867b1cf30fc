"""Kahan-compensated parameter updates."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from amp_jax.optim import _check, _rounding, _tree


class KahanSummationState(NamedTuple):
    """State of [`kahan_summation`][amp_jax.optim.kahan_summation].

    Attributes:
      compensation: per floating parameter, the part of past updates that
        rounding to the parameter dtype has not applied yet (in the compensation
        dtype); ``optax.MaskedNode()`` for non-floating parameters.
      inner_state: the state of the wrapped transformation.
    """

    compensation: optax.Params
    inner_state: optax.OptState


def kahan_summation(
    inner: optax.GradientTransformation,
    compensation_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Kahan-compensated summation of the updates into the parameters.

    With ``c`` the compensation buffer, ``u`` the inner update and ``p`` the
    parameter, one step does (arithmetic in at least float32):

        y     = c + u                      # compensated increment
        p_new = (p + y).astype(p.dtype)    # what optax.apply_updates computes
        c_new = (y - (p_new - p)).astype(compensation_dtype)

    and returns ``y`` as the update, so ``optax.apply_updates(params, updates)``
    lands exactly on ``p_new`` (the same operations, bitwise). ``y`` is
    returned in the narrower of the gradient's and the parameter's dtypes (as
    optax returns updates in the gradients' dtypes), and ``p_new`` and ``c_new``
    are computed from that rounded ``y``, so the rounding of the update is
    compensated too. This is the Kahan
    step of torchdistx's AnyPrecisionAdamW (``c += delta; old = p; p += c;
    c += old - p``). The rounding error of every step is carried over, so
    bfloat16 parameters follow the float32 trajectory closely even when single
    updates are below half a bfloat16 ulp.

    Use this wrapper as the *outermost* transformation that changes updates (after the
    learning rate): anything applied after it would modify ``y``.

    Args:
      inner: the optimizer whose updates are summed, e.g. ``optax.adamw(1e-3)``.
      compensation_dtype: dtype of the compensation buffer; ``None`` (default)
        uses each parameter's dtype (2 bytes per bfloat16 parameter).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      [`KahanSummationState`][amp_jax.optim.KahanSummationState].

    Raises:
      ValueError: if ``compensation_dtype`` is not floating, or ``update`` is
        called without ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> p = jnp.ones(1, jnp.bfloat16)
      >>> tx = optim.kahan_summation(optax.sgd(1e-3))
      >>> s = tx.init(p)
      >>> for _ in range(10):
      ...   u, s = tx.update(jnp.full(1, -1.0, jnp.bfloat16), s, p)
      ...   p = optax.apply_updates(p, u)
      >>> p  # ten updates of 1e-3 each; plain bfloat16 would stay at 1
      Array([1.00781], dtype=bfloat16)

    References:
      Kahan, "Further remarks on reducing truncation errors", Communications of
      the ACM 8(1), 1965, https://doi.org/10.1145/363707.363723.
      Zamirai et al., "Revisiting BFloat16 Training", 2020,
      https://arxiv.org/abs/2010.06192.
      torchdistx AnyPrecisionAdamW,
      https://github.com/pytorch/torchdistx/blob/main/src/python/torchdistx/optimizers/anyprecision_optimizer.py.
    """
    inner = _check.transformation(inner, "kahan_summation")
    if compensation_dtype is not None:
        compensation_dtype = _tree.float_dtype(
            compensation_dtype, "compensation_dtype", "; use None for the parameter dtype"
        )
    inner = optax.with_extra_args_support(inner)

    def comp_init(p):
        if not _tree.is_float(p):
            return optax.MaskedNode()
        # zeros_like: the buffer takes the parameter's sharding (a sharded
        # parameter gets a sharded buffer, not a replicated one).
        return jnp.zeros_like(p, dtype=compensation_dtype or p.dtype)

    def init_fn(params):
        _check.warn_if_redundant(params, jnp.float32, "kahan_summation")
        with _check.landing_handled():
            inner_state = inner.init(params)
        return KahanSummationState(jax.tree.map(comp_init, params), inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "kahan_summation: `update` needs `params`; call `tx.update(grads, state, params)`."
            )
        inner_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        # the state keeps its dtypes (float32 gradients would promote low-precision
        # moments), so the step can sit in a lax.cond (optax.apply_if_finite)
        new_inner = optax.tree_utils.tree_cast_like(new_inner, state.inner_state)

        def step(p, c, g, u):
            if not _tree.is_float(p):
                return u, c
            wd = _tree.work_dtype(p.dtype)
            p_wd = p.astype(wd)
            y = c.astype(wd) + u.astype(wd)
            # The update as returned (rounded to its dtype) and the new parameter
            # as apply_updates will round it, both roundings explicit: a plain
            # cast pair would be dropped under excess precision.
            out_dtype = _tree.update_dtype(g, p)
            y_out = _rounding.round_nearest(y, out_dtype)
            p_new = _rounding.round_nearest(p_wd + y_out, p.dtype)
            c_new = (y - (p_new - p_wd)).astype(c.dtype)
            return y_out.astype(out_dtype), c_new

        # Map over params (leaves), comp may hold MaskedNode at non-float leaves.
        new_updates, new_comp = _tree.map_unzip(
            step, 2, params, state.compensation, updates, inner_updates
        )
        return new_updates, KahanSummationState(new_comp, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
