"""Adam with block-wise quantized moments: 8-bit, 4-bit and float8 states.

A quantized moment is stored as codes plus one float32 absmax per block. Blocks
run along the last axis of the parameter, each row padded to whole blocks, so
the codes have shape ``(..., n_blocks, block)`` (``(..., n_blocks, block // 2)``
for 4-bit, two codes per byte) and a block never spans two rows: a parameter
sharded along any axis whose shard holds whole blocks (a leading axis, or a
last axis split in multiples of the block) keeps its blocks on one device.

Codes are indices into a sorted table of values in [-1, 1] (8-bit and 4-bit)
or the bits of ``float8_e4m3fn`` numbers (float8). Every format stores
``uint8`` arrays: a rounding no compiler pass may drop (unlike a float32 ->
bfloat16 -> float32 convert pair under excess precision), and one that loops
write in place (XLA:CPU widens a float8 array to float32 around every
dynamic-update-slice, so a float8 state stack written layer by layer would be
converted whole per layer).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax._src.compat import PyTreeDef
from amp_jax.optim import _check, _rounding, _tree

StateFormat = Literal["8bit", "4bit", "float8"]
FORMATS: tuple[str, ...] = ("8bit", "4bit", "float8")
StateRounding = Literal["stochastic", "nearest"]
ROUNDINGS: tuple[str, ...] = ("stochastic", "nearest")
#: moments with a decay above this move by under 5% of themselves a step, less
#: than a code's gap: ``state_rounding="stochastic"`` rounds them stochastically
SLOW_DECAY = 0.95
#: default elements per block, per format (Dettmers et al. 256, Li et al. 128)
DEFAULT_BLOCK: dict[str, int] = {"8bit": 256, "4bit": 128, "float8": 256}
#: parameters with fewer elements keep float32 moments (bitsandbytes' min_8bit_size)
DEFAULT_MIN_SIZE = 4096
_F8 = jnp.float8_e4m3fn
_F8_MAX = float(jnp.finfo(_F8).max)  # 448


def dynamic_map(
    signed: bool, *, bits: int = 8, exponent_bits: int = 7, zero: bool = True
) -> np.ndarray:
    """The dynamic tree quantization table of Dettmers et al. (2021), sorted.

    ``2**bits`` float32 values in [-1, 1] (signed) or [0, 1]: for each decade
    ``10**(i - exponent_bits + 1)`` the midpoints of a linear split of [0.1, 1]
    into ``2**i`` (signed) or ``2**(i + 1)`` (unsigned) parts, plus 0 and 1 --
    bitsandbytes' ``create_dynamic_map``. Small magnitudes get relative, not
    absolute, resolution, which is what Adam's moments need.
    """
    data: list[float] = []
    free = bits - 1
    for i in range(exponent_bits):
        parts = 2 ** (i + free - exponent_bits) if signed else 2 ** (i + free - exponent_bits + 1)
        bounds = np.linspace(0.1, 1.0, parts + 1)
        means = (bounds[:-1] + bounds[1:]) / 2
        data += list(10.0 ** (i - exponent_bits + 1) * means)
        if signed:
            data += list(-(10.0 ** (i - exponent_bits + 1)) * means)
    data += [0.0, 1.0] if zero else [1.0]
    data += [0.0] * (2**bits - len(data))
    return np.sort(np.asarray(data, np.float64)).astype(np.float32)


def linear_map_without_zero(bits: int = 4) -> np.ndarray:
    """``(i + 1) / 2**bits`` for ``i < 2**bits``: Li et al.'s (2023) zero-point-free
    linear map for the second moment (no code means 0, so a small ``nu`` never
    becomes 0 and never turns ``m / (sqrt(nu) + eps)`` into ``m / eps``)."""
    return ((np.arange(2**bits) + 1) / 2**bits).astype(np.float32)


def pow2_map(bits: int = 4) -> np.ndarray:
    """The 4-bit first-moment map: 0, ``+-2**-k`` for ``k < 2**(bits - 1) - 1``
    and 0.75, sorted (16 codes for 4 bits: a factor 2 between neighbouring
    magnitudes down to 2**-6 of the block's absmax).

    The dynamic map with 3 decades in 16 codes (0.0055, 0.0325, 0.0775,
    0.2125, ...) left a value between a fifth and a fiftieth of its block's
    absmax jumping between codes 2.4-6x apart: forced onto a 2-element
    parameter (Rosenbrock), 4-bit AdamW stopped 0.056-0.076 from the minimum;
    with this map it reaches it within 1e-3 from four starting points
    (benchmarks/QUANTIZED_STATES.md, "4-bit states on Rosenbrock").
    """
    mags = [2.0**-k for k in range(2 ** (bits - 1) - 1)]
    return np.sort(np.asarray([0.0, 0.75] + mags + [-m for m in mags], np.float32))


@dataclasses.dataclass(frozen=True)
class _Codec:
    """How one moment of one format is quantized.

    ``kind`` names the code map: ``"dynamic"`` (`dynamic_map`, with
    ``signed`` and ``exponent_bits``), ``"pow2"`` (`pow2_map`), ``"linear"``
    (`linear_map_without_zero`) or ``"float8"`` (``float8_e4m3fn``
    numbers scaled so the block absmax is 448).
    """

    kind: Literal["dynamic", "pow2", "linear", "float8"]
    bits: int
    sqrt: bool = False  # store sqrt(x) (second moments): half the dynamic range
    signed: bool = True
    exponent_bits: int = 7

    @property
    def table(self) -> np.ndarray | None:
        """The sorted code values in [-1, 1] (None for float8), built once."""
        return _table(self.kind, self.bits, self.signed, self.exponent_bits)

    def quantize(
        self, blocks: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """float32 ``(..., n_blocks, block)`` -> (codes, absmax ``(..., n_blocks)``).

        The absmax is taken over the finite values only and an all-zero block
        gets absmax 0 (decoded as zeros): an inf or NaN in one element can
        neither make the scale non-finite nor wipe out the other elements of
        the block. An infinite element is stored as the block's extreme code,
        a NaN as the code nearest 0.

        ``key`` (a ``uint32`` scalar): round each value stochastically to one
        of the two codes around it, the upper one with probability equal to
        the value's distance from the lower one over the gap, so the decoded
        value is unbiased (`amp_jax.optim._rounding.uniform_bits`); a second
        moment (``sqrt``) measures the distances between square roots of the
        stored ``sqrt(x)``, so that ``x**(1/4)`` is unbiased (`_toward`).
        ``None``: to the nearest code (ties to the lower one).
        """
        if self.sqrt:  # max(sqrt(x)) = sqrt(max(x)): sqrt rounds monotonically
            usable = (blocks >= 0) & (blocks < jnp.inf)
            absmax = jnp.sqrt(_block_max(jnp.where(usable, blocks, 0.0)))
            blocks = jnp.sqrt(blocks)
        else:
            absmax = _block_max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), 0.0))
        safe = jnp.where(absmax > 0, absmax, 1.0)[..., None]
        norm = jnp.clip(blocks / safe, -1.0, 1.0)
        norm = jnp.where(jnp.isnan(norm), 0.0, norm)
        if key is not None:  # nu unbiased in nu**(1/4) (`_toward`), mu in itself
            rand = _rounding.uniform_bits(norm, key ^ _positions(norm.shape))
            up = _toward if self.sqrt else _linear
            return self._quantize_stochastic(norm, _rounding.unit(rand), up), absmax
        if self.kind == "float8":
            return _to_float8(norm * _F8_MAX), absmax
        if self.kind == "linear":  # code c stands for (c + 1) / 2**bits
            n = np.float32(2**self.bits)  # midpoints (i + 1.5) / 2**bits: exact in float32
            codes = jnp.clip(jnp.ceil(norm * n - 1.5), 0, n - 1).astype(jnp.uint8)
        else:
            codes = _nearest(norm, cast(np.ndarray, self.table))  # (dynamic, pow2: a table)
        return self._pack(codes), absmax

    def _quantize_stochastic(
        self, norm: jax.Array, u: jax.Array, probability: Callable[..., jax.Array]
    ) -> jax.Array:
        """Codes of ``norm`` in [-1, 1] (a block over its absmax), each the code
        below or above its magnitude, the upper with ``probability(x, lower,
        upper)`` (`_linear`, `_toward`): uniform ``u`` below it."""
        if self.kind == "float8":
            a = jnp.abs(norm) * _F8_MAX
            lo = _to_float8(a, truncate=True).astype(jnp.int32)
            hi = jnp.minimum(lo + 1, 0x7E)  # (0x7F is NaN; |v| <= 448, code 0x7E)
            p = probability(
                a, _from_float8(lo.astype(jnp.uint8)), _from_float8(hi.astype(jnp.uint8))
            )
            sign = (jax.lax.bitcast_convert_type(norm, jnp.uint32) >> 24).astype(jnp.uint8) & 0x80
            return jnp.where(u < p, hi, lo).astype(jnp.uint8) | sign
        if self.kind == "linear":  # code c stands for (c + 1) / 2**bits
            n = np.float32(2**self.bits)
            lo = jnp.clip(jnp.floor(norm * n - 1), 0, n - 1)
            hi = jnp.minimum(lo + 1, n - 1)
            p = probability(norm, (lo + 1) / n, (hi + 1) / n)
            return self._pack(jnp.where(u < p, hi, lo).astype(jnp.uint8))
        table = cast(np.ndarray, self.table)
        return self._pack(_stochastic_neighbour(norm, _nearest(norm, table), table, u, probability))

    def _pack(self, codes: jax.Array) -> jax.Array:
        """4-bit: two codes a byte, the first half of the block in the low nibbles."""
        if self.bits == 4:  # first half of the block in the low nibbles
            half = codes.shape[-1] // 2
            codes = codes[..., :half] | (codes[..., half:] << 4)
        return codes

    def zeros(self, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``quantize(zeros_like(blocks))`` without table lookups (an eager
        gather of a replicated table by sharded indices fails in JAX 0.10)."""
        absmax = jnp.zeros_like(blocks[..., 0])
        if self.kind == "float8":
            return jnp.zeros_like(blocks, dtype=jnp.uint8), absmax
        _, mid = _buckets(cast(np.ndarray, self.table).tobytes())  # (not float8: a table)
        code = int(np.searchsorted(mid, np.float32(0)))
        if self.bits == 4:
            blocks, code = blocks[..., : blocks.shape[-1] // 2], code | code << 4
        return jnp.full_like(blocks, code, dtype=jnp.uint8), absmax

    def dequantize(self, codes: jax.Array, absmax: jax.Array) -> jax.Array:
        """(codes, absmax) -> float32 ``(..., n_blocks, block)``."""
        if self.kind == "float8":
            x = _from_float8(codes) * (absmax / _F8_MAX)[..., None]
        else:
            if self.bits == 4:
                codes = jnp.concatenate([codes & 0xF, codes >> 4], axis=-1)
            if self.kind == "linear":
                x = (codes.astype(jnp.float32) + 1) * np.float32(2.0**-self.bits)
            else:
                x = _lookup(cast(np.ndarray, self.table), codes.astype(jnp.int32))
            x = x * absmax[..., None]
        return x * x if self.sqrt else x


@functools.cache
def _table(kind: str, bits: int, signed: bool, exponent_bits: int) -> np.ndarray | None:
    if kind == "dynamic":
        return dynamic_map(signed, bits=bits, exponent_bits=exponent_bits)
    if kind == "pow2":
        return pow2_map(bits)
    return linear_map_without_zero(bits) if kind == "linear" else None


def _block_max(x: jax.Array) -> jax.Array:
    """``jnp.max(x, axis=-1)`` as elementwise maxima of halves down to 16
    columns, then a reduction of those.

    XLA fuses the halving with the ops that produce ``x`` (the decoded moment,
    Adam's update) into one loop, where a reduction of the whole axis first
    writes ``x`` out: on CPU a float32 temporary the size of the parameter
    (and above 32 MiB of temporaries, glibc maps fresh pages for them in every
    step, so each page faults again). The maximum is exact in any order.
    """
    while x.shape[-1] > 16 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = jnp.maximum(x[..., :half], x[..., half:])
    return jnp.max(x, axis=-1)


def _to_float8(v: jax.Array, truncate: bool = False) -> jax.Array:
    """The bits (``uint8``) of ``v.astype(float8_e4m3fn)`` for float32 ``|v| <=
    448`` without NaNs, computed on the bits (round to nearest even): XLA's CPU
    convert into float8 is emulated and about twice as slow. ``truncate``: the
    code toward zero instead (the lower neighbour of ``|v|``)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    sign = (bits >> 24).astype(jnp.uint8) & 0x80
    a = jnp.abs(v)
    ab = jax.lax.bitcast_convert_type(a, jnp.uint32)
    # normal: keep 3 mantissa bits (the 20 dropped ones rounded to nearest
    # even, or dropped) and rebias the exponent from 127 to 7 (|v| < 448 never
    # rounds up past 448)
    if truncate:
        normal = (ab >> 20) - (120 << 3)
        sub = jnp.floor(a * np.float32(512.0)).astype(jnp.uint32)
    else:
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal (below 2**-6): multiples of 2**-9; 2**-6 itself is code 8 either way
        sub = jnp.round(a * np.float32(512.0)).astype(jnp.uint32)
    return jnp.where(a < np.float32(2.0**-6), sub, normal).astype(jnp.uint8) | sign


def _step_keys(count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mu key, nu key) of step ``count`` (the same for every parameter, so a
    layer's moments round alike whether its parameters are stacked or not)."""
    step = _rounding.hash32(count.astype(jnp.uint32) * np.uint32(_tree._GOLDEN))
    return _rounding.hash32(step ^ np.uint32(0x85EBCA6B)), _rounding.hash32(
        step ^ np.uint32(0x27D4EB2F)
    )


def _slow(decay: Any, traced: bool) -> bool:
    """Whether a moment with ``decay`` is rounded stochastically (``decay >
    SLOW_DECAY``); ``traced`` for a decay only known at run time
    (``optax.inject_hyperparams``): the answer for the default decay."""
    try:
        return float(decay) > SLOW_DECAY
    except jax.errors.ConcretizationTypeError:
        return traced


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """``uint32`` salt per element of a block layout ``(..., n_blocks, block)``:
    a hash of its place in its row (block index and offset). The values of a
    block are often close to each other (``nu`` averages ~1000 steps), and a
    hash of the value alone gives most of a block the same random bits, so
    their rounding errors add up instead of cancelling. The place in the row
    is the same for a stacked and a per-layer state and under any sharding
    that keeps whole blocks."""
    n_blocks, block = shape[-2:]
    where = jax.lax.broadcasted_iota(jnp.uint32, (n_blocks, block), 0) * np.uint32(block)
    where = where + jax.lax.broadcasted_iota(jnp.uint32, (n_blocks, block), 1)
    return _rounding.hash32(where * np.uint32(_tree._GOLDEN))


def _toward(x: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The probability of rounding ``x`` in ``[lo, hi]`` (a stored
    ``sqrt(nu)``, scaled) up to ``hi``: unbiased in ``sqrt(x)``, i.e. in
    ``nu**(1/4)``, not in ``x``; 0 where ``hi == lo``.

    Rounded stochastically, a stored ``nu`` is a random walk around float32
    Adam's, spread over about a code's gap (12% of ``nu`` for float8, more for
    4-bit), and the update divides by ``sqrt(nu)``. Unbiased in ``sqrt(nu)``
    (in ``x``, as before), the convexity of ``1 / x`` made float8 and 4-bit
    updates 2.5-3.5% larger than float32 AdamW's. A step unbiased in
    ``nu**a`` moves the walk's mean by ``(1 - a)`` times its variance, which
    for ``a = 1/4`` cancels that convexity in ``nu**(-1/2)`` to first order:
    updates within 1.2% and ``sqrt(nu)`` within 1.6% of float32 AdamW's over
    10,000 steps (benchmarks/LONG_RUN.md)."""
    rx, rlo, rhi = jnp.sqrt(x), jnp.sqrt(lo), jnp.sqrt(hi)
    gap = rhi - rlo
    return jnp.where(gap > 0, (rx - rlo) / jnp.where(gap > 0, gap, 1.0), 0.0)


def _linear(x: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The probability of rounding ``x`` in ``[lo, hi]`` up to ``hi`` unbiased:
    ``(x - lo) / (hi - lo)``, 0 where ``hi == lo``."""
    gap = hi - lo
    return jnp.where(gap > 0, (x - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)


def _stochastic_neighbour(
    norm: jax.Array,
    nearest: jax.Array,
    table: np.ndarray,
    u: jax.Array,
    probability: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] = _linear,
) -> jax.Array:
    """Of the two codes of the sorted ``table`` around ``norm`` (``nearest`` is
    one of them), the upper with ``probability(norm, lower, upper)`` (default:
    unbiased, ``(norm - lower) / (upper - lower)``): uniform ``u`` below it.
    Values beyond the table's ends keep the end code."""
    c = nearest.astype(jnp.int32)
    tc = _lookup(table, c)
    below = tc > norm  # the nearest code is the upper one
    other = jnp.clip(jnp.where(below, c - 1, c + 1), 0, table.size - 1)
    to = _lookup(table, other)
    lo, hi = jnp.where(below, other, c), jnp.where(below, c, other)
    t_lo, t_hi = jnp.where(below, to, tc), jnp.where(below, tc, to)
    return jnp.where(u < probability(norm, t_lo, t_hi), hi, lo).astype(jnp.uint8)


def _from_float8(codes: jax.Array) -> jax.Array:
    """``codes.astype(float32)`` for ``float8_e4m3fn`` codes (or their bits, ``uint8``)."""
    b = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.uint32)
    m = b & 0x7F
    normal = jax.lax.bitcast_convert_type((m + (120 << 3)) << 20, jnp.float32)
    x = jnp.where(m >= 8, normal, m.astype(jnp.float32) * np.float32(2.0**-9))
    x = jnp.where(m == 0x7F, np.float32(np.nan), x)
    return jnp.where(b >= 0x80, -x, x)


_BUCKET_MANTISSA_BITS = 7  # buckets of 2**-7 relative width: at most one midpoint each


def _key(x: jax.Array | np.ndarray, xp: Any = jnp) -> Any:
    """float32 -> uint32 with the order of the floats (negatives reversed)."""
    i = x.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.int32)
    u = i.view(np.uint32) if xp is np else jax.lax.bitcast_convert_type(i, jnp.uint32)
    flip = (i >> 31).astype(xp.uint32) | xp.uint32(0x80000000)
    return u ^ flip


@functools.cache
def _buckets(table_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(first code of each float32 bucket, midpoints + inf) for a sorted table.

    A bucket is a run of floats sharing the top ``9 + 7`` bits of their
    ordered key (sign, exponent, 7 mantissa bits). Each holds at most one
    midpoint between neighbouring codes (checked here), so the nearest code
    of ``x`` is ``first[bucket] + (x > mid[first[bucket]])``: two table
    lookups instead of a binary search.
    """
    table = np.frombuffer(table_bytes, np.float32)
    mid = ((table[:-1].astype(np.float64) + table[1:]) / 2).astype(np.float32)
    shift = 23 - _BUCKET_MANTISSA_BITS
    n = 1 << (32 - shift)
    lo_keys = np.arange(n, dtype=np.uint64) << shift
    # invert the key: floats at the low edge of every bucket
    u = lo_keys.astype(np.uint32)
    neg = u < np.uint32(0x80000000)
    bits = np.where(neg, ~u, u ^ np.uint32(0x80000000)).astype(np.uint32)
    lo = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        first = np.searchsorted(mid, np.where(np.isnan(lo), np.inf, lo), side="left")
    counts = np.diff(first)
    assert counts.max(initial=0) <= 1, "quantization table too fine for the buckets"
    return first.astype(np.uint8), np.append(mid, np.float32(np.inf)).astype(np.float32)


def _lookup(table: np.ndarray, index: jax.Array) -> jax.Array:
    """``table[index]``, sharded like ``index`` (plain indexing of a replicated
    table by indices sharded over an explicit mesh axis fails)."""
    return jnp.asarray(table).at[index].get(out_sharding=jax.typeof(index).sharding)


def _nearest(norm: jax.Array, table: np.ndarray) -> jax.Array:
    """uint8 index of the value of ``table`` nearest each element of ``norm``
    (ties to the lower one): ``searchsorted(midpoints, norm)`` without a loop."""
    first, mid = _buckets(table.tobytes())
    bucket = (_key(norm) >> (23 - _BUCKET_MANTISSA_BITS)).astype(jnp.int32)
    code = _lookup(first, bucket)
    up = norm > _lookup(mid, code.astype(jnp.int32))
    return code + up.astype(jnp.uint8)


def _codecs(fmt: str) -> tuple[_Codec, _Codec]:
    """(first-moment codec, second-moment codec) of a format."""
    if fmt == "8bit":
        return _Codec("dynamic", 8), _Codec("dynamic", 8, sqrt=True, signed=False)
    if fmt == "4bit":
        return _Codec("pow2", 4), _Codec("linear", 4, sqrt=True)
    return _Codec("float8", 8), _Codec("float8", 8, sqrt=True)


class QuantizedArray(NamedTuple):
    """A block-wise quantized float32 array (one Adam moment of one parameter).

    Attributes:
      codes: ``uint8``, shape ``(..., n_blocks, block)`` (4-bit: ``block //
        2``) for a parameter of shape ``(..., n)``; each row is padded to
        ``n_blocks * block`` elements. 8-bit: one table index per element;
        4-bit: two, the first half of the block in the low nibbles; float8:
        the bits of a ``float8_e4m3fn`` per element
        (``jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)`` reads them).
      absmax: ``float32`` ``(..., n_blocks)``, the largest finite magnitude of
        each block (the value code 1.0 stands for).
    """

    codes: jax.Array
    absmax: jax.Array


class ScaleByQuantizedAdamState(NamedTuple):
    """State of [`scale_by_quantized_adam`][amp_jax.optim.scale_by_quantized_adam].

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


def block_layout(shape: tuple[int, ...], block_size: int, bits: int) -> tuple[int, int]:
    """(block, n_blocks) of a parameter of ``shape``: blocks of ``block_size``
    along the last axis, shorter (the whole row, made even for 4-bit) when the
    row is shorter than a block."""
    n = shape[-1] if shape else 1
    block = min(block_size, n + n % 2 if bits == 4 else n)
    return block, -(-n // block)


def _to_blocks(x: jax.Array, block: int, n_blocks: int) -> jax.Array:
    x = x.reshape(x.shape or (1,))
    pad = n_blocks * block - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (n_blocks, block))


def _from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    flat = blocks.reshape(blocks.shape[:-2] + (-1,))
    n = shape[-1] if shape else 1
    return flat[..., :n].reshape(shape)


def quantize(x: jax.Array, codec: _Codec, block_size: int) -> QuantizedArray:
    """``x`` (any float dtype) as a [`QuantizedArray`][amp_jax.optim.QuantizedArray]."""
    block, n_blocks = block_layout(x.shape, block_size, codec.bits)
    return QuantizedArray(*codec.quantize(_to_blocks(x.astype(jnp.float32), block, n_blocks)))


def quantized_zeros(like: jax.Array, codec: _Codec, block_size: int) -> QuantizedArray:
    """``quantize(zeros_like(like))``, laid out (and sharded) like ``like``."""
    block, n_blocks = block_layout(like.shape, block_size, codec.bits)
    blocks = _to_blocks(jnp.zeros_like(like, dtype=jnp.float32), block, n_blocks)
    return QuantizedArray(*codec.zeros(blocks))


def dequantize(q: QuantizedArray, codec: _Codec, shape: tuple[int, ...]) -> jax.Array:
    """The float32 array of ``shape`` a [`QuantizedArray`][amp_jax.optim.QuantizedArray] stands for."""
    return _from_blocks(codec.dequantize(q.codes, q.absmax), shape)


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
            "scale_by_quantized_adam: `quantize_mask` must be a pytree of bools shaped like "
            f"the parameters (or a function of the parameters returning one); {e}"
        ) from e
    return [bool(f) for f in flags]


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
    codecs = _codecs(state_format)

    def init_fn(params):
        return _init_state(params, codecs, block_size, min_quantized_size, quantize_mask)

    def update_fn(updates, state, params=None):
        del params
        count_inc, bc1, bc2 = _tree.adam_counts(state.count, b1, b2)
        adam = functools.partial(_adam, b1=b1, b2=b2, eps=eps, eps_root=eps_root, bc1=bc1, bc2=bc2)
        keys = rounding_keys(count_inc, b1, b2, state_rounding)
        one = functools.partial(
            _update_moments, adam=adam, codecs=codecs, keys=keys, block_size=block_size
        )
        new_updates, mu, nu = _tree.map_unzip(
            one, 3, updates, state.mu, state.nu, is_leaf=lambda x: x is None
        )
        return new_updates, ScaleByQuantizedAdamState(count_inc, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


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


def _init_state(
    params: Any,
    codecs: tuple[_Codec, _Codec],
    block_size: int,
    min_quantized_size: int,
    quantize_mask: Any,
) -> ScaleByQuantizedAdamState:
    """Zero moments: quantized for the chosen float parameters, full precision otherwise."""
    mu_codec, nu_codec = codecs
    treedef: PyTreeDef
    leaves, treedef = jax.tree.flatten(params)
    chosen = _selection(quantize_mask, params)
    mu: list[QuantizedArray | jax.Array]
    nu: list[QuantizedArray | jax.Array]
    mu, nu = [], []
    for p, q in zip(leaves, chosen):
        # zeros_like: the moments take the parameter's sharding; one buffer
        # each (a shared one could not be donated twice). Complex
        # parameters keep complex moments (nu's imaginary part stays 0).
        full = jnp.promote_types(p.dtype, jnp.complex64) if jnp.iscomplexobj(p) else jnp.float32
        zero = lambda: jnp.zeros_like(p, dtype=full)  # noqa: E731
        if q and _tree.is_float(p) and p.size >= min_quantized_size:
            mu.append(quantized_zeros(p, mu_codec, block_size))
            nu.append(quantized_zeros(p, nu_codec, block_size))
        else:
            mu.append(zero())
            nu.append(zero())
    return ScaleByQuantizedAdamState(
        jnp.zeros([], jnp.int32), treedef.unflatten(mu), treedef.unflatten(nu)
    )


def _adam(g32, m32, v32, *, b1, b2, eps, eps_root, bc1, bc2):
    """Adam's step on full-precision moments: ``(update, new mu, new nu)``."""
    m_new = (1 - b1) * g32 + b1 * m32
    v_new = (1 - b2) * _tree.abs_sq(g32) + b2 * v32
    u = (m_new / bc1.astype(m_new.dtype)) / (
        jnp.sqrt(v_new / bc2.astype(v_new.dtype) + eps_root) + eps
    )
    return u, m_new, v_new


def rounding_keys(count: jax.Array, b1: Any, b2: Any, state_rounding: str) -> tuple:
    """Per moment (mu, nu): the step's key when it is rounded stochastically, else None."""
    if state_rounding != "stochastic":
        return (None, None)
    return tuple(
        k if _slow(b, slow) else None
        for k, b, slow in zip(_step_keys(count), (b1, b2), (False, True))
    )


def _update_moments(g, m, v, *, adam, codecs, keys, block_size):
    """``(update, new m, new v)`` of one parameter leaf, its moments quantized or not."""
    if g is None:
        return None, m, v
    if not isinstance(m, QuantizedArray):
        g32 = g.astype(_tree.work_dtype(g.dtype))
        u, m_new, v_new = adam(g32, m, v)
        return u.astype(g.dtype), m_new.astype(m.dtype), v_new.astype(v.dtype)
    # The arithmetic runs in the codes' block layout: one shape in every
    # fused loop (mixing it with the parameter's shape costs index
    # arithmetic per element), the new moments quantized in place.
    # float32 arithmetic, whatever the parameter's dtype (float64 under
    # x64 included): the codes hold far less than float32's precision
    mu_codec, nu_codec = codecs
    g32 = g.astype(jnp.float32)
    block, n_blocks = block_layout(g.shape, block_size, mu_codec.bits)
    u, m_new, v_new = adam(
        _to_blocks(g32, block, n_blocks),
        mu_codec.dequantize(m.codes, m.absmax),
        nu_codec.dequantize(v.codes, v.absmax),
    )
    n = g.shape[-1] if g.shape else 1
    if n_blocks * block > n:  # the padding quantizes zeros, as in `quantize`
        real = _to_blocks(jnp.ones(n, bool), block, n_blocks)
        m_new, v_new = jnp.where(real, m_new, 0.0), jnp.where(real, v_new, 0.0)
    m_q, v_q = mu_codec.quantize(m_new, keys[0]), nu_codec.quantize(v_new, keys[1])
    u = _from_blocks(u, g.shape).astype(g.dtype)  # (the gradients' dtype, as optax)
    return u, QuantizedArray(*m_q), QuantizedArray(*v_q)
