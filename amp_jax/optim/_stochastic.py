"""Stochastically rounded parameter updates."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from amp_jax.optim import _check, _master, _rounding, _tree


class StochasticRoundingState(NamedTuple):
    """State of [`stochastic_rounding`][amp_jax.optim.stochastic_rounding].

    Attributes:
      key: raw ``uint32`` PRNG key data (``jax.random.key_data`` of the key),
        split on every step; stored raw so that checkpoints need no extended
        dtype support.
      inner_state: the state of the wrapped transformation.
    """

    key: jax.Array
    inner_state: optax.OptState


# Per-copy PRNG protocol (amp_jax.optim._tree.salt_keys): this field holds raw key data
# that must differ per copy of the state (per layer in eager updates). A class attribute,
# set here: type checkers read every assignment in a NamedTuple's body as a field.
setattr(StochasticRoundingState, "raw_key_fields", ("key",))  # noqa: B010


def _round_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """Stochastically round float32 ``x`` to bfloat16 with 16 random bits."""
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    # Adding a uniform 16-bit value to the magnitude and truncating the low 16
    # bits rounds away from zero with probability (dropped bits) / 2**16.
    rounded = (raw + (bits >> 16)) & jnp.uint32(0xFFFF0000)
    out = lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
    # Rounding up from just below the bfloat16 maximum would give inf where
    # round-to-nearest gives a finite value: clamp to the largest finite one.
    nearest = x.astype(jnp.bfloat16)
    big = jnp.asarray(jnp.finfo(jnp.bfloat16).max, jnp.bfloat16)
    out = jnp.where(jnp.isfinite(nearest) & ~jnp.isfinite(out), jnp.copysign(big, out), out)
    return jnp.where(jnp.isfinite(x), out, nearest)


def _round_generic(x: jax.Array, uniform: jax.Array, dtype: Any) -> jax.Array:
    """Stochastically round ``x`` (float32) to ``dtype`` using neighbours."""
    near32 = _rounding.round_nearest(x, dtype)
    nearest = near32.astype(dtype)  # exact
    toward = jnp.where(near32 > x, jnp.asarray(-jnp.inf, dtype), jnp.asarray(jnp.inf, dtype))
    other = jnp.nextafter(nearest, toward)
    lo = jnp.where(near32 > x, other, nearest)
    hi = jnp.where(near32 > x, nearest, other)
    lo32, hi32 = lo.astype(x.dtype), hi.astype(x.dtype)
    # Probability of rounding up; hi - lo and x - lo are exact in float32.
    p_up = (x - lo32) / (hi32 - lo32)
    out = jnp.where(uniform < p_up, hi, lo)
    exact = (near32 == x) | ~jnp.isfinite(x) | ~jnp.isfinite(hi32 - lo32)
    return jnp.where(exact, nearest, out)


def round_with_bits(x: jax.Array, bits: jax.Array, dtype: Any) -> jax.Array:
    """Round float32 ``x`` to ``dtype`` stochastically with the given ``uint32``
    random ``bits`` per element (bfloat16: their top 16; other dtypes: their top
    24 as a uniform number)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return _round_bf16(x, bits)
    return _round_generic(x, _rounding.unit(bits), dtype)


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any) -> jax.Array:
    """Round ``x`` to ``dtype`` stochastically (unbiased), elementwise."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    if dtype == jnp.bfloat16:
        return _round_bf16(x, jax.random.bits(key, x.shape, jnp.uint32))
    return _round_generic(x, jax.random.uniform(key, x.shape, jnp.float32), dtype)


def stochastic_rounding(
    inner: optax.GradientTransformation,
    key: jax.Array | int,
) -> optax.GradientTransformationExtraArgs:
    """Make ``optax.apply_updates`` round the new parameters stochastically.

    For every bfloat16/float16 parameter ``p`` with inner update ``u``, the exact
    sum ``x = p + u`` (in float32) is rounded to ``p.dtype`` up or down at
    random, with probability proportional to the distance, so the result is
    unbiased: ``E[round(x)] = x``. Small updates then survive on average instead
    of being rounded away. The returned update is ``round(x) - p`` in the
    parameter's dtype (the gradient's, if narrower), which makes
    ``optax.apply_updates`` land exactly on the rounded value whenever the
    step moves the parameter by less than half its magnitude (the difference
    is then exact: Sterbenz), and within half an ulp of the update otherwise.

    bfloat16 uses the truncation trick (add 16 random bits to the float32 bit
    pattern, drop the low 16 bits); other dtypes (float16) pick between the two
    neighbouring representable values. Values beyond the largest finite value
    behave as in round-to-nearest. Parameters in float32 or wider and
    non-floating parameters get the inner update unchanged.

    Args:
      inner: the optimizer whose updates are applied, e.g. ``optax.adamw(1e-3)``.
        Put this wrapper outermost among update-changing transformations.
      key: a PRNG key (typed or raw ``uint32``) or an int seed. It is kept in
        the state and split on every step.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      [`StochasticRoundingState`][amp_jax.optim.StochasticRoundingState].

    Raises:
      ValueError: if ``update`` is called without ``params``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> p = jnp.ones(10_000, jnp.bfloat16)
      >>> tx = optim.stochastic_rounding(optax.sgd(1e-3), jax.random.key(0))
      >>> u, s = tx.update(-jnp.ones_like(p), tx.init(p), p)
      >>> new = optax.apply_updates(p, u)
      >>> sorted(set(new.tolist()))  # 1 + 1e-3 rounds to 1 or 1.0078125
      [1.0, 1.0078125]
      >>> abs(float(new.astype(jnp.float32).mean()) - 1.001) < 5e-4
      True

    References:
      Zamirai et al., "Revisiting BFloat16 Training", 2020,
      https://arxiv.org/abs/2010.06192.
      torchao bf16 stochastic rounding (``_fp32_to_bf16_sr``),
      https://github.com/pytorch/ao.
    """
    inner = _check.transformation(inner, "stochastic_rounding")
    key = _check.single_key(key, "stochastic_rounding")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(key)
        raw = jax.random.key_data(key)
    else:
        impl = None
        raw = key
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        with _check.landing_handled():
            inner_state = inner.init(params)
        return StochasticRoundingState(key=jnp.array(raw, copy=True), inner_state=inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "stochastic_rounding: `update` needs `params`; call "
                "`tx.update(grads, state, params)`."
            )
        inner_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        # the state keeps its dtypes (float32 gradients would promote low-precision
        # moments), so the step can sit in a lax.cond (optax.apply_if_finite)
        new_inner = optax.tree_utils.tree_cast_like(new_inner, state.inner_state)
        key = jax.random.wrap_key_data(state.key, impl=impl) if impl is not None else state.key
        key, step_key = jax.random.split(key)
        # One key per parameter leaf (jax.random.split over the leaves, in order).
        keys = optax.tree_utils.tree_split_key_like(step_key, params)

        def land(p, g, u, k):
            if not _tree.is_float(p) or jnp.dtype(p.dtype).itemsize >= 4:
                return (u,)
            x = p.astype(jnp.float32) + u.astype(jnp.float32)
            target = stochastic_round(x, k, p.dtype)
            return (_master.landing_update(target, p, _tree.update_dtype(g, p)),)

        (new_updates,) = _tree.map_unzip(land, 1, params, updates, inner_updates, keys)
        new_key = jax.random.key_data(key) if impl is not None else key
        return new_updates, StochasticRoundingState(new_key, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
