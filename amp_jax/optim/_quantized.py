"""Adam with block-wise quantized moments: 8-bit, 4-bit and float8 states.

[`scale_by_quantized_adam`][amp_jax.optim.scale_by_quantized_adam] is
[`scale_by_adam`][amp_jax.optim.scale_by_adam] with both moments in a quantized
[`MomentStorage`][amp_jax.optim.MomentStorage]; the codes themselves are in
`amp_jax.optim._codes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from amp_jax.optim import _check, _moments, _storage
from amp_jax.optim._codes import DEFAULT_BLOCK as DEFAULT_BLOCK
from amp_jax.optim._codes import DEFAULT_MIN_SIZE as DEFAULT_MIN_SIZE
from amp_jax.optim._codes import FORMATS as FORMATS
from amp_jax.optim._codes import ROUNDINGS as ROUNDINGS
from amp_jax.optim._codes import SLOW_DECAY as SLOW_DECAY
from amp_jax.optim._codes import Codec as Codec
from amp_jax.optim._codes import QuantizedArray as QuantizedArray
from amp_jax.optim._codes import StateFormat as StateFormat
from amp_jax.optim._codes import StateRounding as StateRounding
from amp_jax.optim._codes import _from_float8 as _from_float8
from amp_jax.optim._codes import _to_float8 as _to_float8
from amp_jax.optim._codes import _toward as _toward
from amp_jax.optim._codes import block_layout as block_layout
from amp_jax.optim._codes import codecs as codecs
from amp_jax.optim._codes import dequantize as dequantize
from amp_jax.optim._codes import dynamic_map as dynamic_map
from amp_jax.optim._codes import quantize as quantize
from amp_jax.optim._codes import quantized_zeros as quantized_zeros
from amp_jax.optim._moments import ScaleByQuantizedAdamState as ScaleByQuantizedAdamState
from amp_jax.optim._storage import MomentStorage

_codecs = codecs  # (the names the tests and benchmarks know)
_Codec = Codec
_step_keys = _storage.step_keys


def scale_by_quantized_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quantized_size: int = 4096,
    quantize_mask: Any | Callable[[optax.Params], Any] | None = None,
    state_rounding: StateRounding = "stochastic",
) -> optax.GradientTransformation:
    """Adam scaling with block-wise quantized moments (8-bit, 4-bit, float8).

    Each step dequantizes the moments to float32, does Adam's float32 update
    (the operations of ``optax.scale_by_adam``, ``eps_root=0``), computes the
    update from the float32 moments and stores them quantized again. Formats:

    * ``"8bit"``: one ``uint8`` code per element indexing the dynamic tree map
      of Dettmers et al. (signed for ``mu``, unsigned for ``nu``), a float32
      absmax per block of 256: 1.016 bytes per moment value.
    * ``"4bit"``: two codes per byte, blocks of 128; ``mu`` uses a signed
      powers-of-two map (0, 0.75, ``+-2**-k`` for k = 0..6) and ``nu`` the
      zero-point-free linear map ``(i + 1) / 16`` of Li et al.: 0.53 bytes
      per moment value.
    * ``"float8"``: ``float8_e4m3fn`` values scaled so the block absmax maps to
      448 (stored as their bits, ``uint8``), blocks of 256: 1.016 bytes per
      moment value.

    In every format the second moment is stored as ``sqrt(nu)``, which halves
    the dynamic range a block must hold (stored directly, the ``nu`` of a small
    gradient decodes to 0 and the next step is ``m / eps``). Moments with a
    decay above 0.95 (``nu`` with the default ``b2``) move by less than a code's
    gap per step: rounded to the nearest code they would stall and lag behind
    float32 Adam's, so ``state_rounding="stochastic"`` rounds them
    stochastically: ``nu`` unbiased in ``nu**(1/4)``, which keeps the
    factor ``1 / sqrt(nu)`` the update is scaled by unbiased over a long run
    (unbiased in the stored ``sqrt(nu)``, float8 and 4-bit updates were 2.5-3.5%
    larger than float32 AdamW's); ``mu`` is rounded to the nearest code.
    docs/optim.md has the layout, the maps and the measured drift.

    Parameters with fewer than ``min_quantized_size`` elements, non-floating
    parameters and those ``quantize_mask`` deselects (embeddings, as the
    8-bit paper prescribes) keep float32 moments, updated bitwise like
    [`scale_by_any_precision_adam`][amp_jax.optim.scale_by_any_precision_adam] with float32 states.

    Args:
      b1: first-moment decay.
      b2: second-moment decay.
      eps: denominator term.
      eps_root: term added to the second moment inside the square root.
      state_format: ``"8bit"``, ``"4bit"`` or ``"float8"``.
      block_size: elements per block along the last axis (``None``: 256 for
        8-bit and float8, 128 for 4-bit; even for 4-bit). Rows shorter than a
        block form one block.
      min_quantized_size: parameters with fewer elements keep float32 moments.
      quantize_mask: a pytree of bools like the parameters (or a function of
        the parameters returning one); ``False`` keeps float32 moments for
        that parameter. ``None`` selects all.
      state_rounding: ``"stochastic"`` (default: moments with a decay above
        0.95, ``nu`` with the default ``b2``, are rounded stochastically, from
        a hash of the value and the step count: no key to pass, nothing added
        to the state) or ``"nearest"`` (every moment to its nearest code, as
        bitsandbytes and torchao do). A decay that ``optax.inject_hyperparams``
        traces is taken as the default's: ``nu`` stochastic, ``mu`` nearest.

    Returns:
      An ``optax.GradientTransformation`` with
      [`ScaleByQuantizedAdamState`][amp_jax.optim.ScaleByQuantizedAdamState] state. Updates come back in the gradients' dtypes.

    Raises:
      ValueError: for an unknown ``state_format`` or ``state_rounding``, an
        odd 4-bit block size or a mask that does not match the parameters.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import optim
      >>> tx = optim.scale_by_quantized_adam(state_format="8bit")
      >>> s = tx.init({"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)})
      >>> s.mu["w"].codes.shape, s.mu["w"].absmax.shape, s.mu["b"].dtype
      ((64, 2, 256), (64, 2), dtype('float32'))

    References:
      Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via
      Block-wise Quantization", ICLR 2022, https://arxiv.org/abs/2110.02861.
      Li, Chen & Zhu, "Memory Efficient Optimizers with 4-bit States",
      NeurIPS 2023, https://arxiv.org/abs/2309.01507.
      torchao low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8),
      https://github.com/pytorch/ao/tree/main/torchao/optim.
    """
    block_size, min_quantized_size = _checked_options(
        b1, b2, eps, eps_root, state_format, block_size, min_quantized_size, state_rounding
    )
    storage = MomentStorage(
        format=state_format,
        rounding="auto" if state_rounding == "stochastic" else "nearest",
        block_size=block_size,
        min_quantized_size=min_quantized_size,
        quantize_mask=quantize_mask,
    )
    return _moments.scale_by_adam(b1, b2, eps, eps_root, mu_storage=storage, nu_storage=storage)


def _checked_options(
    b1: Any,
    b2: Any,
    eps: Any,
    eps_root: Any,
    state_format: Any,
    block_size: Any,
    min_quantized_size: Any,
    state_rounding: Any,
) -> tuple[int, int]:
    """Checks `scale_by_quantized_adam`'s arguments: ``(block_size, min_quantized_size)``."""
    caller = "scale_by_quantized_adam"
    _check.adam_hyperparameters(caller, b1, b2, eps, eps_root)
    if state_format not in FORMATS:
        raise ValueError(
            f"{caller}: `state_format` must be one of {', '.join(map(repr, FORMATS))}, "
            f"got {state_format!r}."
        )
    if block_size is None:
        block_size = DEFAULT_BLOCK[state_format]
    block_size = _check.integer(block_size, caller, "block_size", 2, str(block_size))
    if state_format == "4bit" and block_size % 2:
        raise ValueError(
            f"{caller}: 4-bit states pack two codes per byte, so `block_size` must be "
            f"even, got {block_size}; use e.g. block_size=128."
        )
    min_quantized_size = _check.integer(
        min_quantized_size, caller, "min_quantized_size", 0, str(DEFAULT_MIN_SIZE)
    )
    check_rounding(state_rounding, caller)
    return block_size, min_quantized_size


def check_rounding(state_rounding: Any, caller: str) -> None:
    """Raises a ``ValueError`` for a ``state_rounding`` that is not one of `ROUNDINGS`."""
    if state_rounding not in ROUNDINGS:
        raise ValueError(
            f"{caller}: `state_rounding` must be one of {', '.join(map(repr, ROUNDINGS))}, "
            f"got {state_rounding!r}."
        )
