"""Master weights: a high-precision copy of low-precision parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from amp_jax.optim import _check, _rounding, _tree


class MasterWeightsState(NamedTuple):
    """State of [`master_weights`][amp_jax.optim.master_weights].

    Attributes:
      master: the high-precision copy of the parameters (floating leaves in
        ``master_dtype``; non-floating leaves hold a copy of the parameter).
      inner_state: the state of the wrapped transformation, built from and
        updated with the master copy.
    """

    master: optax.Params
    inner_state: optax.OptState


def landing_update(target: jax.Array, param: jax.Array, dtype: Any = None) -> jax.Array:
    """An update ``u`` (in ``dtype``; ``None``: ``param``'s) with
    ``optax.apply_updates(param, u) == target``.

    ``target`` has ``param``'s dtype, or a wider one: then it lands on its
    round-to-nearest value in ``param``'s dtype. ``u = target - param`` is
    computed in (at least) float32 and then cast to ``dtype``. In the
    parameter's own dtype the difference of two of its numbers is exact
    whenever they are within a factor 2 of each other (Sterbenz), so
    ``param + u`` is exactly ``target`` for every step that moves a parameter
    by less than half its magnitude; a larger step (a sign change, a jump
    towards zero) can land up to half an ulp of ``u`` away. In float32
    (``dtype=jnp.float32``) it is exact for magnitudes within ~2**15.
    """
    wd = _tree.work_dtype(param.dtype)
    p = param.astype(wd)
    t = target.astype(wd)
    if jnp.dtype(target.dtype).itemsize > jnp.dtype(param.dtype).itemsize:
        # A wide target lands on its rounding to param's dtype; the rounding is
        # explicit (a cast pair would be dropped under excess precision).
        t = _rounding.round_nearest(t, param.dtype)
    # Equal values (infinities included) need a zero update, not inf - inf.
    u = jnp.where(t == p, jnp.zeros_like(t), t - p)
    return u.astype(param.dtype if dtype is None else dtype)


def master_weights(
    inner: optax.GradientTransformation,
    master_dtype: DTypeLike = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """Keep a high-precision master copy of low-precision parameters.

    ``init`` stores every floating parameter cast to ``master_dtype`` (always a
    new buffer, so params and state can both be donated). ``update``
    casts the gradients to ``master_dtype``, runs ``inner`` with the master copy
    as ``params``, applies the inner updates to the master copy exactly like
    ``optax.apply_updates`` (so, given the same gradients, the master trajectory
    is bitwise the one of plain ``master_dtype`` training with ``inner``), and
    returns updates that make ``optax.apply_updates(params, updates)`` equal to
    ``new_master.astype(param.dtype)`` bitwise.

    For parameters whose dtype differs from ``master_dtype`` the returned update
    is ``new_master.astype(p.dtype) - p``, computed in float32 and returned in
    the narrower of the gradient's and the parameter's dtypes (optax returns
    updates in the gradients' dtypes, and its wrappers rely on it:
    ``optax.apply_if_finite``, ``MultiSteps``). In the parameter's dtype that
    difference is exact whenever the step moves the parameter by less than
    half its magnitude (Sterbenz), so ``p + u`` is then exactly the cast
    master; a larger step (a sign change, a jump towards zero) lands within
    half an ulp of ``u`` of it. The master copy stays exact either way, and
    the next update lands on it again.
    For parameters already in ``master_dtype`` the inner update is returned
    as is. Non-floating parameters are passed to ``inner`` unchanged and its
    updates for them returned unchanged.

    ``update`` requires ``params``, the current low-precision parameters.

    Args:
      inner: the optimizer to run in high precision, e.g. ``optax.adamw(1e-3)``.
      master_dtype: dtype of the master copy (a floating dtype).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      [`MasterWeightsState`][amp_jax.optim.MasterWeightsState].

    Raises:
      ValueError: if ``master_dtype`` is not floating, or ``update`` is called
        without ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> params = jnp.ones(2, jnp.bfloat16)
      >>> tx = optim.master_weights(optax.sgd(1e-3))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(jnp.ones(2, jnp.bfloat16), state, params)
      >>> optax.apply_updates(params, updates)  # the bf16 step rounds away...
      Array([1, 1], dtype=bfloat16)
      >>> optim.master_params(state)  # ...but the master copy keeps it
      Array([0.999, 0.999], dtype=float32)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    inner = _check.transformation(inner, "master_weights")
    master_dtype = _tree.float_dtype(master_dtype, "master_dtype", "; use jnp.float32")
    inner = optax.with_extra_args_support(inner)

    def to_master(x):
        return x.astype(master_dtype) if _tree.is_float(x) else jnp.asarray(x)

    def init_fn(params):
        _check.warn_if_redundant(
            params, master_dtype, f"master_weights(master_dtype={master_dtype})"
        )
        # a copy even where the dtype already is master_dtype: a master leaf
        # that aliased its parameter's buffer would make a step that donates
        # both params and state fail ("donate the same buffer twice")
        master = jax.tree.map(lambda x: jnp.array(to_master(x), copy=True), params)
        return MasterWeightsState(master=master, inner_state=inner.init(master))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "master_weights: `update` needs `params` (the current "
                "low-precision parameters); call "
                "`tx.update(grads, state, params)`."
            )
        grads = jax.tree.map(to_master, updates)
        inner_updates, new_inner = inner.update(
            grads, state.inner_state, state.master, **extra_args
        )
        new_master = optax.apply_updates(state.master, inner_updates)

        def out(p, g, m_new, u):
            if not _tree.is_float(p):
                return u
            if p.dtype == master_dtype:
                return u.astype(_tree.update_dtype(g, p))
            return landing_update(m_new, p, _tree.update_dtype(g, p))

        def keep(p, m_old, m_new):
            return m_new if _tree.is_float(p) else jnp.asarray(p)

        new_updates = jax.tree.map(out, params, updates, new_master, inner_updates)
        new_master = jax.tree.map(keep, params, state.master, new_master)
        return new_updates, MasterWeightsState(new_master, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_FIX = (
    "Wrap your optimizer with amp_jax.optim.master_weights(inner) and pass "
    "the state returned by its init/update."
)


def master_params(opt_state: Any) -> optax.Params:
    """The high-precision master parameters stored in an optimizer state.

    Args:
      opt_state: a state containing exactly one [`MasterWeightsState`][amp_jax.optim.MasterWeightsState]
        (possibly nested in chains, loss-scale wrappers, ``MultiSteps``...).

    Returns:
      The master copy, a pytree with the structure of the parameters.

    Raises:
      ValueError: if no master-weights state, or more than one, is found.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optim.dynamic_loss_scale(optim.master_weights(optax.sgd(0.1)))
      >>> optim.master_params(tx.init({"w": jnp.ones(2, jnp.float16)}))
      {'w': Array([1., 1.], dtype=float32)}

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740.
    """
    return _tree.find_one(opt_state, MasterWeightsState, caller="master_params", fix=_FIX).master
