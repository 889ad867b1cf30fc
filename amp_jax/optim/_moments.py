"""Gradient transformations whose moments are stored by a `MomentStorage`:
Adam's scaling, Lion's and an exponential moving average, each optax's own
(same arguments, same state classes) with the storage as a keyword."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from amp_jax.optim import _check, _storage, _tree
from amp_jax.optim._storage import MomentStorage


class ScaleByQuantizedAdamState(NamedTuple):
    """State of [`scale_by_quantized_adam`][amp_jax.optim.scale_by_quantized_adam]
    (and of [`scale_by_adam`][amp_jax.optim.scale_by_adam] with a quantized storage).

    Attributes:
      count: int32 step counter (as ``optax.ScaleByAdamState.count``).
      mu: first moments: a [`QuantizedArray`][amp_jax.optim.QuantizedArray] per quantized parameter, a
        float32 array per parameter kept in full precision.
      nu: second moments, laid out like ``mu``.
    """

    # (a field named like tuple.count, as optax's ScaleByAdamState.count)
    count: jax.Array  # type: ignore[assignment]
    mu: optax.Updates
    nu: optax.Updates


def _storage_arg(
    storage: Any, dtype: Any, caller: str, name: str, dtype_name: str
) -> MomentStorage:
    """``storage`` (a `MomentStorage`), or one of ``dtype`` when it is ``None``."""
    if storage is None:
        return MomentStorage(dtype=dtype)
    if not isinstance(storage, MomentStorage):
        raise TypeError(
            f"{caller}: `{name}` must be an amp_jax.optim.MomentStorage, got "
            f"{type(storage).__name__}: {storage!r}; use e.g. "
            f"{name}=amp_jax.optim.MomentStorage(dtype=jnp.bfloat16)."
        )
    if dtype is not None:
        raise ValueError(
            f"{caller}: `{dtype_name}` and `{name}` both say how the moment is stored; "
            f"pass {name}=MomentStorage(dtype=...) alone."
        )
    return storage


def _adam(g32, m32, v32, *, b1, b2, eps, eps_root, bc1, bc2):
    """Adam's step on full-precision moments: ``(update, new mu, new nu)``."""
    m_new = (1 - b1) * g32 + b1 * m32
    v_new = (1 - b2) * _tree.abs_sq(g32) + b2 * v32
    u = (m_new / bc1.astype(m_new.dtype)) / (
        jnp.sqrt(v_new / bc2.astype(v_new.dtype) + eps_root) + eps
    )
    return u, m_new, v_new


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: DTypeLike | None = None,
    *,
    mu_storage: MomentStorage | None = None,
    nu_storage: MomentStorage | None = None,
) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with each moment stored by a `MomentStorage`.

    The moments, bias corrections and ratio are computed in (at least)
    float32 and then stored: in a dtype (rounded to it as the storage's
    ``rounding`` says: by default stochastically for ``nu``, whose decay
    ``0.999`` moves it by less than half a bfloat16 ulp a step) or block-wise
    quantized (8-bit, 4-bit, float8; ``nu`` as its square root). With the
    default storages and float32 parameters the operations are
    ``optax.scale_by_adam``'s: bitwise identical under ``jit``.
    [`adamw`][amp_jax.optim.adamw] chains it with weight decay and the
    learning rate.

    Args:
      b1: decay rate of the first moment.
      b2: decay rate of the second moment.
      eps: term added to the denominator.
      eps_root: term added to the second moment inside the square root.
      mu_dtype: as in optax: shorthand for ``mu_storage=MomentStorage(dtype=mu_dtype)``.
      mu_storage: how the first moment is stored (``None``: each parameter's dtype).
      nu_storage: how the second moment is stored (``None``: each
        parameter's dtype, bfloat16 for float16 parameters). A float16
        ``dtype`` is refused (squared gradients below 6e-8 flush to zero).

    Returns:
      An ``optax.GradientTransformation`` with ``optax.ScaleByAdamState``
      state, or [`ScaleByQuantizedAdamState`][amp_jax.optim.ScaleByQuantizedAdamState]
      when a storage is quantized. Updates come back in the gradients' dtypes.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import optim
      >>> tx = optim.scale_by_adam(
      ...     mu_storage=optim.MomentStorage(dtype=jnp.bfloat16),
      ...     nu_storage=optim.MomentStorage(format="8bit", min_quantized_size=0))
      >>> s = tx.init({"w": jnp.zeros((4, 256))})
      >>> s.mu["w"].dtype, s.nu["w"].codes.dtype
      (dtype(bfloat16), dtype('uint8'))

    References:
      Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
      https://arxiv.org/abs/1412.6980.
      Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
      2022, https://arxiv.org/abs/2110.02861.
    """
    caller = "scale_by_adam"
    _check.adam_hyperparameters(caller, b1, b2, eps, eps_root)
    mu_storage = _storage_arg(mu_storage, mu_dtype, caller, "mu_storage", "mu_dtype")
    nu_storage = _storage_arg(nu_storage, None, caller, "nu_storage", "nu_dtype")
    if nu_storage.dtype == jnp.float16:
        raise ValueError(
            f"{caller}: a float16 `nu_storage` cannot hold a second moment: squared "
            "gradients below 6e-8 flush to zero; use MomentStorage(dtype=jnp.bfloat16)."
        )
    quantized = mu_storage.format is not None or nu_storage.format is not None
    state_cls: Any = ScaleByQuantizedAdamState if quantized else optax.ScaleByAdamState

    def init_fn(params):
        return state_cls(
            jnp.zeros([], jnp.int32),
            mu_storage.init(params),
            nu_storage.init(params, second_moment=True),
        )

    def update_fn(updates, state, params=None):
        del params
        count_inc, bc1, bc2 = _tree.adam_counts(state.count, b1, b2)
        k1, k2 = _storage.step_keys(count_inc)
        specs = (
            _storage.moment(mu_storage, k1, b1, second=False, traced=False),
            _storage.moment(nu_storage, k2, b2, second=True, traced=True),
        )
        adam = functools.partial(_adam, b1=b1, b2=b2, eps=eps, eps_root=eps_root, bc1=bc1, bc2=bc2)
        new_updates, mu, nu = _storage.map_moments(adam, updates, (state.mu, state.nu), specs)
        return new_updates, state_cls(count_inc, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_lion(
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: DTypeLike | None = None,
    *,
    mu_storage: MomentStorage | None = None,
) -> optax.GradientTransformation:
    """``optax.scale_by_lion`` with its momentum stored by a `MomentStorage`.

    The update is ``sign((1 - b1) * g + b1 * mu)`` and the momentum
    ``mu = (1 - b2) * g + b2 * mu``, computed in (at least) float32 and then
    stored. ``b2=0.99`` moves ``mu`` by 1% a step, under half a bfloat16 ulp
    or an 8-bit code's gap: the default ``rounding="auto"`` rounds it
    stochastically. With float32 moments the result is ``optax.scale_by_lion``'s.

    Args:
      b1: rate for combining the momentum and the current gradient.
      b2: decay rate of the momentum.
      mu_dtype: as in optax: shorthand for ``mu_storage=MomentStorage(dtype=mu_dtype)``.
      mu_storage: how the momentum is stored (``None``: each parameter's dtype).

    Returns:
      An ``optax.GradientTransformation`` with ``optax.ScaleByLionState`` state.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> tx = optax.chain(
      ...     optim.scale_by_lion(mu_storage=optim.MomentStorage(format="8bit")),
      ...     optax.scale_by_learning_rate(1e-4))
      >>> tx.init({"w": jnp.zeros((64, 256))})[0].mu["w"].codes.dtype
      dtype('uint8')

    References:
      Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS
      2023, https://arxiv.org/abs/2302.06675.
    """
    caller = "scale_by_lion"
    for name, value in (("b1", b1), ("b2", b2)):
        _check.hyperparameter(value, caller, name, "0.9")
    storage = _storage_arg(mu_storage, mu_dtype, caller, "mu_storage", "mu_dtype")

    def init_fn(params):
        return optax.ScaleByLionState(count=jnp.zeros([], jnp.int32), mu=storage.init(params))

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        spec = _storage.moment(
            storage, _storage.step_keys(count_inc)[0], b2, second=False, traced=True
        )

        def lion(g, m):
            return jnp.sign((1.0 - b1) * g + b1 * m), (1 - b2) * g + b2 * m

        new_updates, mu = _storage.map_moments(lion, updates, (state.mu,), (spec,))
        return new_updates, optax.ScaleByLionState(count=count_inc, mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def ema(
    decay: float,
    debias: bool = True,
    accumulator_dtype: DTypeLike | None = None,
    *,
    storage: MomentStorage | None = None,
) -> optax.GradientTransformation:
    """``optax.ema`` with the average stored by a `MomentStorage`: the momentum
    of SGD with momentum (``debias=False``), of Muon, or Adafactor's first moment.

    ``ema = (1 - decay) * g + decay * ema`` is computed in (at least)
    float32 and then stored; the update is the unrounded ``ema`` (over ``1 -
    decay**count`` with ``debias``). With float32 storage the result is
    ``optax.ema``'s.

    Args:
      decay: decay rate of the average.
      debias: divide the update by ``1 - decay**count``.
      accumulator_dtype: as in optax: shorthand for ``storage=MomentStorage(dtype=...)``.
      storage: how the average is stored (``None``: each parameter's dtype).

    Returns:
      An ``optax.GradientTransformation`` with ``optax.EmaState`` state.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import optim
      >>> tx = optim.ema(0.9, storage=optim.MomentStorage(dtype=jnp.bfloat16))
      >>> tx.init(jnp.zeros(3)).ema.dtype
      dtype(bfloat16)

    References:
      Polyak & Juditsky, "Acceleration of Stochastic Approximation by
      Averaging", SIAM J. Control Optim. 30(4), 1992,
      https://doi.org/10.1137/0330046.
    """
    caller = "ema"
    _check.hyperparameter(decay, caller, "decay", "0.9")
    debias = _check.boolean(debias, caller, "debias")
    store = _storage_arg(storage, accumulator_dtype, caller, "storage", "accumulator_dtype")

    def init_fn(params):
        return optax.EmaState(count=jnp.zeros([], jnp.int32), ema=store.init(params))

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        key = _storage.step_keys(count_inc)[0]
        spec = _storage.moment(store, key, decay, second=False, traced=True)
        correction = 1 - decay**count_inc

        def average(g, m):
            new = (1 - decay) * g + decay * m
            return (new / correction.astype(new.dtype) if debias else new), new

        new_updates, new_ema = _storage.map_moments(average, updates, (state.ema,), (spec,))
        return new_updates, optax.EmaState(count=count_inc, ema=new_ema)

    return optax.GradientTransformation(init_fn, update_fn)
