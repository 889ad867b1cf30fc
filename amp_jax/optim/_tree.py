"""Private tree helpers: locating wrapper states and measuring state memory."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

T = TypeVar("T")


def is_float(x: Any) -> bool:
    """Whether ``x`` is an array (or array-like) with a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def work_dtype(dtype: Any) -> Any:
    """The dtype used for the arithmetic on a ``dtype`` leaf: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def abs_sq(x: Any) -> Any:
    """``|x|**2``: real for complex ``x`` (optax's second moment), ``x * x`` otherwise."""
    return jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x


def update_dtype(grad: Any, param: Any) -> Any:
    """The dtype of the update a parameter-rounding wrapper returns: the
    gradient's, as optax's transformations do.

    optax's wrappers rely on it: ``apply_if_finite``'s skip branch is
    ``zeros_like(grads)``, so float32 gradients of bfloat16 parameters need
    float32 updates (which land the parameter exactly where the wrapper
    meant it to)."""
    del param
    return jnp.dtype(grad.dtype)


def cast_like_grads(updates: Any, grads: Any) -> Any:
    """``updates`` with every floating leaf cast to its gradient's dtype."""

    def one(u, g):
        return u.astype(g.dtype) if is_float(u) and is_float(g) else u

    return jax.tree.map(one, updates, grads, is_leaf=lambda x: x is None)


def adam_counts(count: Any, b1: float, b2: float) -> tuple[Any, Any, Any]:
    """Adam's next step count and its two bias corrections ``1 - b**count``."""
    count_inc = optax.safe_increment(count)
    return count_inc, 1 - b1**count_inc, 1 - b2**count_inc


def map_unzip(fn: Any, n: int, tree: Any, *rest: Any, is_leaf: Any = None) -> tuple[Any, ...]:
    """Map ``fn`` over the leaves of ``tree`` (and the matching subtrees of
    ``rest``) where ``fn`` returns ``n`` values; return ``n`` trees shaped like
    ``tree``.

    ``jax.tree.map`` with a tuple-valued function gives one tree of tuples; the
    optimizers need the tuple of trees (updates, new state...). The trees in
    ``rest`` are flattened up to ``tree``'s leaves, so they may hold subtrees
    (``optax.MaskedNode``) where ``tree`` has a leaf.
    """
    flat, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    others = [treedef.flatten_up_to(r) for r in rest]
    outs = [fn(*xs) for xs in zip(flat, *others)]
    return tuple(treedef.unflatten([o[i] for o in outs]) for i in range(n))


def find_states(tree: Any, cls: type[T] | tuple[type, ...]) -> list[tuple[str, T]]:
    """All instances of ``cls`` inside ``tree``, with their key paths.

    Walks every pytree node (tuples, NamedTuples, lists, dicts, registered
    dataclasses, ...) and also looks inside the found states, so nested wrappers
    of the same kind are all reported.
    """
    found: list[tuple[str, T]] = []

    def visit(node: Any, prefix: str) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: isinstance(x, cls))[0]
        for path, leaf in leaves:
            if isinstance(leaf, cls):
                where = prefix + jax.tree_util.keystr(path)
                found.append((where or "<root>", leaf))
                # Search the fields of the found state (not the state itself again).
                for i, child in enumerate(tuple(leaf)):
                    visit(child, f"{where}[{i}]")

    if isinstance(tree, cls):
        found.append(("<root>", tree))
        for i, child in enumerate(tuple(tree)):
            visit(child, f"[{i}]")
    else:
        visit(tree, "")
    return found


def find_one(tree: Any, cls: type[T] | tuple[type, ...], *, caller: str, fix: str) -> T:
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


def state_bytes(tree: Any) -> int:
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


def float_dtype(value, argname: str, fix: str = ""):
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


_GOLDEN = 0x9E3779B9


def _has_raw_keys(node: Any) -> bool:
    return (
        isinstance(node, tuple)
        and hasattr(type(node), "_fields")
        and bool(getattr(type(node), "raw_key_fields", ()))
    )


def salt_keys(state: Any, salt: Any) -> Any:
    """Gives a copy of an optimizer state its own random keys.

    ``salt`` (a uint32 scalar, or an array whose leading axes are the copies,
    e.g. ``arange(num_layers) + 1``) is mixed (XOR with ``salt * golden``) into

    * every typed PRNG key leaf (``jax.random.key``: ``optax.add_noise``, ...),
      found by dtype, and
    * the fields named by ``type(node).raw_key_fields`` of every NamedTuple state
      node that declares it: the protocol for states that store raw ``uint32``
      key data (``StochasticRoundingState.raw_key_fields == ("key",)``). A
      custom optimizer whose state holds raw key data opts in the same way.

    Everything else is returned unchanged. Deterministic: the same state and
    salt give the same keys; different salts give different keys.
    """

    def xor(data):
        s = jnp.asarray(salt, jnp.uint32)
        s = s.reshape(s.shape + (1,) * (data.ndim - s.ndim))
        return (data ^ (s * jnp.uint32(_GOLDEN))).astype(data.dtype)

    def fix(node):
        if _has_raw_keys(node):
            names = type(node).raw_key_fields
            return type(node)(
                *(xor(v) if f in names else salt_keys(v, salt) for f, v in zip(node._fields, node))
            )
        if isinstance(node, jax.Array) and jnp.issubdtype(node.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                xor(jax.random.key_data(node)), impl=jax.random.key_impl(node)
            )
        return node

    return jax.tree.map(fix, state, is_leaf=_has_raw_keys)
