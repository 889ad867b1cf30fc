"""The op classes as data: which primitives amp lowers, keeps, follows or never touches.

The classification is plain data (frozensets of primitive names) so that users
can read it, print it, extend it and override it. The five classes follow
TensorFlow's auto-mixed-precision pass:

* ``allow``  -- performance-critical ops (matmuls, convolutions) that run with
  compute-dtype operands and float32 accumulation.
* ``deny``   -- numerically sensitive ops (exp/log/pow, accumulating
  reductions) that always run in float32.
* ``follow`` -- elementwise arithmetic that is fine in low precision but
  should not start a low-precision region on its own ("infer" in TensorFlow).
* ``clear``  -- data movement and comparisons; numerically neutral.
* ``never``  -- ops whose operand dtypes are part of their meaning (user
  casts, bit casts, random bits, custom reductions): never changed.

Primitives absent from every list are treated as ``follow`` (or raise
``NotImplementedError`` with ``strict=True``). Primitives that carry
sub-jaxprs (``jit``, ``cond``, ``while``, ``scan``, ``checkpoint``,
``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ...) need no entry:
they are recursed into and keep their boundary dtypes.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

OP_CLASSES: tuple[str, ...] = ("allow", "deny", "follow", "clear", "never")

#: Matmuls and convolutions: compute-dtype operands, float32 accumulation.
DEFAULT_ALLOW: frozenset[str] = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot_general", "ragged_dot"}
)
"""Matmuls and convolutions: run with compute-dtype operands and float32 accumulation."""

#: Factorizations and solves of lax.linalg: denied, and what they read stays float32.
_FACTORIZATIONS: frozenset[str] = frozenset(
    {
        "cholesky",
        "triangular_solve",
        "lu",
        "qr",
        "svd",
        "eigh",
        "eig",
        "tridiagonal_solve",
        "schur",
        "hessenberg",
    }
)

#: Numerically sensitive: always computed in float32.
DEFAULT_DENY: frozenset[str] = frozenset(
    {
        # exp / log / pow family
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "pow",
        "rsqrt",
        "sinh",
        "cosh",
        "tan",
        "asin",
        "acos",
        "acosh",
        "asinh",
        "atanh",
        "erf_inv",
        "lgamma",
        "digamma",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "random_gamma_grad",
        "polygamma",
        "zeta",
        "bessel_i0e",
        "bessel_i1e",
        "regularized_incomplete_beta",
        # accumulating reductions and scans
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        "reduce_window_sum",
        "psum",
        "psum_invariant",
        "psum2",
        # linear algebra that needs the precision
        *_FACTORIZATIONS,
        "householder_product",
        "fft",
        "tridiagonal",
    }
)
"""Numerically sensitive primitives (exp/log/pow, accumulating reductions, linear algebra): always computed in float32."""

#: Elementwise arithmetic: follows its inputs; low between two allow ops.
DEFAULT_FOLLOW: frozenset[str] = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "neg",
        "abs",
        "sign",
        "integer_pow",
        "square",
        "sqrt",
        "cbrt",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sin",
        "cos",
        "atan",
        "atan2",
        "rem",
        "nextafter",
        "floor",
        "ceil",
        "round",
        "clamp",
        "reduce_window",
        "select_and_scatter_add",
        "select_and_gather_add",
        "scatter_add",
        "scatter_sub",
        "scatter_mul",
        "copysign",
        # JAX's own spellings of the scatter primitives
        "scatter-add",
        "scatter-sub",
        "scatter-mul",
        "select_and_scatter",
    }
)
"""Elementwise arithmetic: follows its inputs; runs low between two allow ops."""

#: Data movement, comparisons, max/min: numerically neutral.
DEFAULT_CLEAR: frozenset[str] = frozenset(
    {
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "concatenate",
        "pad",
        "rev",
        "select_n",
        "copy",
        "copy_p",
        "stop_gradient",
        "max",
        "min",
        "reduce_max",
        "reduce_min",
        "reduce_window_max",
        "reduce_window_min",
        "cummax",
        "cummin",
        "argmax",
        "argmin",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "is_finite",
        "sort",
        "top_k",
        "approx_top_k",
        "sharding_constraint",
        "device_put",
        "scatter_max",
        "scatter_min",
        "pmax",
        "pmin",
        "all_gather",
        "all_to_all",
        "ppermute",
        "psum_scatter",
        "reduce_scatter",
        "optimization_barrier",
        "real",
        "imag",
        "conj",
        "name",
        "pvary",
        "reshard",
        "mesh_cast",
        "all_gather_invariant",
        "axis_index",
        "split",
        "tile",
        "eq_to",
        "le_to",
        "lt_to",
        "scatter-max",
        "scatter-min",
        "ragged_all_to_all",
    }
)
"""Data movement, comparisons, max/min: numerically neutral, follows its inputs."""

#: Operand dtypes are part of the meaning: never changed.
DEFAULT_NEVER: frozenset[str] = frozenset(
    {
        "convert_element_type",
        "bitcast_convert_type",
        "reduce_precision",
        "random_bits",
        "random_seed",
        "random_wrap",
        "random_unwrap",
        "random_fold_in",
        "random_split",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
        "iota",
        "reduce",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "population_count",
        "clz",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "and",
        "or",
        "not",
        "xor",
        "complex",
        "linear_solve",
        "custom_linear_solve",
        # host callbacks see the dtypes the user's code declared
        "pure_callback",
        "io_callback",
        "debug_callback",
        "debug_print",
        "ffi_call",
        "random_gamma",
        "mulhi",
        "create_token",
        "after_all",
    }
)
"""Primitives whose operand dtypes are part of their meaning (casts, bit casts, random bits, custom reductions): never changed."""

#: Factorizations and solves: the contractions whose results they read stay float32.
SOLVES: frozenset[str] = _FACTORIZATIONS | {"custom_linear_solve", "linear_solve"}  # lineax
"""Factorizations and solves: they amplify their input's rounding by the matrix's condition number, so a contraction whose result one reads stays float32."""

#: Follow ops whose result can leave the range of their operands (a power, a
#: reciprocal, a product of two activations); under a compute dtype with
#: float16's range they run in float32 (see `widens_range`).
RANGE_WIDENING: frozenset[str] = frozenset({"integer_pow", "square", "div", "mul"})
"""Follow ops whose result can leave their operands' range: float32 under a compute dtype with float16's small range."""


def has_narrow_range(dtype: DTypeLike) -> bool:
    """True for a compute dtype whose largest finite value is small (float16: 65504)."""
    return float(jnp.finfo(dtype).max) < 1e10


def name_set(value: Iterable[str] | None, argname: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        raise TypeError(
            f"{argname} must be a collection of primitive names, got the string "
            f"{value!r}; wrap it in a tuple: ({value!r},)."
        )
    try:
        names = frozenset(value)
    except TypeError:
        raise TypeError(
            f"{argname}={value!r} must be a collection of primitive names, e.g. ('exp', 'log')."
        ) from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"{argname} must contain primitive names (str), got {n!r}; "
                "use e.g. jax.lax.exp_p.name to get a primitive's name."
            )
        check_spelling(n, argname)
    return names


@functools.lru_cache(maxsize=1)
def _known_primitives() -> frozenset[str]:
    """Names of the primitives JAX exports, and of the default classes."""
    from jax.extend.core import primitives

    names = set().union(DEFAULT_ALLOW, DEFAULT_DENY, DEFAULT_FOLLOW, DEFAULT_CLEAR, DEFAULT_NEVER)
    for module in (primitives, jax.lax):
        for attr in dir(module):
            prim: Any = getattr(module, attr, None)
            if attr.endswith("_p") and isinstance(getattr(prim, "name", None), str):
                names.add(prim.name)
    return frozenset(names)


def _edits(a: str, b: str) -> int:
    """Edit distance counting a swap of two neighbours as one edit (``tahn``/``tanh``)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(
                d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])
            )
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def _nearest(name: str, candidates: list[str]) -> str | None:
    """The candidate fewest edits away (then: same length, then most alike), or
    None when even the nearest needs more than a third of the name changed."""
    if not candidates:
        return None
    key = lambda c: (
        _edits(name, c),
        abs(len(c) - len(name)),
        -difflib.SequenceMatcher(None, name, c).ratio(),
    )
    best = min(candidates, key=key)
    return best if _edits(name, best) <= max(1, len(name) // 3) else None


def check_spelling(name: str, argname: str) -> None:
    """A name JAX does not know but that is close to one it knows is a typo.

    (Names far from every known one are accepted: they may be a library's
    own primitives.)
    """
    known = _known_primitives()
    if name in known:
        return
    close = _nearest(name, difflib.get_close_matches(name, known, n=8, cutoff=0.75))
    if close is not None:
        raise ValueError(
            f"{argname}: {name!r} is not a JAX primitive; did you mean {close!r}? "
            "(amp_jax.get_policy('bfloat16').table() lists the classified ones.)"
        )
