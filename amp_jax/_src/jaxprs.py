"""A small jaxpr toolkit: what every walker of a jaxpr in amp needs.

Opening a sub-jaxpr (closed or not), iterating the eqns of a jaxpr and of
its sub-jaxprs, def-use maps, and the size of a contraction. The
interpreter, planning, ``attention``, ``explain``, ``dtype_report`` and the
tests use these instead of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from amp_jax._src import compat


def open_jaxpr(sub: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of a sub-jaxpr found in an eqn's params (closed or not)."""
    if compat.is_closed_jaxpr(sub):
        return compat.jaxpr_of(sub), list(compat.consts_of(sub))
    return sub, []


def closed_subjaxprs(eqn: Any) -> list[Any]:
    """The sub-jaxprs of ``eqn``, each as a closed jaxpr."""
    return [
        s if compat.is_closed_jaxpr(s) else compat.close(s, [])
        for s in jex_core.jaxprs_in_params(eqn.params)
    ]


def iter_eqns(
    jaxpr: Any, path: str = "", times: int = 1, stack: tuple[str, ...] = ()
) -> Iterator[tuple[Any, str, int, tuple[str, ...]]]:
    """``(eqn, enclosing primitives, times it runs, enclosing eqns' name
    stacks)`` for every first-order eqn of ``jaxpr`` and of its sub-jaxprs (a
    ``scan`` body runs ``length`` times; a ``while`` body is counted once,
    every ``cond`` branch once). A sub-jaxpr's name stacks are relative to
    the eqn that holds it: the full stack is ``(*stack, eqn's own)``."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(jex_core.jaxprs_in_params(eqn.params))
        if subs:
            inner = times * int(eqn.params.get("length", 1)) if name == "scan" else times
            inner_stack = (*stack, str(eqn.source_info.name_stack))
            for sub in subs:
                yield from iter_eqns(
                    open_jaxpr(sub)[0], f"{path}/{name}" if path else name, inner, inner_stack
                )
            continue
        yield eqn, path, times, stack


def def_use(jaxpr: Any) -> tuple[dict[Any, int], dict[Any, list[int]]]:
    """``(producer, consumers)``: the index of the eqn that writes each var, and
    the indices of the eqns that read it (literals are nobody's)."""
    producer: dict[Any, int] = {}
    consumers: dict[Any, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.outvars:
            producer[v] = i
        for v in e.invars:
            if not isinstance(v, compat.Literal):
                consumers.setdefault(v, []).append(i)
    return producer, consumers


def read(env: dict[Any, Any], atom: Any) -> Any:
    """The value of a var in ``env``, or of a literal."""
    return compat.literal_value(atom) if isinstance(atom, compat.Literal) else env[atom]


def run_eqns(
    eqns: Iterable[Any],
    env: dict[Any, Any],
    bind: Callable[[Any, list[Any]], Sequence[Any]] = compat.bind_eqn,
) -> None:
    """Evaluates ``eqns`` in order, reading their operands from ``env`` and
    writing their results there: ``bind(eqn, operands)`` gives the results
    (the per-eqn hook of every evaluator; default: bind the eqn as it is)."""
    for eqn in eqns:
        outs = bind(eqn, [read(env, v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = o


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    bind: Callable[[Any, list[Any]], Sequence[Any]] = compat.bind_eqn,
) -> list[Any]:
    """``jaxpr`` evaluated on ``args``, every eqn through ``bind`` (see `run_eqns`)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    run_eqns(jaxpr.eqns, env, bind)
    return [read(env, v) for v in jaxpr.outvars]


def contraction_and_flops(eqn: Any) -> tuple[int, int] | None:
    """``(contraction length, FLOPs)`` of a ``dot_general`` or convolution eqn, else None."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([eqn.invars[0].aval.shape[d] for d in lc], dtype=np.int64))
    elif name == "conv_general_dilated":
        w = eqn.invars[1].aval.shape
        dn = eqn.params.get("dimension_numbers")
        out_dim = dn.rhs_spec[0] if dn is not None and hasattr(dn, "rhs_spec") else 0
        k = int(np.prod(w, dtype=np.int64)) // max(int(w[out_dim]), 1)  # in-features x window
    else:
        return None
    return k, 2 * k * int(np.prod(out.shape, dtype=np.int64))
