"""Private tree helpers: locating wrapper states and measuring state memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike, DTypeLike

from amp_jax._src.compat import PyTreeDef
from amp_jax._src.optstate import GOLDEN
from amp_jax._src.optstate import find_states as find_states
from amp_jax._src.optstate import salt_keys as salt_keys

#: an optimizer state class: a NamedTuple
S = TypeVar("S", bound=tuple[Any, ...])
S2 = TypeVar("S2", bound=tuple[Any, ...])
_GOLDEN = GOLDEN  # (the multiplier _quantized.py mixes its step counts with)


def is_float(x: object) -> bool:
    """Whether ``x`` is an array (or array-like) with a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def work_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype used for the arithmetic on a ``dtype`` leaf: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def abs_sq(x: jax.Array) -> jax.Array:
    """``|x|**2``: real for complex ``x`` (optax's second moment), ``x * x`` otherwise."""
    return jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x


def update_dtype(grad: jax.Array, param: ArrayLike) -> np.dtype:
    """The dtype of the update a parameter-rounding wrapper returns: the
    gradient's, as optax's transformations do.

    optax's wrappers rely on it: ``apply_if_finite``'s skip branch is
    ``zeros_like(grads)``, so float32 gradients of bfloat16 parameters need
    float32 updates (which land the parameter exactly where the wrapper
    meant it to)."""
    del param
    return jnp.dtype(grad.dtype)


def cast_like_grads(updates: optax.Updates, grads: optax.Updates) -> optax.Updates:
    """``updates`` with every floating leaf cast to its gradient's dtype."""

    def one(u: Any, g: Any) -> Any:
        return u.astype(g.dtype) if is_float(u) and is_float(g) else u

    return jax.tree.map(one, updates, grads, is_leaf=lambda x: x is None)


def adam_counts(count: jax.Array, b1: float, b2: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adam's next step count and its two bias corrections ``1 - b**count``."""
    count_inc = optax.safe_increment(count)
    return count_inc, 1 - b1**count_inc, 1 - b2**count_inc


def map_unzip(
    fn: Callable[..., tuple[Any, ...]],
    n: int,
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
) -> tuple[Any, ...]:
    """Map ``fn`` over the leaves of ``tree`` (and the matching subtrees of
    ``rest``) where ``fn`` returns ``n`` values; return ``n`` trees shaped like
    ``tree``.

    ``jax.tree.map`` with a tuple-valued function gives one tree of tuples; the
    optimizers need the tuple of trees (updates, new state...). The trees in
    ``rest`` are flattened up to ``tree``'s leaves, so they may hold subtrees
    (``optax.MaskedNode``) where ``tree`` has a leaf.
    """
    treedef: PyTreeDef
    flat, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    others = [treedef.flatten_up_to(r) for r in rest]
    outs = [fn(*xs) for xs in zip(flat, *others)]
    return tuple(treedef.unflatten([o[i] for o in outs]) for i in range(n))


@overload
def find_one(tree: object, cls: type[S], *, caller: str, fix: str) -> S: ...
@overload
def find_one(tree: object, cls: tuple[type[S], type[S2]], *, caller: str, fix: str) -> S | S2: ...


def find_one(tree: object, cls: type[Any] | tuple[type[Any], ...], *, caller: str, fix: str) -> Any:
    """The single instance of ``cls`` in ``tree``; ValueError otherwise."""
    found = find_states(tree, cls)
    names = " or ".join(c.__name__ for c in cls) if isinstance(cls, tuple) else cls.__name__
    if not found:
        raise ValueError(
            f"{caller}: no {names} found in the optimizer state passed as "
            f"`opt_state` (got a {type(tree).__name__}). {fix}"
        )
    if len(found) > 1:
        paths = ", ".join(p for p, _ in found)
        raise ValueError(
            f"{caller}: found {len(found)} {names} instances in `opt_state` (at "
            f"{paths}); expected exactly one. Use a single wrapper, or pass the "
            "sub-state you mean (for example `opt_state[0]`)."
        )
    return found[0][1]


def state_bytes(tree: object) -> int:
    """Total number of bytes held by the array leaves of a pytree.

    Works on concrete arrays (``jax.Array``, ``numpy.ndarray``, numpy scalars)
    and on abstract ones (``jax.ShapeDtypeStruct``, e.g. from
    ``jax.eval_shape``), so the memory of an optimizer state can be measured
    without allocating it. Python scalars and ``None`` count as zero bytes:
    they are not stored on the device.

    Args:
      tree: any pytree, typically an optimizer state, parameters or gradients.

    Returns:
      The sum over leaves of ``size * dtype.itemsize``, as a Python ``int``.
      Typed PRNG key arrays count the bytes of their key data.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from amp_jax.optim import state_bytes
      >>> state_bytes({"w": jnp.zeros((3, 4), jnp.bfloat16), "n": jnp.int32(0)})
      28
      >>> state_bytes(jax.ShapeDtypeStruct((10,), jnp.float32))
      40

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018,
      https://arxiv.org/abs/1710.03740 (memory accounting of master weights).
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        shape = getattr(leaf, "shape", None)
        if dtype is None or shape is None:
            continue
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            # (the bytes of a key depend on its PRNG implementation)
            data = jax.eval_shape(jax.random.key_data, leaf)
            total += int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
            continue
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return total


def float_dtype(value: DTypeLike, argname: str, fix: str = "") -> np.dtype:
    """``value`` as a floating numpy dtype, or a ValueError naming ``argname``."""
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`{argname}`={value!r} is not a dtype; it must be a "
            f"floating dtype (jnp.float32, jnp.bfloat16...){fix}."
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"`{argname}` must be a floating dtype, got {value!r}{fix}.")
    return jnp.dtype(value)
