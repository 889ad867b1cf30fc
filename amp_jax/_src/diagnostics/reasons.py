"""What an equation of the rewritten program ran in, and why.

The *decisions* come from the plan [`amp`][amp_jax.amp] evaluates
(`AmpFunction.trace_for_inspection`): `decisions_of` gathers the reason of
every planned equation (sub-jaxprs' plans included) by source line,
primitive and ``named_scope`` path. `row_reason` finds the reason of an
equation of the rewritten program (``jax.make_jaxpr`` of the amp function,
or of its gradient): the rewritten program keeps the source info of the op
it replaces, and the backward ops of ``jax.grad`` carry the line of their
forward op.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from amp_jax._src import compat, jaxprs
from amp_jax._src.decision import Color, Decision, Kind, attention_from_stack, body_hints
from amp_jax._src.planning import Context, plan
from amp_jax._src.policy import Policy, is_managed_float
from amp_jax._src.transform import AmpFunction, Traced

#: ``{(source line, primitive): {named_scope path: Counter of reasons}}``
Decisions = dict[tuple[str, str], dict[str, collections.Counter]]


# -- what an equation is ---------------------------------------------------------------


def float_dtypes(atoms: Sequence[Any]) -> list[str]:
    """The floating dtypes amp manages among ``atoms``' avals, in order, once each."""
    seen: list[str] = []
    for a in atoms:
        name = _managed_name(getattr(a.aval, "dtype", None))
        if name is not None and name not in seen:
            seen.append(name)
    return seen


_NAMES: dict[Any, str | None] = {}


def _managed_name(dtype: Any) -> str | None:
    """``dtype``'s name if amp manages it, else None (once per dtype: explain
    asks it of every operand of every eqn of a program)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        name = _NAMES[dtype] = str(np.dtype(dtype)) if is_managed_float(dtype) else None
        return name
    except TypeError:  # (an unhashable dtype-like)
        return str(np.dtype(dtype)) if is_managed_float(dtype) else None


class SourceLines:
    """`compat.source_line` of eqns, once per traceback (the forward and
    backward ops of one source line share it)."""

    def __init__(self):
        self._memo: dict[int, tuple[Any, str]] = {}

    def __call__(self, eqn: Any) -> str:
        tb = eqn.source_info.traceback
        hit = self._memo.get(id(tb))
        if hit is None or hit[0] is not tb:
            hit = self._memo[id(tb)] = (tb, compat.source_line(eqn))
        return hit[1]


def ran_in(eqn: Any) -> str:
    """The dtype an eqn computed in: its floating operands' (``a->b`` for a cast)."""
    ins, outs = float_dtypes(eqn.invars), float_dtypes(eqn.outvars)
    if eqn.primitive.name == "convert_element_type" and ins and outs and ins != outs:
        return f"{ins[0]}->{outs[0]}"
    return ",".join(ins or outs) or "-"


def is_float_cast(eqn: Any) -> bool:
    """Whether ``eqn`` casts between two floating dtypes."""
    return (
        eqn.primitive.name == "convert_element_type"
        and bool(float_dtypes(eqn.invars))
        and bool(float_dtypes(eqn.outvars))
        and float_dtypes(eqn.invars) != float_dtypes(eqn.outvars)
    )


def full_stack(eqn: Any, outer: tuple[str, ...]) -> str:
    """``eqn``'s name stack below its enclosing eqns' (``outer``, from `jaxprs.iter_eqns`)."""
    return "/".join(s for s in (*outer, str(eqn.source_info.name_stack)) if s)


@functools.lru_cache(maxsize=4096)
def scope_of(stack: str) -> str:
    """The user's ``named_scope`` path of a name stack, without JAX's transform names."""
    parts = []
    for part in stack.split("/"):
        # transform names wrap scopes: "transpose(jvp(attn))" -> "attn"
        while "(" in part and part.endswith(")"):
            part = part[part.index("(") + 1 : -1]
        if part:
            parts.append(part)
    return "/".join(parts) or "-"


def is_backward(stack: str) -> bool:
    """Whether a name stack is that of the backward pass of ``jax.grad``."""
    return "transpose(" in stack


# -- the plan's decisions --------------------------------------------------------------


def decisions_of(
    base: Callable[..., Any],
    policy: Policy,
    args: tuple,
    kwargs: dict,
    traced: Traced | None = None,
) -> Decisions:
    """The reasons of the plan amp makes of ``base(*args, **kwargs)`` under
    ``policy``: that of ``traced`` (the trace of that call, when the caller
    has one), else of a fresh trace."""
    if traced is None:
        traced = AmpFunction(base, policy).trace_for_inspection(*args, **kwargs)
    out: Decisions = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    _decide(traced.ctx, traced.plan.jaxpr, traced.plan.decisions, out, None)
    return out


def _decide(
    ctx: Context,
    jaxpr: Any,
    decisions: Sequence[Decision],
    out: Decisions,
    inherited: str | None,
    outer: tuple[str, ...] = (),
    site: Any = None,
) -> None:
    """Fills ``out[(source line, primitive)][named_scope path]`` with a Counter
    of the reasons of the plan's decisions (the sub-jaxprs' plans included).

    The scope tells apart the ops of one source line called under different
    ``named_scope`` s (a library layer used twice: one Dense in a
    ``full_precision_scopes`` head, one outside). ``outer`` is the enclosing
    eqns' name stacks, as `jaxprs.iter_eqns` gives them for the rows.
    An eqn bound as written, or a function painted low, gives its own reason
    to everything it holds (``inherited``). ``site``: the call whose source
    line the eqns have (as `jaxprs.iter_eqns` gives it to the rows).
    """
    for eqn, d in zip(jaxpr.eqns, decisions):
        reason = inherited or d.reason.text
        where = (compat.source_line(eqn if site is None else site), eqn.primitive.name)
        out[where][scope_of(full_stack(eqn, outer))][reason] += 1
        if not compat.has_subjaxprs(eqn):
            continue
        inner = (*outer, str(eqn.source_info.name_stack))
        at = jaxprs.line_site(eqn, site)
        for sub in jaxprs.closed_subjaxprs(eqn):
            if d.kind is Kind.AS_WRITTEN or inherited is not None:
                body = compat.jaxpr_of(sub)
                _decide(ctx, body, [d] * len(body.eqns), out, reason, inner, at)
            elif d.color is Color.LOW:  # a transparent custom_jvp function: all of it low
                body = compat.jaxpr_of(ctx.prepare(sub))
                _decide(ctx, body, [d] * len(body.eqns), out, reason, inner, at)
            else:
                sub_plan = plan(ctx, sub, body_hints(eqn, d, sub))
                _decide(ctx, sub_plan.jaxpr, sub_plan.decisions, out, None, inner, at)


def _decision_at(by_scope: dict[str, collections.Counter], scope: str) -> collections.Counter:
    """The reasons decided for the ops of one source line at ``scope``: those of
    the innermost decided scope that encloses ``scope`` (amp's own scopes, such
    as ``amp_float8.tensorwise``, nest inside the user's), else all of them."""
    parts = [] if scope == "-" else scope.split("/")

    def encloses(s: str) -> bool:
        d = [] if s == "-" else s.split("/")
        return parts[: len(d)] == d

    inside = [s for s in by_scope if encloses(s)]
    if inside:
        return by_scope[max(inside, key=lambda s: 0 if s == "-" else s.count("/") + 1)]
    return sum(by_scope.values(), collections.Counter())


# -- the reason of one equation of the rewritten program -------------------------------


def row_reason(
    decisions: Decisions,
    eqn: Any,
    stack: str,
    orig_keys: collections.Counter,
    seen: collections.Counter,
    line: str | None = None,
    derived: dict[str, str] | None = None,
) -> str:
    """Why ``eqn`` (of the rewritten program, at name stack ``stack``) ran as it did.

    A floating cast is amp's (``seen`` counts the casts of its source line so
    far, ``orig_keys`` those of the original program) or the program's own.
    ``line``: ``eqn``'s source line, if the caller has it; ``derived``: a memo
    of `_derived` by line, for a caller that asks of every eqn of a program.
    """
    key = (compat.source_line(eqn) if line is None else line, eqn.primitive.name)
    found = _decision_at(decisions[key], scope_of(stack)) if key in decisions else None
    if is_float_cast(eqn):
        seen[key] += 1
        if seen[key] > orig_keys.get(key, 0):
            return "cast inserted by amp"
        return "cast in the original program"
    path = attention_from_stack(stack)  # the path each attention took (attention.py)
    attention = path.text if path is not None else None
    if path is not None and path.impl is not None:  # run fused: amp wrote these ops
        reason = path.text
    elif found:
        reason = found.most_common(1)[0][0]
    elif derived is None:
        reason = _derived(decisions, key[0])
    else:
        if key[0] not in derived:
            derived[key[0]] = _derived(decisions, key[0])
        reason = derived[key[0]]
    if attention and reason != attention:  # left as written: the dtype reason, and why
        reason = f"{reason}; {attention}"
    if is_backward(stack) and found:
        return f"backward of: {reason}"
    return reason


def _derived(decisions: Decisions, line: str) -> str:
    """The reason of an op no plan decided: its source line's decisions, if any."""
    at_line = [c for (w, _), by in decisions.items() if w == line for c in by.values()]
    merged = sum(at_line, collections.Counter())
    return (
        f"derived by JAX from this line's ops ({merged.most_common(1)[0][0]})"
        if merged
        else "no amp decision (added by a JAX transformation, or outside the amp function)"
    )
