"""Block-wise quantization codes of optimizer moments: 8-bit, 4-bit and float8.

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
converted whole per layer). `amp_jax.optim._storage` stores moments with them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax.optim import _rounding, _tree

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
    (benchmarks/results/QUANTIZED_STATES.md, "4-bit states on Rosenbrock").
    """
    mags = [2.0**-k for k in range(2 ** (bits - 1) - 1)]
    return np.sort(np.asarray([0.0, 0.75] + mags + [-m for m in mags], np.float32))


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one moment of one format is quantized (`codecs`).

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
    10,000 steps (benchmarks/results/LONG_RUN.md)."""
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


def codecs(fmt: str) -> tuple[Codec, Codec]:
    """(first-moment codec, second-moment codec) of a format."""
    if fmt == "8bit":
        return Codec("dynamic", 8), Codec("dynamic", 8, sqrt=True, signed=False)
    if fmt == "4bit":
        return Codec("pow2", 4), Codec("linear", 4, sqrt=True)
    return Codec("float8", 8), Codec("float8", 8, sqrt=True)


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


def block_layout(shape: tuple[int, ...], block_size: int, bits: int) -> tuple[int, int]:
    """(block, n_blocks) of a parameter of ``shape``: blocks of ``block_size``
    along the last axis, shorter (the whole row, made even for 4-bit) when the
    row is shorter than a block."""
    n = shape[-1] if shape else 1
    block = min(block_size, n + n % 2 if bits == 4 else n)
    return block, -(-n // block)


def to_blocks(x: jax.Array, block: int, n_blocks: int) -> jax.Array:
    x = x.reshape(x.shape or (1,))
    pad = n_blocks * block - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (n_blocks, block))


def from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    flat = blocks.reshape(blocks.shape[:-2] + (-1,))
    n = shape[-1] if shape else 1
    return flat[..., :n].reshape(shape)


def quantize(x: jax.Array, codec: Codec, block_size: int) -> QuantizedArray:
    """``x`` (any float dtype) as a [`QuantizedArray`][amp_jax.optim.QuantizedArray]."""
    block, n_blocks = block_layout(x.shape, block_size, codec.bits)
    return QuantizedArray(*codec.quantize(to_blocks(x.astype(jnp.float32), block, n_blocks)))


def quantized_zeros(like: jax.Array, codec: Codec, block_size: int) -> QuantizedArray:
    """``quantize(zeros_like(like))``, laid out (and sharded) like ``like``."""
    block, n_blocks = block_layout(like.shape, block_size, codec.bits)
    blocks = to_blocks(jnp.zeros_like(like, dtype=jnp.float32), block, n_blocks)
    return QuantizedArray(*codec.zeros(blocks))


def dequantize(q: QuantizedArray, codec: Codec, shape: tuple[int, ...]) -> jax.Array:
    """The float32 array of ``shape`` a [`QuantizedArray`][amp_jax.optim.QuantizedArray] stands for."""
    return from_blocks(codec.dequantize(q.codes, q.absmax), shape)
