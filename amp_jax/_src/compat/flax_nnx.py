"""Flax NNX's graph nodes across versions: how a node's attributes are read
(wrapped in ``DataElem``/``StaticElem`` from Flax 0.12.8, plain before)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def nnx_set_key(nnx: Any, impl: Any, node: object, key: Any, old: object, new: object) -> None:
    """Sets the attribute ``key`` of the Flax NNX graph node ``node`` to ``new``
    (``old`` the value it holds). Flax 0.12.2 assigns a Variable onto a
    Variable attribute by value (the old object stays, with the new value):
    there the old one is removed first, so that the attribute holds ``new``."""
    if (
        getattr(nnx.graph, "DataElem", None) is None
        and isinstance(old, nnx.Variable)
        and isinstance(new, nnx.Variable)
    ):
        impl.pop_key(node, key)
    impl.set_key(node, key, new)


def nnx_node_items(nnx: Any, impl: Any, node: object) -> list[tuple[Any, Any, bool]]:
    """``(key, value, is_data)`` for each attribute of the Flax NNX graph node
    ``node`` (``impl``: its ``nnx.graph.get_node_impl``). Flax 0.12.8 and newer
    wrap each in ``graph.DataElem``/``StaticElem``; older ones (0.12.2) give
    the plain value, and the node's ``_pytree__nodes`` entry (an item too)
    says which attributes are data."""
    items, _ = impl.flatten(node)
    data_elem = getattr(nnx.graph, "DataElem", None)
    if data_elem is None:
        return [(key, value, False) for key, value in items]
    wrapped = (data_elem, nnx.graph.StaticElem)
    return [
        (key, elem.value if isinstance(elem, wrapped) else elem, isinstance(elem, data_elem))
        for key, elem in items
    ]


@functools.cache
def hijax_writable_under_jit(nnx: Any) -> bool:
    """Whether this Flax lets a function traced by JAX (``jax.jit``, amp) write
    a plain (``ref=False``) hijax ``Variable`` it is given: Flax 0.12.8 does,
    newer Flax refuses it (``ImmutableVariableError``: only ``ref=True``).
    Asked of Flax itself, once: a trace of such a write."""

    def write(v: Any) -> None:
        v[...] = 1.0

    try:
        jax.make_jaxpr(write)(nnx.with_vars(nnx.Variable(jnp.zeros(())), hijax=True))
    except Exception:  # (ImmutableVariableError; a Flax without hijax; whatever it raises)
        return False
    return True
