"""AdamW with per-state dtypes and optional Kahan summation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from amp_jax.optim import _check, _kahan, _moments, _quantized, _tree
from amp_jax.optim._storage import MomentStorage, Rounding


def _check_dtype(name: str, dtype: Any, caller: str) -> Any:
    if dtype is None:
        return None
    dtype = _tree.float_dtype(dtype, name, "; use e.g. jnp.bfloat16 or jnp.float32, or None")
    if dtype.itemsize == 1:  # float8 (and float4): not enough range for a moment
        raise ValueError(
            f"{caller}: `{name}`={dtype.name} is a one-byte float: a moment cast to it "
            "loses its small values (and optax's arithmetic cannot promote it). For "
            "float8 moments pass state_format='float8' to amp_jax.optim.adamw (block-wise "
            "scaled float8 codes, computed in float32); otherwise use "
            f"{name}=jnp.bfloat16 or jnp.float32."
        )
    if name == "nu_dtype" and dtype == jnp.float16:
        raise ValueError(
            f"{caller}: `nu_dtype`=float16 cannot hold a second moment: squared "
            "gradients below 6e-8 flush to zero and those below 6e-5 lose their "
            "precision (in a small transformer 15% and 92% of nu), and an element "
            "whose nu flushed gets an update about 30x float32 Adam's. Use "
            "nu_dtype=jnp.bfloat16 (the same two bytes, float32's range) or jnp.float32; "
            "mu_dtype=jnp.float16 is fine."
        )
    return dtype


def scale_by_any_precision_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: DTypeLike | None = None,
    *,
    nu_dtype: DTypeLike | None = None,
    state_rounding: _quantized.StateRounding = "stochastic",
) -> optax.GradientTransformation:
    """Adam scaling with moments stored in chosen dtypes, computed in float32.

    The moment updates, bias corrections and the ratio are computed in (at
    least) float32 and the moments are then cast to their storage dtype. This
    matters because the decay rates cannot be represented in low precision:
    ``0.999`` rounds to ``1.0`` in bfloat16, which would freeze ``nu``. With
    float32 moments the operations are exactly those of
    ``optax.scale_by_adam``, so the result is bitwise identical under
    ``jit`` (eagerly, op by op, to about 1e-5 relative). The
    positional arguments are ``optax.scale_by_adam``'s; complex parameters
    get a real second moment ``|g|**2``, as in optax.

    A moment stored in float16, or in bfloat16 with a decay above 0.95
    (``nu`` with the default ``b2=0.999``), is rounded to its dtype stochastically:
    it moves by ``(1 - b2)`` of itself a step, less than half an ulp of
    bfloat16 (2**-9), so rounded to the nearest value it would stay where it
    is and stop following the gradients (after 10,000 steps of a steady
    gradient stream, ``sqrt(nu)`` 42% above float32 Adam's and updates 30%
    smaller). A float16 ``mu`` of small gradients lies among float16's
    subnormals, whose spacing (6e-8) a fast moment's step also falls under
    (on a small transformer's gradients, updates 3.2% larger than float32
    Adam's rounded to the nearest value, 0.3% stochastically). The random
    bits are a hash of the value's top 16 bits and the step count: no key to
    pass, nothing added to the state.

    Args:
      b1: decay rate of the first moment.
      b2: decay rate of the second moment.
      eps: term added to the denominator.
      eps_root: term added to the second moment inside the square root.
      mu_dtype: storage dtype of the first moment; ``None`` uses each
        parameter's dtype (as optax does).
      nu_dtype: storage dtype of the second moment; ``None`` uses each
        parameter's dtype, except float16: bfloat16. float16 is refused (its
        range flushes small squared gradients to zero; use bfloat16).
      state_rounding: ``"stochastic"`` (default: a float16 moment, and a
        bfloat16 one with a decay above 0.95, is rounded stochastically,
        unbiased) or
        ``"nearest"`` (every moment cast to its dtype, round to nearest).
        float32 moments are never rounded.

    Returns:
      An ``optax.GradientTransformation`` with ``optax.ScaleByAdamState`` state.
      Updates come back in the gradients' dtypes, as optax's do.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import optim
      >>> tx = optim.scale_by_any_precision_adam(nu_dtype=jnp.bfloat16)
      >>> tx.init(jnp.zeros(2)).nu.dtype
      dtype(bfloat16)

    References:
      Zamirai et al., "Revisiting BFloat16 Training", 2020,
      https://arxiv.org/abs/2010.06192.
      torchdistx AnyPrecisionAdamW,
      https://github.com/pytorch/torchdistx/blob/main/src/python/torchdistx/optimizers/anyprecision_optimizer.py.
    """
    caller = "scale_by_any_precision_adam"
    _check.adam_hyperparameters(caller, b1, b2, eps, eps_root)
    mu_dtype = _check_dtype("mu_dtype", mu_dtype, caller)
    nu_dtype = _check_dtype("nu_dtype", nu_dtype, caller)
    _quantized.check_rounding(state_rounding, caller)
    rounding: Rounding = "auto" if state_rounding == "stochastic" else "nearest"
    return _moments.scale_by_adam(
        b1,
        b2,
        eps,
        eps_root,
        mu_storage=MomentStorage(dtype=mu_dtype, rounding=rounding),
        nu_storage=MomentStorage(dtype=nu_dtype, rounding=rounding),
    )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: DTypeLike | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nu_dtype: DTypeLike | None = None,
    kahan: bool = False,
    compensation_dtype: DTypeLike | None = None,
    state_format: _quantized.StateFormat | None = None,
    block_size: int | None = None,
    min_quantized_size: int = 4096,
    quantize_mask: Any | Callable[[optax.Params], Any] | None = None,
    state_rounding: _quantized.StateRounding = "stochastic",
) -> optax.GradientTransformationExtraArgs:
    """Any-precision AdamW: per-state dtypes and optional Kahan summation.

    ``optax.chain(scale_by_any_precision_adam(...),
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate))``, wrapped in
    [`kahan_summation`][amp_jax.optim.kahan_summation] when ``kahan=True``. With float32 parameters, default
    dtypes and ``kahan=False`` it is bitwise identical to ``optax.adamw``
    under ``jit`` (``nesterov=False``), schedules included; run eagerly, op
    by op, the two agree to about 1e-5 relative.

    Moment arithmetic is always done in float32 and only the storage uses
    ``mu_dtype``/``nu_dtype``, because bfloat16 cannot represent ``b2=0.999``
    (it rounds to 1.0 and the second moment would never move). A bfloat16
    moment with a decay above 0.95 (``nu`` by default), and a float16 ``mu``,
    is stored stochastically rounded: rounded to the nearest value it would
    stop moving after a few hundred steps
    ([`scale_by_any_precision_adam`][amp_jax.optim.scale_by_any_precision_adam]
    says why). float16 cannot hold ``nu`` (squared gradients below 6e-8
    flush to 0): ``nu_dtype=jnp.float16`` is refused, and float16 parameters
    store ``nu`` in bfloat16 unless ``nu_dtype`` says otherwise.

    ``state_format`` (``"8bit"``, ``"4bit"``, ``"float8"``) stores the moments
    block-wise quantized instead ([`scale_by_quantized_adam`][amp_jax.optim.scale_by_quantized_adam]): 8-bit and
    float8 cost 1.02 bytes per moment value, 4-bit 0.53. Parameters smaller
    than ``min_quantized_size`` (4096) elements and those ``quantize_mask``
    deselects (pass one that deselects the embeddings) keep float32 moments.
    The second moment is rounded to its codes stochastically (unbiased: to
    the nearest code it would lag; [`scale_by_quantized_adam`][amp_jax.optim.scale_by_quantized_adam] says why),
    the first to the nearest code; ``state_rounding="nearest"`` rounds both
    to the nearest.

    The positional arguments and their defaults are ``optax.adamw``'s
    (``learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask``;
    ``weight_decay=1e-4``), so a call ported from ``optax.adamw`` means the
    same; everything else is keyword-only. Complex parameters get optax's
    real second moment ``|g|**2``.
    With ``optax.inject_hyperparams`` pass ``static_args=("mu_dtype", "nu_dtype", "compensation_dtype")``: dtypes are
    callables and would otherwise be mistaken for schedules; with quantized
    states pass ``static_args=("state_format", "min_quantized_size")`` (and
    ``"block_size"`` when you set it): they shape the state.

    Args:
      learning_rate: a float or an optax schedule.
      b1: first-moment decay.
      b2: second-moment decay.
      eps: denominator term.
      eps_root: term added to the second moment inside the square root.
      mu_dtype: storage dtype of the first moment (``None``: parameter dtype).
        A one-byte float (float8) is refused: use ``state_format="float8"``.
      weight_decay: decoupled weight decay coefficient, a float or an optax
        schedule (a function of the step count), as in ``optax.adamw``.
      mask: as in ``optax.add_decayed_weights``.
      nu_dtype: storage dtype of the second moment (``None``: parameter dtype;
        bfloat16 for float16 parameters). float16 is refused.
      kahan: wrap the update in [`kahan_summation`][amp_jax.optim.kahan_summation] (for pure bfloat16
        parameters).
      compensation_dtype: dtype of the Kahan buffer (``None``: parameter dtype).
        Only used with ``kahan=True``.
      state_format: ``None`` (moments in ``mu_dtype``/``nu_dtype``), or
        ``"8bit"``, ``"4bit"``, ``"float8"`` for quantized moments.
      block_size: quantization block along the last axis (``None``: 256,
        4-bit 128). Only with ``state_format``.
      min_quantized_size: smaller parameters keep float32 moments.
      quantize_mask: pytree of bools like the parameters, or a function of
        them; ``False`` keeps float32 moments (embeddings).
      state_rounding: ``"stochastic"`` (``nu``, and any moment with a decay
        above 0.95, stored in bfloat16/float16 or quantized) or ``"nearest"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is the chain's
      tuple ``(ScaleByAdamState, EmptyState/MaskedState, lr state)`` (with
      ``state_format``, a [`ScaleByQuantizedAdamState`][amp_jax.optim.ScaleByQuantizedAdamState] first), or a
      [`KahanSummationState`][amp_jax.optim.KahanSummationState] around it.

    Raises:
      ValueError: for a non-floating or one-byte (float8) dtype argument, ``compensation_dtype``
        without ``kahan=True``, an unknown ``state_format``, or
        ``mu_dtype``/``nu_dtype``/``block_size``/``quantize_mask`` given with
        the other storage choice.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from amp_jax import optim
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> tx = optim.adamw(1e-3, mu_dtype=jnp.float32, kahan=True)
      >>> state = tx.init(params)
      >>> state.compensation["w"].dtype, state.inner_state[0].mu["w"].dtype
      (dtype(bfloat16), dtype('float32'))

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
      https://arxiv.org/abs/1711.05101.
      torchdistx AnyPrecisionAdamW,
      https://github.com/pytorch/torchdistx/blob/main/src/python/torchdistx/optimizers/anyprecision_optimizer.py.
      Kahan, "Further remarks on reducing truncation errors", 1965.
      Zamirai et al., "Revisiting BFloat16 Training", 2020,
      https://arxiv.org/abs/2010.06192.
      Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
      2022, https://arxiv.org/abs/2110.02861.
      Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS
      2023, https://arxiv.org/abs/2309.01507.
    """
    _check.hyperparameter(learning_rate, "adamw", "learning_rate", "1e-3", schedule=True)
    _check.hyperparameter(weight_decay, "adamw", "weight_decay", "1e-4", schedule=True)
    for name, value, example in (
        ("b1", b1, "0.9"),
        ("b2", b2, "0.999"),
        ("eps", eps, "1e-8"),
        ("eps_root", eps_root, "0.0"),
    ):
        _check.hyperparameter(value, "adamw", name, example)
    _check_dtype("mu_dtype", mu_dtype, "adamw")
    _check_dtype("nu_dtype", nu_dtype, "adamw")
    kahan = _check.boolean(kahan, "adamw", "kahan")
    if compensation_dtype is not None and not kahan:
        raise ValueError(
            "`compensation_dtype` is only used with `kahan=True`; "
            "pass kahan=True or drop compensation_dtype."
        )
    if state_format is None:
        if block_size is not None or quantize_mask is not None:
            raise ValueError(
                "adamw: `block_size` and `quantize_mask` are only used "
                "with quantized states; pass state_format='8bit' (or '4bit', 'float8') "
                "or drop them."
            )
        scale = scale_by_any_precision_adam(
            b1, b2, eps, eps_root, mu_dtype, nu_dtype=nu_dtype, state_rounding=state_rounding
        )
    elif mu_dtype is not None or nu_dtype is not None:
        raise ValueError(
            f"adamw: `state_format`={state_format!r} stores both moments quantized "
            "(small and masked-out parameters in float32); drop mu_dtype/nu_dtype, "
            "or drop state_format to store the moments in those dtypes."
        )
    else:
        scale = _quantized.scale_by_quantized_adam(
            b1,
            b2,
            eps,
            eps_root,
            state_format=state_format,
            block_size=block_size,
            min_quantized_size=min_quantized_size,
            quantize_mask=quantize_mask,
            state_rounding=state_rounding,
        )
    tx = optax.chain(
        scale,
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    if kahan:
        return _kahan.kahan_summation(tx, compensation_dtype)
    return _warning_once(optax.with_extra_args_support(tx))


def _warning_once(
    tx: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` warns, the first time only, when 16-bit
    parameters would be updated with rounding to nearest
    (`_check.warn_if_rounded_away`)."""
    warned = False

    def init_fn(params):
        nonlocal warned
        if not warned:
            warned = _check.warn_if_rounded_away(params, "adamw")
        return tx.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, tx.update)
