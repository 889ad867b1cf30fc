"""Rounding that the compiler keeps.

XLA may keep bfloat16/float16 intermediates in float32 ("excess precision",
``--xla_allow_excess_precision``, on by default on GPU) and then removes a
``float32 -> bfloat16 -> float32`` convert pair as a no-op. An algorithm
that *measures* a rounding error (Kahan summation, stochastic rounding)
would then measure zero. `round_nearest` rounds with
``lax.reduce_precision``, XLA's explicit rounding op, which no pass may drop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def round_nearest(x: jax.Array, dtype: Any) -> jax.Array:
    """``x.astype(dtype).astype(x.dtype)``, in a form XLA keeps.

    ``x`` is float32 (or wider); the result has ``x``'s dtype and holds the
    value round-to-nearest-even conversion to ``dtype`` gives, subnormals,
    overflow to infinity and NaN included. ``reduce_precision`` flushes values
    below ``dtype``'s smallest normal to zero, so that range (float16's
    subnormals, which float32 represents exactly) is rounded separately to
    multiples of the subnormal spacing.
    """
    dtype = jnp.dtype(dtype)
    fi = jnp.finfo(dtype)
    if jnp.dtype(x.dtype).itemsize <= dtype.itemsize:
        return x
    out = lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if fi.minexp > jnp.finfo(x.dtype).minexp:  # dtype's subnormals are normal in x's dtype
        # Spacing of dtype's subnormals: 2 ** (minexp - nmant) (2**-24 for float16).
        scale = jnp.asarray(2.0 ** (fi.nmant - int(fi.minexp)), x.dtype)
        sub = lax.round(x * scale, lax.RoundingMethod.TO_NEAREST_EVEN) / scale
        out = jnp.where(jnp.abs(x) < jnp.asarray(fi.tiny, x.dtype), sub, out)
    return out


def hash32(x: jax.Array) -> jax.Array:
    """A mixing hash of ``uint32`` values (lowbias32, C. Wellons): every input
    bit flips each output bit with probability close to 1/2."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform_bits(x: jax.Array, key: jax.Array) -> jax.Array:
    """``uint32`` pseudo-random bits per element of float32 ``x``: a hash of
    its top 16 bits (sign, exponent, 7 mantissa bits) and ``key`` (one per
    step and moment, `amp_jax.optim._quantized._step_keys`).

    Element-wise, so it needs no index arrays (they would have to be sharded
    like the state and differ between a stacked and a per-layer state) and
    adds no state. Values within 2**-7 of each other round alike in one step
    (the quantized states also hash each value's place in its row,
    `amp_jax.optim._quantized._positions`), and a value rounds differently
    from step to step. Without the low bits,
    two programs whose float32 arithmetic differs by an ulp (another fusion,
    ``amp_jax.eager.scan_step`` against the standard step) almost always
    draw the same bits.
    """
    return hash32((jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16) ^ key)


def unit(rand: jax.Array) -> jax.Array:
    """Uniform float32 in [0, 1) from ``uint32`` bits (their top 24)."""
    return (rand >> 8).astype(jnp.float32) * np.float32(2.0**-24)
