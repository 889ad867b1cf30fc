"""Loss scaling as optax gradient transformations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from amp_jax.optim import _check, _tree

_INT32_MAX = jnp.iinfo(jnp.int32).max


class DynamicLossScaleState(NamedTuple):
    """State of [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale].

    Attributes:
      scale: the loss scale to use for the *next* gradient computation, a float32
        scalar.
      good_steps: number of consecutive steps with finite gradients since the
        last growth or backoff (int32 scalar, reset on growth and on backoff).
      skipped_steps: total number of skipped (non-finite) steps (int32 scalar).
      steps: total number of ``update`` calls, skipped ones included (int32
        scalar).
      last_skipped_step: the 1-based index (in ``steps``) of the last skipped
        step, 0 when none was skipped (int32 scalar).
      inner_state: the state of the wrapped transformation; left untouched by a
        skipped step.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array
    steps: jax.Array
    last_skipped_step: jax.Array
    inner_state: optax.OptState


class StaticLossScaleState(NamedTuple):
    """State of [`static_loss_scale`][amp_jax.optim.static_loss_scale].

    Attributes:
      scale: the constant loss scale, a float32 scalar (kept in the state so
        [`loss_scale`][amp_jax.optim.loss_scale] can find it and checkpoints record it).
      inner_state: the state of the wrapped transformation.
    """

    scale: jax.Array
    inner_state: optax.OptState


class ScaledGradients:
    """Gradients of a loss multiplied by the loss scale, still scaled.

    What [`scaled_value_and_grad`][amp_jax.optim.scaled_value_and_grad] returns and what the ``update`` of
    [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale] / [`static_loss_scale`][amp_jax.optim.static_loss_scale] expects: the
    wrapper is the evidence that the gradients carry the scale, so plain
    ``jax.grad`` gradients (whose updates would come out ``scale`` times too
    small) are refused, eagerly and under ``jit``. It is a pytree node with
    one child, so it survives ``jit`` boundaries, ``lax.scan`` carries and
    ``jax.tree.map``: summing or averaging micro-batch gradients
    (``jax.tree.map(jnp.add, g1, g2)``) keeps it.

    Attributes:
      grads: the scaled gradients, a pytree like the parameters.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.static_loss_scale(optax.sgd(1.0), 4.0)
      >>> state = tx.init(jnp.ones(2))
      >>> _, g1 = optim.scaled_value_and_grad(jnp.sum, state)(jnp.ones(2))
      >>> total = jax.tree.map(jnp.add, g1, g1)  # two micro-batches
      >>> type(total).__name__, total.grads
      ('ScaledGradients', Array([8., 8.], dtype=float32))
      >>> tx.update(total, state)[0]
      Array([-2., -2.], dtype=float32)
    """

    __slots__ = ("grads",)

    def __init__(self, grads: Any):
        self.grads = grads

    def __repr__(self) -> str:
        return f"ScaledGradients({self.grads!r})"


# The child's key: frameworks that turn pytree nodes into dicts of their
# children (flax.nnx.state, inside nnx.Optimizer.update) keep it as the key.
_KEY = "amp_jax_scaled_gradients"

jax.tree_util.register_pytree_with_keys(
    ScaledGradients,
    lambda s: (((jax.tree_util.GetAttrKey(_KEY), s.grads),), None),
    # (JAX passes the children as a tuple; its stub says Iterable)
    lambda _, children: ScaledGradients(children[0]),  # type: ignore[index]
    lambda s: ((s.grads,), None),
)


def _unwrap_nnx(updates: Any) -> Any:
    """The gradients inside a [`ScaledGradients`][amp_jax.optim.ScaledGradients] that ``flax.nnx.state``
    turned into a mapping ``{_KEY: grads}``, or None."""
    keys = getattr(updates, "keys", None)
    if callable(keys) and not isinstance(updates, ScaledGradients):
        try:
            names = list(keys())
        except TypeError:
            return None
        if names == [_KEY]:
            return updates[_KEY]
    return None


def _take_scaled(updates: Any, check: bool, caller: str) -> Any:
    """The gradients of ``updates``: unwrapped from [`ScaledGradients`][amp_jax.optim.ScaledGradients];
    plain gradients are refused when ``check`` (they never carried the scale)."""
    if isinstance(updates, ScaledGradients):
        return updates.grads
    inner = _unwrap_nnx(updates)
    if inner is not None:
        return inner
    if not check:
        return updates
    raise ValueError(
        f"{caller}.update: `updates` are plain gradients, not the ScaledGradients that "
        "amp_jax.optim.scaled_value_and_grad returns, so nothing shows that their loss was "
        "multiplied by the loss scale; dividing unscaled gradients by it would make the "
        "updates that many times too small. Compute them with "
        "amp_jax.optim.scaled_value_and_grad(loss_fn, opt_state)(...) instead of "
        "jax.value_and_grad(loss_fn)(...); if you multiplied the loss by "
        "amp_jax.optim.loss_scale(opt_state) yourself, pass "
        "amp_jax.optim.ScaledGradients(grads). Micro-batch gradients summed with "
        "jax.tree.map keep the wrapper. If a transformation around the loss scaler "
        f"(optax.MultiSteps, optax.apply_if_finite) drops it, put {caller} outermost, "
        f"or pass {caller}(..., check_scaled=False)."
    )


def _check_positive(name: str, value: float, caller: str = "dynamic_loss_scale") -> float:
    value = _check.real(value, caller, name, "2.0**15")
    if not value > 0.0 or value == float("inf"):
        raise ValueError(
            f"`{name}` must be a finite number > 0, got {value!r}; "
            f"pass a positive value such as 2.0**15."
        )
    return value


def _needs_own_dtype(inner_state: Any) -> bool:
    """Whether ``inner`` holds an ``optax.apply_if_finite``: its ``lax.cond``
    needs the inner optimizer's state to keep its dtypes, and optax optimizers
    promote low-precision moments given float32 gradients, so the unscaled
    gradients go in in their own dtypes."""
    return bool(_tree.find_states(inner_state, optax.ApplyIfFiniteState))


@dataclasses.dataclass(frozen=True)
class LossScaleRule:
    """The decision rule of a [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale]:
    unscale, check, grow or back off.

    [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale] builds one from its
    arguments and exposes it as ``tx.rule``; code that runs the skip decision
    itself ([`amp_jax.eager.scan_step`][amp_jax.eager.scan_step], which checks
    every layer's gradient before it writes any) takes it as an argument and
    advances the same [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState]
    with the same arithmetic.

    Attributes:
      init_scale: the first loss scale.
      growth_interval: consecutive finite steps before the scale grows.
      growth_factor: multiplier on growth (> 1).
      backoff_factor: multiplier on a non-finite step, in (0, 1).
      min_scale: lower clamp of the scale.
      max_scale: upper clamp of the scale.
      axis_name: mapped axis over which the finiteness decision is reduced, or None.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> rule = optim.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0).rule
      >>> state = rule.init(None)
      >>> grads = rule.unscale({"w": jnp.full(2, 16.0)}, state.scale)
      >>> grads["w"], bool(rule.all_finite(grads))
      (Array([2., 2.], dtype=float32), True)
      >>> float(rule.advance(state, jnp.asarray(False), None).scale)  # backoff
      4.0
    """

    init_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    axis_name: Any = None

    def init(self, inner_state: Any) -> DynamicLossScaleState:
        """A fresh [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState]
        holding ``inner_state``."""
        return DynamicLossScaleState(
            scale=jnp.asarray(self.init_scale, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            steps=jnp.zeros([], jnp.int32),
            last_skipped_step=jnp.zeros([], jnp.int32),
            inner_state=inner_state,
        )

    @staticmethod
    def unscale(grads: Any, scale: jax.Array, keep_dtype: bool = False) -> Any:
        """``grads / scale`` in at least float32, and left there: cast back to
        float16, the small gradients the scale exists to keep would flush to 0.
        ``keep_dtype``: cast back to each gradient's dtype all the same."""

        def one(g):
            if not _tree.is_float(g):
                return g
            u = g.astype(_tree.work_dtype(g.dtype)) / scale
            return u.astype(g.dtype) if keep_dtype else u

        return jax.tree.map(one, grads)

    @staticmethod
    def all_finite(tree: Any) -> jax.Array:
        """Whether every floating leaf of ``tree`` is finite (a boolean scalar)."""
        flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _tree.is_float(x)]
        if not flags:
            return jnp.asarray(True)
        return jnp.stack(flags).all()

    def agree(self, finite: jax.Array) -> jax.Array:
        """``finite`` reduced over ``axis_name`` (unchanged without one), so
        every device skips together."""
        if self.axis_name is None:
            return finite
        return lax.pmin(finite.astype(jnp.int32), self.axis_name).astype(bool)

    def advance(
        self, state: DynamicLossScaleState, finite: jax.Array, new_inner: Any
    ) -> DynamicLossScaleState:
        """The next state: ``new_inner`` (already selected on ``finite``) and the
        scale grown after ``growth_interval`` finite steps or backed off."""
        scale = state.scale
        good = optax.safe_increment(state.good_steps)
        grow = good >= self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        grown_scale = jnp.where(
            jnp.isfinite(grown), jnp.minimum(grown, jnp.float32(self.max_scale)), scale
        )
        ok_scale = jnp.where(grow, grown_scale, scale)
        ok_good = jnp.where(grow, jnp.zeros_like(good), good)
        bad_scale = jnp.maximum(
            scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale)
        )
        skipped = state.skipped_steps
        bad_skipped = jnp.where(skipped < _INT32_MAX, skipped + 1, skipped)
        steps = optax.safe_increment(state.steps)
        return DynamicLossScaleState(
            scale=jnp.where(finite, ok_scale, bad_scale).astype(jnp.float32),
            good_steps=jnp.where(finite, ok_good, 0).astype(jnp.int32),
            skipped_steps=jnp.where(finite, skipped, bad_skipped).astype(jnp.int32),
            steps=steps.astype(jnp.int32),
            last_skipped_step=jnp.where(finite, state.last_skipped_step, steps).astype(jnp.int32),
            inner_state=new_inner,
        )


class DynamicLossScale(optax.GradientTransformationExtraArgs):
    """What [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale] returns: an
    ``optax.GradientTransformationExtraArgs`` that also names its parts.

    Attributes:
      init: as any optax transformation's.
      update: as any optax transformation's.
      inner: the wrapped transformation (with extra-args support), run on
        unscaled gradients.
      rule: its [`LossScaleRule`][amp_jax.optim.LossScaleRule].
    """

    inner: optax.GradientTransformationExtraArgs
    rule: LossScaleRule

    def __new__(cls, init: Any, update: Any, inner: Any, rule: LossScaleRule):
        self = super().__new__(cls, init, update)
        self.inner = inner
        self.rule = rule
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.init, self.update, self.inner, self.rule)


# A subclass of a NamedTuple is flattened by JAX as a NamedTuple and rebuilt
# with ``cls(*children)``, which loses ``inner`` and ``rule`` (and raised in
# ``jax.tree.map(f, tx)`` and in Flax NNX 0.10's ``nnx.Optimizer``, which
# keeps the transformation in its graph). Registered, it has the same two
# leaves as the base class and keeps its parts as static data.
jax.tree_util.register_pytree_node(
    DynamicLossScale,
    lambda tx: ((tx.init, tx.update), (tx.inner, tx.rule)),
    lambda parts, children: DynamicLossScale(*children, *parts),
)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    axis_name: Any = None,
    check_scaled: bool = True,
) -> DynamicLossScale:
    """Dynamic loss scaling with skipped steps, as an optax wrapper.

    Compute the gradients with [`scaled_value_and_grad`][amp_jax.optim.scaled_value_and_grad] (the loss
    multiplied by ``loss_scale(opt_state)``; the still-scaled gradients come
    back as [`ScaledGradients`][amp_jax.optim.ScaledGradients]) and pass them to ``update``. Each
    ``update``:

    1. divides every floating gradient by exactly the scale stored in the state,
       i.e. the scale the loss was multiplied with (in float32; float16 and
       bfloat16 gradients are unscaled *to* float32, so values below float16's
       range survive; ``inner`` sees float32 gradients, and its updates are
       returned in the gradients' dtypes, as optax's are);
    2. checks that all unscaled gradients are finite (across the devices of
       ``axis_name`` when given; a sharded ``jax.Array`` under ``jit`` is
       already checked globally);
    3. if finite: runs ``inner`` on the unscaled gradients and counts one good
       step; after ``growth_interval`` consecutive good steps the scale is
       multiplied by ``growth_factor`` (clamped at ``max_scale``, and only if
       the result is finite);
    4. otherwise: returns zero updates, leaves the inner state untouched (the
       choice is a select, so the inner update is computed and discarded),
       multiplies the scale by ``backoff_factor`` (clamped at ``min_scale``),
       resets the good-step counter and increments ``skipped_steps``.

    Non-floating gradient leaves are passed to ``inner`` untouched.

    Args:
      inner: the transformation to run on unscaled gradients, e.g.
        ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))``;
        clipping inside ``inner`` sees unscaled gradients.
      init_scale: initial loss scale (> 0).
      growth_interval: number of consecutive finite steps before growing (>= 1).
      growth_factor: multiplier applied on growth (> 1).
      backoff_factor: multiplier applied on a non-finite step, in (0, 1).
      min_scale: lower clamp of the scale (> 0).
      max_scale: upper clamp of the scale (>= ``min_scale``).
      axis_name: optional mapped axis name (``shard_map``/``pmap``) over which the
        finiteness decision is reduced, so every device skips together.
      check_scaled: refuse gradients that are not [`ScaledGradients`][amp_jax.optim.ScaledGradients]
        (eagerly and under ``jit``): plain ``jax.value_and_grad`` gradients
        instead of [`scaled_value_and_grad`][amp_jax.optim.scaled_value_and_grad]'s, whose updates would be
        ``scale`` times too small. Pass ``False`` only when a transformation
        around the loss scaler drops the wrapper and you scale the loss
        yourself.

    Returns:
      A [`DynamicLossScale`][amp_jax.optim.DynamicLossScale] (an
      ``optax.GradientTransformationExtraArgs``) whose state is a
      [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState]; its
      ``rule`` is the [`LossScaleRule`][amp_jax.optim.LossScaleRule] the update
      applies (what [`amp_jax.eager.scan_step`][amp_jax.eager.scan_step] takes).

    Raises:
      ValueError: if an argument is outside its allowed range (the message names
        the argument); from ``update``, if the gradients are not
        [`ScaledGradients`][amp_jax.optim.ScaledGradients] (see ``check_scaled``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = optim.scaled_value_and_grad(loss_fn, state)(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"]
      Array([-0.2, -0.2, -0.2], dtype=float32)
      >>> int(state.good_steps), int(state.skipped_steps)
      (1, 0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    inner = _check.transformation(inner, "dynamic_loss_scale")
    check_scaled = _check.boolean(check_scaled, "dynamic_loss_scale", "check_scaled")
    init_scale, min_scale, max_scale, growth_interval, growth_factor, backoff_factor = (
        _checked_scale_schedule(
            init_scale, min_scale, max_scale, growth_interval, growth_factor, backoff_factor
        )
    )
    inner = optax.with_extra_args_support(inner)
    rule = LossScaleRule(
        init_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale, axis_name
    )

    def init_fn(params):
        return rule.init(inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        updates = _take_scaled(updates, check_scaled, "dynamic_loss_scale")
        grads = rule.unscale(updates, state.scale, _needs_own_dtype(state.inner_state))
        finite = rule.agree(rule.all_finite(grads))

        # Select rather than lax.cond: inside shard_map the branch outputs would
        # differ in their varying-manual-axes type; the non-finite step's
        # computation is simply discarded (as in optax.apply_if_finite).
        inner_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        new_inner = optax.tree_utils.tree_cast_like(new_inner, state.inner_state)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), inner_updates)
        new_updates = _tree.cast_like_grads(new_updates, updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner_state)
        return new_updates, rule.advance(state, finite, new_inner)

    return DynamicLossScale(init_fn, update_fn, inner, rule)


def _checked_scale_schedule(
    init_scale: Any,
    min_scale: Any,
    max_scale: Any,
    growth_interval: Any,
    growth_factor: Any,
    backoff_factor: Any,
) -> tuple[Any, ...]:
    """Checks `dynamic_loss_scale`'s scale arguments; returns them in that order."""
    init_scale = _check_positive("init_scale", init_scale)
    min_scale = _check_positive("min_scale", min_scale)
    max_scale = _check_positive("max_scale", max_scale)
    if min_scale > max_scale:
        raise ValueError(
            f"`min_scale` ({min_scale}) must be <= `max_scale` "
            f"({max_scale}); swap them or widen the range."
        )
    if not min_scale <= init_scale <= max_scale:
        raise ValueError(
            f"`init_scale` ({init_scale}) must lie in [min_scale, "
            f"max_scale] = [{min_scale}, {max_scale}]."
        )
    growth_interval = _check.integer(
        growth_interval, "dynamic_loss_scale", "growth_interval", 1, "2000"
    )
    growth_factor = _check.real(growth_factor, "dynamic_loss_scale", "growth_factor", "2.0")
    backoff_factor = _check.real(backoff_factor, "dynamic_loss_scale", "backoff_factor", "0.5")
    if not float(growth_factor) > 1.0:
        raise ValueError(
            f"`growth_factor` must be > 1, got {growth_factor!r}; "
            "use e.g. 2.0 (for a fixed scale use static_loss_scale)."
        )
    if not 0.0 < float(backoff_factor) < 1.0:
        raise ValueError(
            f"`backoff_factor` must be in (0, 1), got {backoff_factor!r}; use e.g. 0.5."
        )
    return init_scale, min_scale, max_scale, growth_interval, growth_factor, backoff_factor


def static_loss_scale(
    inner: optax.GradientTransformation, scale: float, *, check_scaled: bool = True
) -> optax.GradientTransformationExtraArgs:
    """A constant loss scale, as an optax wrapper.

    ``update`` divides every floating gradient by ``scale`` (in float32; low
    precision gradients stay float32, as in [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale]) and runs
    ``inner``; the updates come back in the gradients' dtypes. Unlike
    [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale] no step is skipped (as in apex and jmp); put an
    ``optax.apply_if_finite`` inside it if you want non-finite steps dropped:
    ``static_loss_scale(optax.apply_if_finite(optax.adam(1e-3), 3), 2.0**12)``
    (an inner ``apply_if_finite`` gets the unscaled gradients in their own
    dtype, which its ``lax.cond`` needs; outside, it would receive the
    [`ScaledGradients`][amp_jax.optim.ScaledGradients] and could not pass them on).

    Args:
      inner: the transformation to run on the unscaled gradients.
      scale: the loss scale (> 0), e.g. ``2.0**12``.
      check_scaled: as in [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale]: ``update`` takes
        [`ScaledGradients`][amp_jax.optim.ScaledGradients].

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      [`StaticLossScaleState`][amp_jax.optim.StaticLossScaleState].

    Raises:
      ValueError: if ``scale`` is not a finite positive number.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.static_loss_scale(optax.sgd(1.0), 128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> float(optim.loss_scale(state))
      128.0
      >>> tx.update(optim.ScaledGradients(jnp.full(2, 256.0)), state)[0]
      Array([-2., -2.], dtype=float32)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    inner = _check.transformation(inner, "static_loss_scale")
    scale = _check_positive("scale", scale, "static_loss_scale")
    check_scaled = _check.boolean(check_scaled, "static_loss_scale", "check_scaled")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return StaticLossScaleState(
            scale=jnp.asarray(scale, jnp.float32), inner_state=inner.init(params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        updates = _take_scaled(updates, check_scaled, "static_loss_scale")
        grads = LossScaleRule.unscale(updates, state.scale, _needs_own_dtype(state.inner_state))
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        # (float32 gradients must not promote a low-precision inner state)
        new_inner = optax.tree_utils.tree_cast_like(new_inner, state.inner_state)
        new_updates = _tree.cast_like_grads(new_updates, updates)
        return new_updates, StaticLossScaleState(state.scale, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_FIX = (
    "Wrap your optimizer with amp_jax.optim.dynamic_loss_scale(inner) or "
    "amp_jax.optim.static_loss_scale(inner, scale) and pass the state "
    "returned by its init/update."
)


def loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale stored anywhere inside an optimizer state.

    Finds the single [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState] or
    [`StaticLossScaleState`][amp_jax.optim.StaticLossScaleState] nested in ``opt_state`` (inside
    ``optax.chain`` tuples, ``inject_hyperparams``, ``MultiSteps``,
    ``masked``/``multi_transform`` states, dicts, lists...).

    Args:
      opt_state: an optimizer state containing exactly one loss-scale state.

    Returns:
      The scale as a float32 scalar array.

    Raises:
      ValueError: if no loss-scale state or more than one is found, or if the
        loss scaler is not the first transformation of an ``optax.chain``
        (the ones before it would see scaled gradients).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optax.MultiSteps(optim.dynamic_loss_scale(optax.sgd(0.1)), 4)
      >>> float(optim.loss_scale(tx.init(jnp.zeros(3))))
      32768.0

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    state = _tree.find_one(
        opt_state, (DynamicLossScaleState, StaticLossScaleState), caller="loss_scale", fix=_FIX
    )
    _check_first_in_chain(opt_state, nested_ok=True)
    return jnp.asarray(state.scale, jnp.float32)


def _check_first_in_chain(opt_state: Any, nested_ok: bool = False) -> None:
    """``optax.chain(a, dynamic_loss_scale(b))`` gives ``a`` the scaled gradients
    (clipping would clip them ``scale`` times too early): refuse it."""
    is_scaler = lambda x: isinstance(x, (DynamicLossScaleState, StaticLossScaleState))
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_scaler)[0]:
        if not is_scaler(leaf):
            continue
        node = opt_state
        for key in path:
            index = getattr(key, "idx", None)
            if type(node) is tuple and index:  # an optax.chain state, not the first part
                dynamic = isinstance(leaf, DynamicLossScaleState)
                wrapper = "dynamic_loss_scale" if dynamic else "static_loss_scale"
                raise ValueError(
                    f"loss_scale: the {wrapper} state is part {index} of an optax.chain "
                    f"(at {jax.tree_util.keystr(path[: path.index(key) + 1])}), not part 0: "
                    "the transformations before it receive the *scaled* gradients, so "
                    "clipping or weight decay there acts on values the loss scale times too "
                    f"large. Put them inside the wrapper: {wrapper}(optax.chain("
                    "optax.clip_by_global_norm(1.0), optimizer))."
                )
            if isinstance(node, _DROPS_WRAPPER) and not nested_ok:
                _refuse_inside(type(node).__name__, isinstance(leaf, DynamicLossScaleState))
            node = node[index] if index is not None else _child(node, key)


# optax states of wrappers whose update combines the gradients with a tree like
# the parameters before their inner transformation sees them: they cannot pass
# a ScaledGradients through
_DROPS_WRAPPER = (
    optax.MultiStepsState,
    optax.ApplyIfFiniteState,
    optax.MaskedState,
    optax.PartitionState,
)


def _refuse_inside(state_name: str, dynamic: bool) -> None:
    wrapper = "dynamic_loss_scale" if dynamic else "static_loss_scale"
    raise ValueError(
        f"scaled_value_and_grad: the {wrapper} state sits inside a {state_name}: "
        "that transformation receives the gradients first and cannot pass on the "
        "ScaledGradients that show the loss scaler they were scaled. Put the loss scaler "
        f"outermost, e.g. {wrapper}(optax.MultiSteps(inner, k)) or "
        f"{wrapper}(optax.apply_if_finite(inner, 3)); or build it with "
        f"{wrapper}(..., check_scaled=False) and differentiate "
        "loss * amp_jax.optim.loss_scale(opt_state) yourself."
    )


def _child(node: Any, key: Any) -> Any:
    if hasattr(key, "key"):
        return node[key.key]
    if hasattr(key, "name"):
        return getattr(node, key.name)
    return node


def scaled_value_and_grad(
    fn: Callable[..., Any],
    opt_state: Any,
    *,
    has_aux: bool = False,
    argnums: int | tuple[int, ...] = 0,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, with the loss multiplied by the loss scale.

    The loss returned by ``fn`` is cast to float32 and multiplied by
    ``loss_scale(opt_state)`` before differentiating. The returned function
    gives back the *unscaled* loss (in the dtype ``fn`` returned, float16
    included) and the *still-scaled* gradients as [`ScaledGradients`][amp_jax.optim.ScaledGradients]:
    pass them to the ``update`` of the loss-scale wrapper, which divides them
    by the same scale (the wrapper shows it that they were scaled; sums of
    micro-batch gradients by ``jax.tree.map`` keep it).

    Args:
      fn: the loss function; returns a scalar (or ``(scalar, aux)`` with
        ``has_aux=True``).
      opt_state: an optimizer state containing one loss-scale state.
      has_aux: as in ``jax.value_and_grad``.
      argnums: as in ``jax.value_and_grad``.
      allow_int: as in ``jax.value_and_grad``: allow integer (and bool)
        arguments to be differentiated; their gradients are ``float0`` zeros.

    Returns:
      A function with the signature of ``fn`` returning ``(loss, grads)`` or
      ``((loss, aux), grads)``, ``grads`` a [`ScaledGradients`][amp_jax.optim.ScaledGradients] (the
      gradients themselves are ``grads.grads``).

    Raises:
      ValueError: if ``opt_state`` holds no loss-scale state or more than one,
        or holds it inside an ``optax.MultiSteps``, ``apply_if_finite``,
        ``masked`` or ``multi_transform`` (those receive the gradients first
        and cannot pass on the [`ScaledGradients`][amp_jax.optim.ScaledGradients]: put the loss scaler
        outermost).
      TypeError: if ``fn`` is not callable or ``has_aux``/``allow_int`` are not
        bools.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.static_loss_scale(optax.sgd(0.1), 8.0)
      >>> state = tx.init(jnp.ones(2))
      >>> loss, g = optim.scaled_value_and_grad(lambda p: jnp.sum(p), state)(
      ...     jnp.ones(2))
      >>> float(loss), g.grads
      (2.0, Array([8., 8.], dtype=float32))

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    if not callable(fn):
        raise TypeError(
            f"scaled_value_and_grad: `fn` must be a callable (the loss "
            f"function), got {type(fn).__name__}: {fn!r}."
        )
    has_aux = _check.boolean(has_aux, "scaled_value_and_grad", "has_aux")
    allow_int = _check.boolean(allow_int, "scaled_value_and_grad", "allow_int")
    scale = loss_scale(opt_state)
    _check_first_in_chain(opt_state)

    def scaled(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not has_aux and isinstance(out, (tuple, list)):
            raise TypeError(
                f"scaled_value_and_grad: the loss function returned a "
                f"{type(out).__name__} of {len(out)} values, not a scalar; if it "
                "returns (loss, aux), pass has_aux=True: "
                "scaled_value_and_grad(loss_fn, opt_state, has_aux=True)."
            )
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss)
        return loss.astype(_tree.work_dtype(loss.dtype)) * scale, (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True, allow_int=allow_int)

    def wrapped(*args, **kwargs):
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), ScaledGradients(grads)

    return wrapped


def loss_scale_stats(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale counters of an optimizer state, to log.

  Finds the single loss-scale state nested in ``opt_state`` (like
  [`loss_scale`][amp_jax.optim.loss_scale]) and returns its counters as scalar arrays; works under
  ``jit`` (convert with ``{k: float(v) for k, v in stats.items()}`` on the
  host).

  Args:
    opt_state: an optimizer state containing exactly one loss-scale state.

  Returns:
    For a [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState]: ``scale`` (float32), ``steps``,
    ``skipped_steps``, ``good_steps`` (consecutive finite steps since the
    last growth or backoff), ``last_skipped_step`` (1-based, 0 when none;
    all int32) and ``skip_rate`` (float32, ``skipped_steps / steps``). For a
    [`StaticLossScaleState`][amp_jax.optim.StaticLossScaleState]: ``scale`` only.

  Raises:
    ValueError: if no loss-scale state or more than one is found.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from amp_jax import optim
    >>> tx = optim.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(optim.ScaledGradients(jnp.ones(2)), state)
    >>> _, state = tx.update(optim.ScaledGradients(jnp.array([1.0, jnp.inf])), state)
    >>> {k: float(v) for k, v in optim.loss_scale_stats(state).items()}
    {'scale': 4.0, 'steps': 2.0, 'skipped_steps': 1.0, 'good_steps': 0.0, \
'last_skipped_step': 2.0, 'skip_rate': 0.5}

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018,
    https://arxiv.org/abs/1710.03740.
  """
    state = _tree.find_one(
        opt_state,
        (DynamicLossScaleState, StaticLossScaleState),
        caller="loss_scale_stats",
        fix=_FIX,
    )
    scale = jnp.asarray(state.scale, jnp.float32)
    if isinstance(state, StaticLossScaleState):
        return {"scale": scale}
    steps = jnp.asarray(state.steps, jnp.int32)
    skipped = jnp.asarray(state.skipped_steps, jnp.int32)
    return {
        "scale": scale,
        "steps": steps,
        "skipped_steps": skipped,
        "good_steps": jnp.asarray(state.good_steps, jnp.int32),
        "last_skipped_step": jnp.asarray(state.last_skipped_step, jnp.int32),
        "skip_rate": skipped.astype(jnp.float32) / jnp.maximum(steps, 1).astype(jnp.float32),
    }
