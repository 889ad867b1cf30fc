"""How an optimizer moment is stored: a dtype or a block-wise quantized format,
and how it is rounded to it.

`MomentStorage` is the state codec: ``init`` lays out zero moments for the
parameters, ``decode`` gives a stored leaf back in (at least) float32 and
``encode`` stores a new one, rounded. `map_moments` runs a transformation's
per-leaf arithmetic over its stored moments (quantized ones in their block
layout); [`scale_by_adam`][amp_jax.optim.scale_by_adam],
[`scale_by_lion`][amp_jax.optim.scale_by_lion] and [`ema`][amp_jax.optim.ema]
are built on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from amp_jax._src.compat import PyTreeDef
from amp_jax.optim import _check, _codes, _rounding, _stochastic, _tree
from amp_jax.optim._codes import QuantizedArray

Rounding = Literal["auto", "stochastic", "nearest"]
ROUNDINGS: tuple[str, ...] = ("auto", "stochastic", "nearest")
_WHERE = "MomentStorage"


@dataclasses.dataclass(frozen=True)
class MomentStorage:
    """How one optimizer moment is stored (a state codec): a frozen record.

    A moment is computed in (at least) float32 and stored either in ``dtype``
    or, with ``format``, block-wise quantized (a
    [`QuantizedArray`][amp_jax.optim.QuantizedArray] per parameter: 8-bit,
    4-bit or float8 codes plus a float32 absmax per block; parameters smaller
    than ``min_quantized_size`` and those ``quantize_mask`` deselects keep
    float32). Pass it to [`scale_by_adam`][amp_jax.optim.scale_by_adam]
    (``mu_storage``, ``nu_storage``), [`ema`][amp_jax.optim.ema] or
    [`scale_by_lion`][amp_jax.optim.scale_by_lion], or use ``init`` /
    ``decode`` / ``encode`` in a transformation of your own.

    Attributes:
      dtype: storage dtype of a plain moment (``None``: each parameter's
        dtype; for a second moment of a float16 parameter, bfloat16). A
        one-byte float is refused: use ``format="float8"``.
      format: ``None``, or ``"8bit"``, ``"4bit"``, ``"float8"`` for block-wise
        quantized moments (docs/optim.md has the maps).
      rounding: ``"auto"`` (default): stochastically where rounding to the
        nearest would stall the moment -- a decay above 0.95 (it moves by less
        than a code's or a bfloat16 ulp's gap a step) or a float16 moment
        (subnormals) -- and to the nearest otherwise; ``"stochastic"``:
        always; ``"nearest"``: never. Stochastic bits are a hash of the value
        and the step count: no key to pass, nothing added to the state.
        A float32 moment is never rounded.
      block_size: elements per quantization block along the last axis
        (``None``: 256, 4-bit 128; even for 4-bit). Only with ``format``.
      min_quantized_size: parameters with fewer elements keep float32 moments.
      quantize_mask: a pytree of bools like the parameters (or a function of
        them); ``False`` keeps a float32 moment. Only with ``format``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import optim
      >>> s = optim.MomentStorage(format="8bit", min_quantized_size=0)
      >>> q = s.init({"w": jnp.zeros((2, 300))})["w"]
      >>> q.codes.shape, q.codes.dtype
      ((2, 2, 256), dtype('uint8'))
      >>> optim.MomentStorage(dtype=jnp.bfloat16).init(jnp.zeros(3)).dtype
      dtype(bfloat16)
    """

    dtype: DTypeLike | None = None
    format: _codes.StateFormat | None = None
    rounding: Rounding = "auto"
    block_size: int | None = None
    min_quantized_size: int = _codes.DEFAULT_MIN_SIZE
    quantize_mask: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(
                f"{_WHERE}: `rounding` must be one of {', '.join(map(repr, ROUNDINGS))}, "
                f"got {self.rounding!r}."
            )
        if self.dtype is not None:
            dtype = _tree.float_dtype(self.dtype, "dtype", "; use e.g. jnp.bfloat16, or None")
            if dtype.itemsize == 1:
                raise ValueError(
                    f"{_WHERE}: `dtype`={dtype.name} is a one-byte float: a moment cast to "
                    "it loses its small values. Use format='float8' (block-wise scaled "
                    "float8 codes) or dtype=jnp.bfloat16."
                )
            object.__setattr__(self, "dtype", dtype)
        min_size = _check.integer(self.min_quantized_size, _WHERE, "min_quantized_size", 0, "4096")
        object.__setattr__(self, "min_quantized_size", min_size)
        if self.format is None:
            if self.block_size is not None or self.quantize_mask is not None:
                raise ValueError(
                    f"{_WHERE}: `block_size` and `quantize_mask` are only used with "
                    "format='8bit' (or '4bit', 'float8'); pass a format or drop them."
                )
            return
        if self.format not in _codes.FORMATS:
            raise ValueError(
                f"{_WHERE}: `format` must be None or one of "
                f"{', '.join(map(repr, _codes.FORMATS))}, got {self.format!r}."
            )
        if self.dtype is not None:
            raise ValueError(
                f"{_WHERE}: `dtype` and `format`={self.format!r} are two storages; "
                "pass one of them."
            )
        block = self.block_size or _codes.DEFAULT_BLOCK[self.format]
        block = _check.integer(block, _WHERE, "block_size", 2, str(block))
        if self.format == "4bit" and block % 2:
            raise ValueError(
                f"{_WHERE}: 4-bit states pack two codes per byte, so `block_size` must "
                f"be even, got {block}; use e.g. block_size=128."
            )
        object.__setattr__(self, "block_size", block)

    def codec(self, second_moment: bool = False) -> _codes.Codec:
        """The quantization codec of this format for a first (signed) or second
        (non-negative, stored as its square root) moment."""
        if self.format is None:
            raise ValueError(f"{_WHERE}: `codec` needs a quantized `format`.")
        return _codes.codecs(self.format)[int(second_moment)]

    def init(self, params: Any, *, second_moment: bool = False) -> Any:
        """Zero moments for ``params``, in their stored form (a pytree like
        ``params``; each moment takes its parameter's sharding).

        ``second_moment``: a mean of squares (Adam's ``nu``): quantized as its
        square root, and a float16 parameter's moment in bfloat16 by default.
        """
        if self.format is None:
            if not second_moment:
                return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=self.dtype), params)
            return jax.tree.map(
                lambda p: jnp.zeros_like(
                    p, dtype=second_moment_dtype(jnp.result_type(p), self.dtype)
                ),
                params,
            )
        codec, block = self.codec(second_moment), self._block()
        treedef: PyTreeDef
        leaves, treedef = jax.tree.flatten(params)
        out: list[Any] = []
        for p, chosen in zip(leaves, _selection(self.quantize_mask, params)):
            if chosen and _tree.is_float(p) and p.size >= self.min_quantized_size:
                out.append(_codes.quantized_zeros(p, codec, block))
            else:  # complex parameters keep complex moments
                cplx = jnp.iscomplexobj(p)
                full = jnp.promote_types(p.dtype, jnp.complex64) if cplx else jnp.float32
                out.append(jnp.zeros_like(p, dtype=full))
        return treedef.unflatten(out)

    def decode(
        self, stored: Any, shape: tuple[int, ...], *, second_moment: bool = False
    ) -> jax.Array:
        """A stored moment leaf as an array of ``shape`` in (at least) float32."""
        if isinstance(stored, QuantizedArray):
            return _codes.dequantize(stored, self.codec(second_moment), shape)
        return stored.astype(_tree.work_dtype(stored.dtype))

    def encode(
        self,
        x: jax.Array,
        stored: Any,
        *,
        key: jax.Array | None = None,
        second_moment: bool = False,
    ) -> Any:
        """``x`` (the new moment, float32 or wider) stored like the leaf ``stored``.

        ``key``: a ``uint32`` scalar (one per step, e.g. a hash of the step
        count) to round stochastically with, or ``None`` to round to the
        nearest value or code (the transformations pass ``None`` where
        ``rounding`` says so).
        """
        if isinstance(stored, QuantizedArray):
            block, n_blocks = _codes.block_layout(x.shape, self._block(), stored_bits(self))
            blocks = _codes.to_blocks(x.astype(jnp.float32), block, n_blocks)
            return QuantizedArray(*self.codec(second_moment).quantize(blocks, key))
        return store(x, stored.dtype, key)

    def _block(self) -> int:
        assert self.block_size is not None  # (set by __post_init__ with a format)
        return self.block_size


def stored_bits(storage: MomentStorage) -> int:
    """Bits per code of a quantized storage."""
    return 4 if storage.format == "4bit" else 8


def second_moment_dtype(param_dtype: Any, dtype: Any) -> Any:
    """The dtype a second moment is stored in for a parameter of ``param_dtype``:
    ``dtype`` when given, else the parameter's dtype (as optax) except float16,
    whose range cannot hold it (squared gradients below 6e-8 flush): bfloat16."""
    if dtype is not None:
        return dtype
    return jnp.dtype(jnp.bfloat16) if param_dtype == jnp.float16 else param_dtype


def store(x: jax.Array, dtype: Any, key: jax.Array | None) -> jax.Array:
    """A moment ``x`` (computed in float32 or wider) in its storage ``dtype``:
    rounded stochastically where ``key`` is given and ``dtype`` is a narrower
    float, with bits hashed from the value and the step's key
    (`_rounding.uniform_bits`); otherwise the cast."""
    dtype = jnp.dtype(dtype)
    if key is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return x.astype(dtype)
    x32 = x.astype(jnp.float32)
    return _stochastic.round_with_bits(x32, _rounding.uniform_bits(x32, key), dtype)


def _selection(mask: Any, params: Any) -> list[bool]:
    """Per parameter leaf: whether the mask allows quantized states."""
    treedef: PyTreeDef
    leaves, treedef = jax.tree.flatten(params)
    if mask is None:
        return [True] * len(leaves)
    if callable(mask):
        mask = mask(params)
    try:
        flags = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`quantize_mask` must be a pytree of bools shaped like the parameters (or a "
            "function of the parameters returning one), as given to adamw, scale_by_adam, "
            f"scale_by_lion, ema, scale_by_quantized_adam or MomentStorage; {e}"
        ) from e
    return [bool(f) for f in flags]


def step_keys(count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, second) moment's key of step ``count`` (the same for every
    parameter, so a layer's moments round alike whether its parameters are
    stacked or not)."""
    step = _rounding.hash32(count.astype(jnp.uint32) * np.uint32(_tree._GOLDEN))
    return _rounding.hash32(step ^ np.uint32(0x85EBCA6B)), _rounding.hash32(
        step ^ np.uint32(0x27D4EB2F)
    )


def slow(decay: Any, traced: bool) -> bool:
    """Whether a moment with ``decay`` is rounded stochastically (``decay >
    SLOW_DECAY``); ``traced`` for a decay only known at run time
    (``optax.inject_hyperparams``): the answer for the default decay."""
    try:
        return float(decay) > _codes.SLOW_DECAY
    except jax.errors.ConcretizationTypeError:
        return traced


class Moment(NamedTuple):
    """One stored moment of a transformation's update (`map_moments`).

    Attributes:
      storage: how it is stored.
      second: a second moment (``MomentStorage.init``'s ``second_moment``).
      key: rounds every leaf stochastically (``None``: to the nearest).
      f16_key: rounds a float16 leaf stochastically when ``key`` is ``None``.
    """

    storage: MomentStorage
    second: bool
    key: jax.Array | None
    f16_key: jax.Array | None


def moment(
    storage: MomentStorage, step_key: jax.Array, decay: Any, *, second: bool, traced: bool
) -> Moment:
    """The `Moment` of a step: ``storage.rounding`` resolved with the moment's
    ``decay`` (``traced``: `slow`'s answer for a decay known only at run time)."""
    if storage.rounding == "nearest":
        return Moment(storage, second, None, None)
    if storage.rounding == "stochastic" or slow(decay, traced):
        return Moment(storage, second, step_key, step_key)
    return Moment(storage, second, None, step_key)


def map_moments(
    fn: Callable[..., tuple[jax.Array, ...]],
    grads: Any,
    moments: Sequence[Any],
    specs: Sequence[Moment],
) -> tuple[Any, ...]:
    """``(updates, *new moments)``: ``fn(g, *m) -> (u, *new m)`` per leaf, on
    the gradient and the decoded moments (at least float32), the new moments
    encoded again and ``u`` cast to the gradient's dtype. ``None`` gradients
    keep their moments. A leaf whose moments are all quantized alike runs in
    the codes' block layout (one shape in every fused loop; mixing it with the
    parameter's shape costs index arithmetic per element)."""

    def leaf(g: Any, *ms: Any) -> tuple[Any, ...]:
        if g is None:
            return (None, *ms)
        layouts = {
            (s.storage.block_size, stored_bits(s.storage))
            for s, m in zip(specs, ms)
            if isinstance(m, QuantizedArray)
        }
        if len(layouts) == 1 and all(isinstance(m, QuantizedArray) for m in ms):
            return _blocked(fn, g, ms, specs)
        return _full(fn, g, ms, specs)

    n = 1 + len(specs)
    return _tree.map_unzip(leaf, n, grads, *moments, is_leaf=lambda x: x is None)


def _full(fn: Callable[..., Any], g: Any, ms: Sequence[Any], specs: Sequence[Moment]) -> tuple:
    """`map_moments` on one leaf in the parameter's shape."""
    first = ms[0].dtype if not isinstance(ms[0], QuantizedArray) else jnp.float32
    g_w = g.astype(_tree.work_dtype(jnp.promote_types(g.dtype, first)))
    decoded = []
    for m, s in zip(ms, specs):
        if not isinstance(m, QuantizedArray) and s.storage.format is None and not s.second:
            decoded.append(m.astype(g_w.dtype))  # (a first moment: in the gradient's dtype)
        else:
            decoded.append(s.storage.decode(m, g.shape, second_moment=s.second))
    u, *news = fn(g_w, *decoded)
    stored = []
    for x, m, s in zip(news, ms, specs):
        key = s.key
        if key is None and not isinstance(m, QuantizedArray) and m.dtype == jnp.float16:
            key = s.f16_key
        stored.append(s.storage.encode(x, m, key=key, second_moment=s.second))
    return (u.astype(g.dtype), *stored)


def _blocked(fn: Callable[..., Any], g: Any, ms: Sequence[Any], specs: Sequence[Moment]) -> tuple:
    """`map_moments` on one leaf whose moments are quantized in one layout:
    the arithmetic in the codes' block layout, the new moments quantized in
    place; float32 whatever the parameter's dtype (the codes hold far less)."""
    storage = specs[0].storage
    block, n_blocks = _codes.block_layout(g.shape, storage._block(), stored_bits(storage))
    codecs = [s.storage.codec(s.second) for s in specs]
    g32 = g.astype(jnp.float32)
    u, *news = fn(
        _codes.to_blocks(g32, block, n_blocks),
        *[c.dequantize(m.codes, m.absmax) for c, m in zip(codecs, ms)],
    )
    n = g.shape[-1] if g.shape else 1
    if n_blocks * block > n:  # the padding quantizes zeros, as in `quantize`
        real = _codes.to_blocks(jnp.ones(n, bool), block, n_blocks)
        news = [jnp.where(real, x, 0.0) for x in news]
    stored = [QuantizedArray(*c.quantize(x, s.key)) for c, x, s in zip(codecs, news, specs)]
    u = _codes.from_blocks(u, g.shape).astype(g.dtype)  # (the gradients' dtype, as optax)
    return (u, *stored)
