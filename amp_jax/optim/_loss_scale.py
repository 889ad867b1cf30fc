"""Loss scaling as optax gradient transformations."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from amp_jax.optim import _check, _tree

_INT32_MAX = jnp.iinfo(jnp.int32).max


class DynamicLossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

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
    """State of :func:`static_loss_scale`.

    Attributes:
      scale: the constant loss scale, a float32 scalar (kept in the state so
        :func:`loss_scale` can find it and checkpoints record it).
      inner_state: the state of the wrapped transformation.
    """

    scale: jax.Array
    inner_state: optax.OptState


# id -> weak reference of every ``scale`` that :func:`loss_scale` read and that
# is still alive (under ``jit``: the tracer of the step being traced).
_SCALES_READ: dict[int, weakref.ref] = {}


def _mark_read(scale: Any) -> None:
    # a Flax NNX optimizer state holds Variables: mark the array inside too
    get = getattr(scale, "get_value", None)
    raw = get() if callable(get) else scale
    for key, x in {id(scale): scale, id(raw): raw}.items():
        try:
            _SCALES_READ[key] = weakref.ref(x, functools.partial(_forget, key))
        except TypeError:  # not weak-referenceable (a Python float): nothing to check
            pass


def _forget(key: int, _ref: Any) -> None:
    _SCALES_READ.pop(key, None)


_CALLER_SCALED = contextvars.ContextVar("amp_jax_caller_scaled", default=False)


@contextlib.contextmanager
def caller_scaled():
    """Within it, ``update`` trusts that its gradients carry the scale: for code
    that seeds the backward pass with the scale itself (``eager.scan_step``)."""
    token = _CALLER_SCALED.set(True)
    try:
        yield
    finally:
        _CALLER_SCALED.reset(token)


def _check_scaled(scale: Any, caller: str) -> None:
    """Under a trace, refuse an ``update`` when no loss scale read by
    :func:`loss_scale` is alive: the gradients were computed without it (plain
    ``jax.value_and_grad``). Concrete (eager) calls are not checked."""
    if not isinstance(scale, jax.core.Tracer) or _CALLER_SCALED.get():
        return
    ref = _SCALES_READ.get(id(scale))
    if ref is not None and ref() is scale:
        return
    # ``update`` inside a cond/scan/shard_map of the step gets a new tracer:
    # accept while a scale tracer read by the step being traced is alive
    # (collected first: a finished trace's tracers can linger in reference
    # cycles, and JAX 0.12 makes more of them)
    gc.collect()
    if any(isinstance(r(), jax.core.Tracer) for r in list(_SCALES_READ.values())):
        return
    raise ValueError(
        f"{caller}.update: the gradients were not computed from a loss multiplied by "
        "the loss scale (no amp_jax.optim.loss_scale(opt_state) was read for this step), "
        "so dividing them by the scale would make the updates that many times too "
        "small. Compute them with amp_jax.optim.scaled_value_and_grad(loss_fn, "
        "opt_state)(...) instead of jax.value_and_grad(loss_fn)(...), or multiply the "
        "loss by amp_jax.optim.loss_scale(opt_state) yourself. If the scaled gradients "
        f"come from another jitted function, pass {caller}(..., check_scaled=False)."
    )


def _check_positive(name: str, value: float, caller: str = "dynamic_loss_scale") -> float:
    value = _check.real(value, caller, name, "2.0**15")
    if not value > 0.0 or value == float("inf"):
        raise ValueError(
            f"`{name}` must be a finite number > 0, got {value!r}; "
            f"pass a positive value such as 2.0**15."
        )
    return value


def _unscale(grads: Any, scale: jax.Array, keep_dtype: bool = False) -> Any:
    """``grads / scale`` in at least float32, and left there: cast back to
    float16, the small gradients the scale exists to keep would flush to 0.
    ``keep_dtype``: cast back to each gradient's dtype all the same."""

    def one(g):
        if not _tree.is_float(g):
            return g
        u = g.astype(_tree.work_dtype(g.dtype)) / scale
        return u.astype(g.dtype) if keep_dtype else u

    return jax.tree.map(one, grads)


def _needs_own_dtype(inner_state: Any) -> bool:
    """Whether ``inner`` holds an ``optax.apply_if_finite``: its ``lax.cond``
    needs the inner optimizer's state to keep its dtypes, and optax optimizers
    promote low-precision moments given float32 gradients, so the unscaled
    gradients go in in their own dtypes."""
    return bool(_tree.find_states(inner_state, optax.ApplyIfFiniteState))


def _all_finite(tree: Any) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _tree.is_float(x)]
    if not flags:
        return jnp.asarray(True)
    return jnp.stack(flags).all()


class _DynamicRule(NamedTuple):
    """The hyperparameters of one :func:`dynamic_loss_scale` (``inner`` with
    extra-args support), for code that runs the skip decision itself
    (``amp_jax.eager.scan_step``) and reuses :func:`_advance`."""

    inner: Any
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float
    max_scale: float
    axis_name: Any


# update_fn of a dynamic_loss_scale -> its rule (weak: no leak per transformation)
_DYNAMIC_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dynamic_rule(tx: Any) -> _DynamicRule | None:
    """The rule of ``tx`` if it is (exactly) a :func:`dynamic_loss_scale`, else None."""
    update = getattr(tx, "update", None)
    try:
        return _DYNAMIC_RULES.get(update)
    except TypeError:  # not weak-referenceable
        return None


def _advance(
    state: DynamicLossScaleState, finite: jax.Array, new_inner: Any, rule: _DynamicRule
) -> DynamicLossScaleState:
    """The next state: ``new_inner`` (already selected on ``finite``) and the
    scale grown after ``growth_interval`` finite steps or backed off."""
    scale = state.scale
    good = optax.safe_increment(state.good_steps)
    grow = good >= rule.growth_interval
    grown = scale * jnp.float32(rule.growth_factor)
    grown_scale = jnp.where(
        jnp.isfinite(grown), jnp.minimum(grown, jnp.float32(rule.max_scale)), scale
    )
    ok_scale = jnp.where(grow, grown_scale, scale)
    ok_good = jnp.where(grow, jnp.zeros_like(good), good)
    bad_scale = jnp.maximum(scale * jnp.float32(rule.backoff_factor), jnp.float32(rule.min_scale))
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
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling with skipped steps, as an optax wrapper.

    Multiply the loss by ``loss_scale(opt_state)`` before differentiating (or use
    :func:`scaled_value_and_grad`) and pass the still-scaled gradients to
    ``update``. Each ``update``:

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
      check_scaled: under a trace (``jit``, ``grad``...), refuse gradients whose
        loss was not multiplied by this state's scale in the same trace (plain
        ``jax.value_and_grad`` instead of :func:`scaled_value_and_grad`, whose
        updates would be ``scale`` times too small). Pass ``False`` when the
        scaled gradients come from another jitted function.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`DynamicLossScaleState`.

    Raises:
      ValueError: if an argument is outside its allowed range (the message names
        the argument); from ``update``, if the gradients were not scaled (see
        ``check_scaled``).

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
    inner = optax.with_extra_args_support(inner)
    rule = _DynamicRule(
        inner, growth_interval, growth_factor, backoff_factor, min_scale, max_scale, axis_name
    )

    def init_fn(params):
        return DynamicLossScaleState(
            scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            steps=jnp.zeros([], jnp.int32),
            last_skipped_step=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        scale = state.scale
        if check_scaled:
            _check_scaled(scale, "dynamic_loss_scale")
        grads = _unscale(updates, scale, _needs_own_dtype(state.inner_state))
        finite = _all_finite(grads)
        if axis_name is not None:
            finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)

        # Select rather than lax.cond: inside shard_map the branch outputs would
        # differ in their varying-manual-axes type; the non-finite step's
        # computation is simply discarded (as in optax.apply_if_finite).
        inner_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        new_inner = optax.tree_utils.tree_cast_like(new_inner, state.inner_state)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), inner_updates)
        new_updates = _tree.cast_like_grads(new_updates, updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner_state)

        new_state = _advance(state, finite, new_inner, rule)
        return new_updates, new_state

    _DYNAMIC_RULES[update_fn] = rule
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def static_loss_scale(
    inner: optax.GradientTransformation, scale: float, *, check_scaled: bool = True
) -> optax.GradientTransformationExtraArgs:
    """A constant loss scale, as an optax wrapper.

    ``update`` divides every floating gradient by ``scale`` (in float32; low
    precision gradients stay float32, as in :func:`dynamic_loss_scale`) and runs
    ``inner``; the updates come back in the gradients' dtypes. Unlike
    :func:`dynamic_loss_scale` no step is skipped (as in apex and jmp); wrap it
    in ``optax.apply_if_finite`` (outside: it then checks the scaled gradients,
    in their own dtype) if you want non-finite steps dropped. (Inside, an
    optax optimizer would see float32 gradients with float16 moments and
    promote them, which ``apply_if_finite``'s ``lax.cond`` rejects.)

    Args:
      inner: the transformation to run on the unscaled gradients.
      scale: the loss scale (> 0), e.g. ``2.0**12``.
      check_scaled: as in :func:`dynamic_loss_scale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`StaticLossScaleState`.

    Raises:
      ValueError: if ``scale`` is not a finite positive number.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.static_loss_scale(optax.sgd(1.0), 128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> float(optim.loss_scale(state))
      128.0
      >>> tx.update(jnp.full(2, 256.0), state)[0]
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
        if check_scaled:
            _check_scaled(state.scale, "static_loss_scale")
        grads = _unscale(updates, state.scale, _needs_own_dtype(state.inner_state))
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

    Finds the single :class:`DynamicLossScaleState` or
    :class:`StaticLossScaleState` nested in ``opt_state`` (inside
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
    _check_first_in_chain(opt_state)
    _mark_read(state.scale)
    return jnp.asarray(state.scale, jnp.float32)


def _check_first_in_chain(opt_state: Any) -> None:
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
            node = node[index] if index is not None else _child(node, key)


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
    included) and the *still-scaled* gradients: pass them to the ``update`` of
    the loss-scale wrapper, which divides them by the same scale.

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
      ``((loss, aux), grads)``.

    Raises:
      ValueError: if ``opt_state`` holds no loss-scale state or more than one.
      TypeError: if ``fn`` is not callable or ``has_aux``/``allow_int`` are not
        bools.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.static_loss_scale(optax.sgd(0.1), 8.0)
      >>> state = tx.init(jnp.ones(2))
      >>> loss, g = optim.scaled_value_and_grad(lambda p: jnp.sum(p), state)(
      ...     jnp.ones(2))
      >>> float(loss), g
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
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def loss_scale_stats(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale counters of an optimizer state, to log.

  Finds the single loss-scale state nested in ``opt_state`` (like
  :func:`loss_scale`) and returns its counters as scalar arrays; works under
  ``jit`` (convert with ``{k: float(v) for k, v in stats.items()}`` on the
  host).

  Args:
    opt_state: an optimizer state containing exactly one loss-scale state.

  Returns:
    For a :class:`DynamicLossScaleState`: ``scale`` (float32), ``steps``,
    ``skipped_steps``, ``good_steps`` (consecutive finite steps since the
    last growth or backoff), ``last_skipped_step`` (1-based, 0 when none;
    all int32) and ``skip_rate`` (float32, ``skipped_steps / steps``). For a
    :class:`StaticLossScaleState`: ``scale`` only.

  Raises:
    ValueError: if no loss-scale state or more than one is found.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from amp_jax import optim
    >>> tx = optim.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.ones(2), state)
    >>> _, state = tx.update(jnp.array([1.0, jnp.inf]), state)
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
