"""JAX's jaxpr objects as amp_jax reads them: names for annotations (`Eqn`, `Var`,
`Literal`, `Atom`, `Jaxpr`, `ClosedJaxpr`...), a closed jaxpr opened and closed again
(one class from JAX 0.11), tracing a function to a jaxpr, binding an eqn, literals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeGuard

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import linear_util as jex_lu
from jax.typing import ArrayLike

#: A closed jaxpr: a `Jaxpr` with the values of its constants (one class from JAX 0.11).
ClosedJaxpr: TypeAlias = jex_core.ClosedJaxpr
#: An open jaxpr: ``eqns``, ``invars``, ``outvars``, ``constvars``.
Jaxpr: TypeAlias = jex_core.Jaxpr
#: One equation of a jaxpr (``JaxprEqn``): ``primitive``, ``params``, ``invars``, ``outvars``.
Eqn: TypeAlias = jex_core.JaxprEqn
#: A jaxpr variable (an equation's result, a jaxpr's input).
Var: TypeAlias = jex_core.Var
#: A constant operand written into a jaxpr (``Literal.val``).
Literal: TypeAlias = jex_core.Literal
#: An equation's operand or a jaxpr's output: a variable or a literal.
Atom: TypeAlias = Var | Literal
#: A JAX primitive (``lax.dot_general_p``...): ``name``, ``bind``, ``multiple_results``.
Primitive: TypeAlias = jex_core.Primitive
#: The abstract value of a jaxpr variable (``Var.aval``).
AbstractValue: TypeAlias = jax.core.AbstractValue
#: The abstract value of an array: ``shape``, ``dtype``, ``weak_type``, ``sharding``.
ShapedArray: TypeAlias = jax.core.ShapedArray
#: The structure of a flattened pytree (``jax.tree.flatten``'s second result).
PyTreeDef: TypeAlias = jax.tree_util.PyTreeDef
#: Where a leaf sits in a pytree (``jax.tree_util.tree_flatten_with_path``'s paths).
KeyPath: TypeAlias = jax.tree_util.KeyPath
#: A function wrapped for JAX's tracing (the thunks in ``custom_jvp_call`` /
#: ``custom_vjp_call`` params).
WrappedFun: TypeAlias = jex_lu.WrappedFun
Tracer: TypeAlias = jax.core.Tracer
#: what ``jax.lax.create_token()`` returns outside a trace (effects ordering)
Token: TypeAlias = jex_core.Token
AbstractToken: TypeAlias = jex_core.AbstractToken
#: a mutable array (``jax.new_ref``), concrete or a tracer of one (JAX 0.10 and 0.12)
Ref: TypeAlias = jax.Ref

#: ``(major, minor)`` of the running JAX.
JAX_VERSION: tuple[int, int] = tuple(jax.__version_info__[:2])
#: True from JAX 0.11 on, where the two classes are one: a "closed" jaxpr is a
#: Jaxpr with consts, and no jaxpr is open in the sense of `is_open_jaxpr`.
ONE_JAXPR_CLASS = ClosedJaxpr is Jaxpr


def is_closed_jaxpr(x: object) -> TypeGuard[ClosedJaxpr]:
    return isinstance(x, ClosedJaxpr) and (not ONE_JAXPR_CLASS or hasattr(x, "consts"))


def is_open_jaxpr(x: object) -> TypeGuard[Jaxpr]:
    return isinstance(x, Jaxpr) and not isinstance(x, ClosedJaxpr)


def jaxpr_of(cj: ClosedJaxpr) -> Jaxpr:
    """The open jaxpr (eqns, invars, outvars) of a closed jaxpr."""
    return cj if ONE_JAXPR_CLASS else cj.jaxpr


def consts_of(cj: ClosedJaxpr) -> list[Any]:
    return list(cj.consts)


def close(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, list(consts))


def in_avals(cj: ClosedJaxpr) -> list[AbstractValue]:
    return list(cj.in_avals)


def aval_of(x: object) -> Any:
    return jax.typeof(x)


def _sharding_of(x: object) -> jax.sharding.Sharding | None:
    """The sharding to trace ``x`` with: a concrete array's own, if it spans devices."""
    if isinstance(x, jax.Array) and not isinstance(x, Tracer):
        try:
            s = x.sharding
        except Exception:  # deleted or otherwise unusable arrays
            return None
        return s if len(s.device_set) > 1 else None
    return None


def abstractify(x: object) -> AbstractValue | jax.ShapeDtypeStruct:
    """The abstract value to trace ``fn`` at for argument ``x``.

    The aval carries dtype, weak type and (explicit-mode) sharding; a concrete
    array spread over several devices also passes its own sharding, which
    ``shard_map`` checks against its ``in_specs``.
    """
    s = _sharding_of(x)
    aval = jax.typeof(x)
    if s is None:
        return aval
    return jax.ShapeDtypeStruct(np.shape(x), aval.dtype, weak_type=aval.weak_type, sharding=s)


def abstract_key(x: object) -> tuple[Any, ...]:
    """Hashable description of ``x``'s abstract type, for the trace cache."""
    aval = jax.typeof(x)
    s = _sharding_of(x)
    return (aval, s)


def trace_to_closed_jaxpr(fn: Callable[..., Any], avals: Sequence[Any]) -> ClosedJaxpr:
    """Traces ``fn`` at abstract values ``avals`` into a closed jaxpr."""
    return jax.make_jaxpr(fn)(*avals)


def trace_with_shape(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
    """Traces ``fn(*args)`` (ShapeDtypeStructs) returning (closed jaxpr, out shape tree)."""
    return jax.make_jaxpr(fn, return_shape=True)(*args)


def trace_with_shape_kw(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[ClosedJaxpr, Any]:
    """Like `trace_with_shape` with keyword arguments too (pytrees of
    ShapeDtypeStructs); the jaxpr's invars are the leaves of ``(args, kwargs)``.
    JAX names ``fn`` (and its ``__wrapped__`` function's arguments) in its errors."""
    return jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)


def closed_to_open_no_consts(cj: ClosedJaxpr, what: str) -> Jaxpr:
    """Returns the open jaxpr of ``cj``; it must not capture constants."""
    if consts_of(cj):
        raise NotImplementedError(
            f"amp_jax: rewriting the sub-jaxpr of {what} produced captured constants; "
            "please report this with the function that triggers it."
        )
    return jaxpr_of(cj)


def bind_eqn(eqn: Eqn, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive (with ``params`` if given) under the current trace."""
    prim = eqn.primitive
    params = eqn.params if params is None else params
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):  # (subfuns, params) in some versions
        subfuns, bind_params = bind_params
        out = prim.bind(*subfuns, *invals, **bind_params)
    else:
        out = prim.bind(*invals, **bind_params)
    return list(out) if prim.multiple_results else [out]


def is_drop_var(v: object) -> bool:
    """A result var nothing reads (``_`` in a printed jaxpr)."""
    return isinstance(v, jex_core.DropVar)


def jaxpr_as_fun(cj: ClosedJaxpr) -> Callable[..., list[Any]]:
    """A closed jaxpr as a function of its inputs (``jax.extend.core.jaxpr_as_fun``)."""
    return jex_core.jaxpr_as_fun(cj)


def literal_value(lit: Literal) -> Any:
    return lit.val


def cast_constant(value: ArrayLike, dtype: np.dtype) -> np.ndarray | np.generic:
    """Casts a literal constant without creating a traced op (stays a literal)."""
    return (
        np.asarray(value, dtype=dtype)[()]
        if np.ndim(value) == 0
        else np.asarray(value, dtype=dtype)
    )
