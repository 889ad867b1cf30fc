"""What an amp call returns: ``fn``'s output leaves as arrays or as static values.

A JAX value (an array, a NumPy array or scalar, a token) is returned as an
array, as ``jax.jit`` returns it (`as_output`, `is_output_value`); any other
leaf (a string, a callable, a Python scalar) is carried out of the trace as it
is, as ``eqx.filter_jit`` does (`static_outputs`), bar a plain object that
holds arrays (plain_objects.py). A mutable array (``jax.Ref``), which a jaxpr
cannot return, comes back as the caller's own Ref or a new one (`out_refs`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import jax
import numpy as np

from amp_jax._src import compat
from amp_jax._src.plain_objects import held_array


def as_output(x: object) -> Any:
    """A jaxpr output or returned constant (a literal, a NumPy array) as a jax
    Array, like jit; a token (``jax.lax.create_token()``) as it is, as jit
    returns it."""
    if isinstance(x, (jax.Array, compat.Tracer, compat.Token)):
        return x
    t: type[Any]
    for t in (bool, int, float, complex):  # weakly typed, as jit returns them
        if isinstance(x, t) and not isinstance(x, np.generic):  # (np.float64 is a float)
            return jax.numpy.asarray(t(x))
    dtype = getattr(x, "dtype", None)
    if dtype is not None:  # float64 NumPy as float32 without x64, silently as jit does
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.numpy.asarray(x, dtype=dtype)


def is_output_value(x: object) -> bool:
    """Whether an output leaf of ``fn`` is a JAX value, which amp returns as an
    array as ``jax.jit`` does (a NumPy array or scalar too, as ``eqx.filter_jit``
    returns them), rather than a static value carried out of the trace as it
    is, as ``eqx.filter_jit`` does: a string, a callable, an Equinox model's
    activation function, and a Python ``bool``/``int``/``float``/``complex``
    (it cannot depend on a traced value: ``amp(f)`` returns what ``f`` does)."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, compat.Tracer, compat.Token)):
        return True
    if isinstance(x, (bool, int, float, complex)):
        return False
    try:
        jax.typeof(x)
    except TypeError:
        return False
    return True


def static_outputs(leaves: Sequence[Any], name: str, kept: Collection[int] = ()) -> dict[int, Any]:
    """The static leaves among ``fn``'s output ``leaves`` (`is_output_value`),
    by index; a plain object that holds arrays is refused (the arrays would be
    tracers of amp's trace, invalid once it ends), bar those whose ``id`` is in
    ``kept`` (an NNX module ``fn`` captured: `nnx_nodes.captured_outputs`)."""
    statics = {i: x for i, x in enumerate(leaves) if id(x) in kept or not is_output_value(x)}
    for i, x in statics.items():
        if id(x) not in kept and (held := held_array(x)) is not None:
            kind = type(x).__name__
            raise TypeError(
                f"amp({name}): output leaf {i} is a {kind} that holds arrays "
                f"(`{held}`) but is not a pytree: amp returns a non-array output as a "
                "static value, as eqx.filter_jit does, and its arrays would be tracers of "
                f"amp's trace. Make {kind} a pytree (jax.tree_util.register_dataclass, an "
                "equinox.Module), or return the arrays themselves."
            )
    return statics


class InputRef:
    """An output leaf that is the ``index``-th traced argument, a mutable array
    (``jax.Ref``): amp returns the caller's Ref itself, as plain Python and
    ``nnx.jit`` do (a jaxpr cannot return one)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def out_refs(leaves: list[Any], statics: dict[int, Any], inputs: Sequence[Any]) -> list[int]:
    """Takes the mutable arrays (``jax.Ref``) out of ``fn``'s output ``leaves``,
    which a jaxpr cannot return: an argument's Ref (one of ``inputs``, the
    traced arguments) becomes an `InputRef` among ``statics``, a Ref made
    inside ``fn`` its value in ``leaves``; gives the indexes of the latter,
    which amp returns as new Refs (``jax.new_ref``) of that value, as
    ``nnx.jit`` does."""
    given = {id(x): i for i, x in enumerate(inputs)}
    made = []
    for i, x in enumerate(leaves):
        if i in statics or not isinstance(x, compat.Ref):
            continue
        if id(x) in given:
            statics[i] = InputRef(given[id(x)])
        else:
            leaves[i] = x[...]
            made.append(i)
    return made


def fresh(x: object) -> Any:
    """An argument returned as it is, as a new value (a concrete tracer's
    ``jnp.asarray``, as ``jax.jvp(jnp.asarray)`` makes it); a token, an array
    and an abstract tracer as they are."""
    if isinstance(x, compat.Tracer) and not isinstance(compat.aval_of(x), compat.AbstractToken):
        return jax.numpy.asarray(x)
    return as_output(x)
