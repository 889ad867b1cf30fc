"""The jaxpr attention is matched in, and the walks recognition makes through it.

`Graph` holds the jaxpr with its def-use maps; `Near` says what a failed
check names once the softmax and its values matmul are found (`NoMatch`
carries the `NearMiss`, or none: not attention). The walks follow values back
through broadcasts and casts (`trace_source`), find a bias's mask
(`mask_of_bias`), a ``jnp.repeat`` of k/v (`unrepeat`), whether a mask is
computed from the activations (`mask_depends_on_values`) and whether it is a
constant causal mask (`is_causal_constant`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax._src import compat, jaxprs
from amp_jax._src.attention.match import NearMiss

FILL_MAX = -1e4  # a mask fill at or below this is "masked out"


def literal_scalar(atom: compat.Atom) -> float | None:
    if isinstance(atom, compat.Literal):
        val = np.asarray(compat.literal_value(atom))
        if val.ndim == 0:
            return float(val)
    return None


class NoMatch(Exception):
    """Not attention; with a `NearMiss` when the softmax and both matmuls are there."""

    def __init__(self, miss: NearMiss | None = None):
        super().__init__(miss.reason if miss is not None else "not attention")
        self.miss = miss


@dataclasses.dataclass(frozen=True)
class Near:
    """Once the softmax and its values matmul are found: what a near miss names."""

    eqns: frozenset[int]
    source: Any  # eqn (for its source info)

    def need(self, cond: bool, reason: str | None = None) -> None:
        """A near miss with ``reason`` unless ``cond`` (no reason: not attention)."""
        if not cond:
            raise NoMatch(NearMiss(reason, self.eqns, self.source) if reason else None)


#: before the softmax and its values matmul are found, a failed check is no near miss
NOT_YET = Near(frozenset(), None)


@dataclasses.dataclass(frozen=True)
class Graph:
    """The jaxpr being matched, with its def-use maps."""

    jaxpr: Any
    eqns: Any
    producer: dict[Any, int]
    consumers: dict[Any, list[int]]
    outs: frozenset[Any]
    consts: dict[Any, Any]

    def prod(
        self,
        atom: compat.Atom,
        name: str | tuple[str, ...] | None = None,
        near: Near = NOT_YET,
        reason: str | None = None,
    ) -> int:
        """The index of the eqn that computes ``atom`` (of primitive ``name``, if given)."""
        near.need(not isinstance(atom, compat.Literal) and atom in self.producer, reason)
        j = self.producer[atom]
        names = name if isinstance(name, tuple) else (name,)
        near.need(name is None or self.eqns[j].primitive.name in names, reason)
        return j

    def users(self, var: compat.Atom) -> list[int]:
        return self.consumers.get(var, [])

    def only_used_by(self, var: compat.Atom, allowed: set[int], near: Near, reason: str) -> None:
        near.need(var not in self.outs and set(self.users(var)) <= allowed, reason)


def is_float_cast(e) -> bool:
    """A ``convert_element_type`` from one floating dtype to another."""
    return e.primitive.name == "convert_element_type" and all(
        jnp.issubdtype(v.aval.dtype, jnp.floating) for v in (e.invars[0], e.outvars[0])
    )


def trace_source(atom, roles, eqns, producer):
    """``atom`` with dims labelled ``roles``, followed back through broadcasts and
    same-kind converts to its source: (source atom, roles of its dims, "u" for size 1)."""
    roles = list(roles)
    while not isinstance(atom, compat.Literal) and atom in producer:
        e = eqns[producer[atom]]
        src = e.invars[0] if e.invars else None
        if src is None or isinstance(src, compat.Literal):
            break
        if e.primitive.name == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            roles = [roles[d] for d in dims]
        elif e.primitive.name == "convert_element_type" and (
            jnp.issubdtype(src.aval.dtype, jnp.floating)
            == jnp.issubdtype(atom.aval.dtype, jnp.floating)
        ):
            pass
        else:
            break
        atom = src
    shape = atom.aval.shape
    return atom, tuple("u" if shape[n] == 1 else r for n, r in enumerate(roles))


def mask_of_bias(atom, eqns, producer):
    """The boolean mask of a bias ``jnp.where(mask, 0, fill)`` (fill <= -1e4), or None."""
    j = producer.get(atom)
    if j is None or eqns[j].primitive.name != "select_n" or len(eqns[j].invars) != 3:
        return None
    pred, on_false, on_true = eqns[j].invars

    def scalar(a):
        while not isinstance(a, compat.Literal):
            k = producer.get(a)
            if k is None or eqns[k].primitive.name not in (
                "broadcast_in_dim",
                "convert_element_type",
            ):
                return None
            a = eqns[k].invars[0]
        return literal_scalar(a)

    f, t = scalar(on_false), scalar(on_true)
    if f is not None and t == 0.0 and f <= FILL_MAX and pred.aval.dtype == np.bool_:
        return pred
    return None


def unrepeat(x, axis, eqns, producer):
    """``(x_small, repeats, eqns)`` if ``x`` is ``jnp.repeat(x_small, repeats, axis)``
    (a ``broadcast_in_dim`` inserting the repeats after ``axis``, or two, as
    ``broadcast_to(x[:, :, None], ...)`` writes it, then a ``reshape``), else None."""
    j = producer.get(x)
    if axis is None or j is None or eqns[j].primitive.name != "reshape":
        return None
    n, chain = len(x.aval.shape), [j]
    b = small = eqns[j].invars[0]
    if len(b.aval.shape) != n + 1:
        return None
    dims = tuple(range(n + 1))  # where small's dims are in b
    while True:
        i = producer.get(small)
        if i is None or eqns[i].primitive.name != "broadcast_in_dim":
            return None
        chain.append(i)
        src = eqns[i].invars[0]
        if isinstance(src, compat.Literal):
            return None
        dims = tuple(dims[d] for d in eqns[i].params["broadcast_dimensions"])
        small = src
        if len(small.aval.shape) <= n:
            break
    xs, bs, ss = x.aval.shape, b.aval.shape, small.aval.shape
    if len(ss) != n or dims != tuple(d for d in range(n + 1) if d != axis + 1):
        return None
    rep = bs[axis + 1]
    want_b = (*ss[: axis + 1], rep, *ss[axis + 1 :])
    want_x = (*ss[:axis], ss[axis] * rep, *ss[axis + 1 :])
    if tuple(bs) != want_b or tuple(xs) != want_x or rep < 2:
        return None
    return small, rep, tuple(chain)


def ancestors(atoms, eqns, producer) -> set:
    seen, todo = set(), list(atoms)
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        seen.add(a)
        j = producer.get(a)
        if j is not None:
            todo.extend(eqns[j].invars)
    return seen


def mask_depends_on_values(pred, operands, eqns, producer) -> bool:
    """Whether ``pred`` is computed from a float value that q, k or v are also
    computed from (a mask derived from the activations, not a given mask).

    The mask's float ancestors are found first: a given mask has none, and
    then q, k and v are not walked back (through every layer before this
    one: a walk per attention would make planning quadratic in the depth)."""
    floats = {
        a
        for a in ancestors([pred], eqns, producer)
        if jnp.issubdtype(getattr(a.aval, "dtype", np.bool_), jnp.inexact)
    }
    return bool(floats) and _reaches(operands, floats, eqns, producer)


def _reaches(atoms, targets: set, eqns, producer) -> bool:
    """Whether any of ``targets`` is among ``atoms`` or their ancestors (stops at the first)."""
    seen, todo = set(), list(atoms)
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        if a in targets:
            return True
        seen.add(a)
        j = producer.get(a)
        if j is not None:
            todo.extend(eqns[j].invars)
    return False


def is_causal_constant(atom, roles, eqns, producer, consts, jaxpr) -> bool:
    """Whether ``atom`` is a compile-time constant lower-triangular [Tq, Tk] mask."""
    if roles is None or "Tq" not in roles or "Tk" not in roles:
        return False
    invars = set(jaxpr.invars)
    slice_, todo, seen = [], [atom], set()
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        seen.add(a)
        if a in invars:
            return False
        if a in consts:
            if isinstance(consts[a], compat.Tracer):
                return False
            continue
        j = producer.get(a)
        if j is None:
            return False
        if compat.has_subjaxprs(eqns[j]) or eqns[j].effects:
            return False
        slice_.append(j)
        todo.extend(eqns[j].invars)
    env = dict(consts)
    with jax.ensure_compile_time_eval():
        jaxprs.run_eqns([eqns[j] for j in sorted(set(slice_))], env)
        val = np.asarray(jaxprs.read(env, atom))
    if val.dtype != np.bool_:
        return False
    tq, tk = roles.index("Tq"), roles.index("Tk")
    other = [d for d in range(val.ndim) if d not in (tq, tk)]
    m = np.transpose(val, other + [tq, tk]).reshape(-1, val.shape[tq], val.shape[tk])
    tril = np.tril(np.ones(m.shape[1:], bool))
    return m.shape[1] == m.shape[2] and bool(np.all(m == tril))
