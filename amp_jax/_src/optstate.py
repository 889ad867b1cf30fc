"""Optimizer-state helpers shared by ``amp_jax.optim`` and ``amp_jax.eager``:
finding wrapper states in a state tree, giving copies of a state their own
random keys, and the check that an argument is an optax transformation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

if TYPE_CHECKING:
    import optax

T = TypeVar("T")
#: an optimizer state class: a NamedTuple
S = TypeVar("S", bound=tuple[Any, ...])


def transformation(
    value: object, caller: str, argname: str = "inner"
) -> optax.GradientTransformation:
    """``value`` if it is an optax GradientTransformation (has init and update)."""
    if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
        return value
    if callable(value):
        name = getattr(value, "__name__", repr(value))
        raise TypeError(
            f"{caller}: `{argname}` must be an optax GradientTransformation, got "
            f"the function {name!r}; call it to make one: pass e.g. "
            f"optax.adam(1e-3), not optax.adam."
        )
    raise TypeError(
        f"{caller}: `{argname}` must be an optax GradientTransformation (an "
        f"object with init and update), got {type(value).__name__}: {value!r}."
    )


def find_states(tree: object, cls: type[S] | tuple[type[S], ...]) -> list[tuple[str, S]]:
    """All instances of ``cls`` inside ``tree``, with their key paths.

    Walks every pytree node (tuples, NamedTuples, lists, dicts, registered
    dataclasses, ...) and also looks inside the found states, so nested wrappers
    of the same kind are all reported.
    """
    found: list[tuple[str, S]] = []

    def visit(node: object, prefix: str) -> None:
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


GOLDEN = 0x9E3779B9


def _has_raw_keys(node: object) -> bool:
    return (
        isinstance(node, tuple)
        and hasattr(type(node), "_fields")
        and bool(getattr(type(node), "raw_key_fields", ()))
    )


def salt_keys(state: T, salt: ArrayLike) -> T:
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

    def xor(data: jax.Array) -> jax.Array:
        s = jnp.asarray(salt, jnp.uint32)
        s = s.reshape(s.shape + (1,) * (data.ndim - s.ndim))
        return (data ^ (s * jnp.uint32(GOLDEN))).astype(data.dtype)

    def fix(node: Any) -> Any:  # a pytree node or leaf
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
