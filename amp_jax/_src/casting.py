"""The one casting rule of amp: a managed float is read in the compute dtype
only if it is wider; float32 ("high") reads are always float32.

Everything that casts an operand (the interpreter's reads, the allow-op
rules, the float8 rule, the custom JVP rules) goes through these helpers.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.decision import Color
from amp_jax._src.policy import HIGH_DTYPE, is_managed_float


def dtype_of(atom: compat.Atom) -> Any:
    """The dtype of a jaxpr variable or literal (None for tokens and the like)."""
    return getattr(atom.aval, "dtype", None)


def narrowed(dtype: DTypeLike, compute_dtype: np.dtype) -> np.dtype:
    """``dtype`` read in ``compute_dtype``: the narrower of the two (a
    float16 value under a bfloat16 policy stays float16)."""
    dtype = np.dtype(dtype)
    return compute_dtype if dtype.itemsize > np.dtype(compute_dtype).itemsize else dtype


def target(dtype: DTypeLike | None, color: Color, compute_dtype: np.dtype) -> np.dtype | None:
    """The dtype an operand of dtype ``dtype`` is read as by an eqn painted
    ``color``; None for values amp does not manage (ints, float64, ...)."""
    if not is_managed_float(dtype):
        return None
    if color is Color.LOW:
        return narrowed(dtype, compute_dtype)
    if color is Color.HIGH:
        return HIGH_DTYPE
    return np.dtype(dtype)


def cast(x: jax.Array, dtype: DTypeLike | None) -> jax.Array:
    """``x`` as ``dtype`` (no convert when it already is; None: as it is)."""
    if dtype is None or np.dtype(x.dtype) == np.dtype(dtype):
        return x
    return lax.convert_element_type(x, dtype)


def lower(x: jax.Array, compute_dtype: np.dtype) -> jax.Array:
    """``x`` read in the compute dtype if it is a managed float (else as it is)."""
    return cast(x, target(getattr(x, "dtype", None), Color.LOW, compute_dtype))
