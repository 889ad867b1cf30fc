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
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from amp_jax._src import compat, jaxprs, paths
from amp_jax._src.decision import (
    KEPT,
    Color,
    Decision,
    Kind,
    attention_from_stack,
    body_plan,
    rule_scope,
)
from amp_jax._src.policy import Policy, is_managed_float
from amp_jax._src.transform import AmpFunction, Traced


class Decisions(collections.defaultdict):
    """``{(source line, primitive): {named_scope path: Counter of reasons}}``.

    The source line is that of the outermost call an eqn is in (`jaxprs.iter_eqns`):
    in a library's solver (a ``custom_vjp`` around a whole solve) that is one line
    for all of its ops. ``own`` tells those ops apart: ``{(the eqn's own source
    line, primitive): Counter of reasons}``, from every plan of the trace, the
    bodies JAX traced after planning (a custom derivative rule's) included.
    """

    def __init__(self) -> None:
        super().__init__(lambda: collections.defaultdict(collections.Counter))
        self.own: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
            collections.Counter
        )


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

    def __call__(self, eqn: compat.Eqn) -> str:
        tb = eqn.source_info.traceback
        hit = self._memo.get(id(tb))
        if hit is None or hit[0] is not tb:
            hit = self._memo[id(tb)] = (tb, compat.source_line(eqn))
        return hit[1]


def ran_in(eqn: compat.Eqn) -> str:
    """The dtype an eqn computed in: its floating operands' (``a->b`` for a cast)."""
    ins, outs = float_dtypes(eqn.invars), float_dtypes(eqn.outvars)
    if eqn.primitive.name == "convert_element_type" and ins and outs and ins != outs:
        return f"{ins[0]}->{outs[0]}"
    return ",".join(ins or outs) or "-"


def is_float_cast(eqn: compat.Eqn) -> bool:
    """Whether ``eqn`` casts between two floating dtypes."""
    return (
        eqn.primitive.name == "convert_element_type"
        and bool(float_dtypes(eqn.invars))
        and bool(float_dtypes(eqn.outvars))
        and float_dtypes(eqn.invars) != float_dtypes(eqn.outvars)
    )


def full_stack(eqn: compat.Eqn, outer: tuple[str, ...]) -> str:
    """``eqn``'s name stack below its enclosing eqns' (``outer``, from `jaxprs.iter_eqns`)."""
    return "/".join(s for s in (*outer, str(eqn.source_info.name_stack)) if s)


@functools.lru_cache(maxsize=4096)
def scope_of(stack: str) -> str:
    """The user's ``named_scope`` path of a name stack, without JAX's transform
    names (``transpose(jvp(attn))`` -> ``attn``); ``-`` for none."""
    return paths.scope_path(stack) or "-"


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
    return decisions_of_traces([traced])


def decisions_of_traces(traces: Sequence[Traced]) -> Decisions:
    """The reasons of the plans of ``traces`` (each once), merged."""
    out = Decisions()
    seen: set[int] = set()
    plans: dict[int, Any] = {}
    for traced in traces:
        if id(traced) not in seen:
            seen.add(id(traced))
            _decide(traced.plan.jaxpr, traced.plan.decisions, out, None)
            memo = getattr(traced.ctx, "memo", None)
            for p in [traced.plan, *(getattr(memo, "plans", None) or ())]:
                if p is not None:
                    plans.setdefault(id(p), p)
    for p in plans.values():  # (each eqn once, by its own line)
        for eqn, d in zip(p.jaxpr.eqns, p.decisions):
            out.own[(compat.source_line(eqn), eqn.primitive.name)][d.reason.text] += 1
    return out


def _decide(
    jaxpr: compat.Jaxpr,
    decisions: Sequence[Decision],
    out: Decisions,
    inherited: str | None,
    outer: tuple[str, ...] = (),
    site: Any = None,
) -> None:
    """Fills ``out[(source line, primitive)][named_scope path]`` with a Counter
    of the reasons of the plan's decisions (the sub-jaxprs' plans included:
    the tree's, read, never planned again).

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
        scope = scope_of(full_stack(eqn, outer))
        if d.rule is not None and inherited is None:  # (its ops run under the rule's scope)
            scope = rule_scope(d.rule) if scope == "-" else f"{scope}/{rule_scope(d.rule)}"
        out[where][scope][reason] += 1
        if not compat.has_subjaxprs(eqn):
            continue
        inner = (*outer, str(eqn.source_info.name_stack))
        at = jaxprs.line_site(eqn, site)
        for sub in _plannable_subjaxprs(eqn):
            if d.kind is Kind.AS_WRITTEN or inherited is not None:
                body = compat.jaxpr_of(sub)
                _decide(body, [d] * len(body.eqns), out, reason, inner, at)
            elif d.color is Color.LOW:  # a transparent custom_jvp function: all of it low
                body = body_plan(d, sub).jaxpr
                _decide(body, [d] * len(body.eqns), out, reason, inner, at)
            else:
                sub_plan = body_plan(d, sub)
                _decide(sub_plan.jaxpr, sub_plan.decisions, out, None, inner, at)


def _plannable_subjaxprs(eqn: compat.Eqn) -> list[Any]:
    """The sub-jaxprs of ``eqn`` as closed jaxprs, but for an open one with
    constvars (its constants are values of the enclosing trace): no plan of its
    own to read, its ops get their line's reasons (`_derived`)."""
    return [
        s if compat.is_closed_jaxpr(s) else compat.close(s, [])
        for s in jex_core.jaxprs_in_params(eqn.params)
        if compat.is_closed_jaxpr(s) or not s.constvars
    ]


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
    eqn: compat.Eqn,
    stack: str,
    orig_keys: collections.Counter,
    seen: collections.Counter,
    line: str | None = None,
    derived: dict[str, str] | None = None,
    *,
    compute_dtype: str | None = None,
    dead: bool = False,
) -> str:
    """Why ``eqn`` (of the rewritten program, at name stack ``stack``) ran as it did.

    A floating cast is amp's (``seen`` counts the casts of its source line so
    far, ``orig_keys`` those of the original program) or the program's own.
    ``line``: ``eqn``'s source line, if the caller has it; ``derived``: a memo
    of `_derived` by line, for a caller that asks of every eqn of a program.
    With ``compute_dtype`` (the policy's), the reason is made to agree with
    the dtype the eqn ran in (`agree`); ``dead``: nothing reads its results.
    """
    key = (compat.source_line(eqn) if line is None else line, eqn.primitive.name)
    scope = scope_of(stack)
    found = _decision_at(decisions[key], scope) if key in decisions else None
    if not found:  # amp's own evaluation (no source line, a dot's call site): the scope's
        found = _decision_in_scope(decisions, key[1], scope)
    found = _refined(decisions, eqn, found, compute_dtype)
    if is_float_cast(eqn):
        seen[key] += 1
        unused = ", unused: XLA removes it" if dead else ""
        if seen[key] > orig_keys.get(key, 0):
            return f"cast inserted by amp{unused}"
        return f"cast in the original program{unused}"
    path = attention_from_stack(stack)  # the path each attention took (attention/)
    attention = path.text if path is not None else None
    if path is not None and path.impl is not None:  # run fused: amp wrote these ops
        reason = path.text
    elif found:
        reason = found.most_common(1)[0][0]
    elif key[1] == "optimization_barrier" and _has_dot(decisions, key[0]):
        reason = _BARRIER  # (not the program's: amp's lowered dot of this line)
    elif derived is None:
        reason = _derived(decisions, key[0])
    else:
        if key[0] not in derived:
            derived[key[0]] = _derived(decisions, key[0])
        reason = derived[key[0]]
    backward = is_backward(stack) and bool(found)
    if compute_dtype is not None:
        reason = agree(
            reason, eqn, compute_dtype, backward=is_backward(stack), decided=bool(found), dead=dead
        )
    if attention and attention not in reason:  # left as written: the dtype reason, and why
        reason = f"{reason}; {attention}"
    if backward and not reason.startswith(("backward of", "derived by JAX")):
        return f"backward of: {reason}"
    return reason


#: the reason of a barrier amp's lowered dot adds (`backends.cpu`), at a line with no barrier
_BARRIER = "added by amp: a barrier that keeps this line's matmul in the layout XLA runs fast"


def _has_dot(decisions: Decisions, line: str) -> bool:
    """Whether the plan decided a matmul or convolution at source line ``line``."""
    return any((line, prim) in decisions for prim in ("dot_general", "conv_general_dilated"))


def _refined(
    decisions: Decisions,
    eqn: compat.Eqn,
    found: collections.Counter | None,
    compute_dtype: str | None,
) -> collections.Counter | None:
    """The reasons of ``found`` (those of ``eqn``'s line and scope) that are
    ``eqn``'s: where they are several (a solver's ops share its call's line),
    those decided at ``eqn``'s own source line, and of those the ones that
    agree with the dtypes it ran in (`fits`); the own line's reasons where
    its line has none (a body traced after planning: a custom derivative rule)."""
    allow = eqn.primitive.name in _ALLOW_OPS
    if found is not None and len(found) == 1:
        if not allow or compute_dtype is None or fits(next(iter(found)), eqn, compute_dtype):
            return found
    if found and not allow:  # (several reasons of another op: `agree` words them)
        return found
    own = getattr(decisions, "own", {}).get((compat.source_line(eqn), eqn.primitive.name))
    if own:
        mine = collections.Counter({r: n for r, n in (found or own).items() if r in own})
        found = mine or found
    # (a matmul's operands say whether it was lowered; another op's reason is made
    # to agree with its dtype by `agree`, which says how it came to run so)
    if allow and found and compute_dtype is not None and len(found) > 1:
        fitting = collections.Counter(
            {r: n for r, n in found.items() if fits(r, eqn, compute_dtype)}
        )
        found = fitting or found
    return found


#: the primitives of the allow class by default: a matmul's operands say whether amp lowered it
_ALLOW_OPS = frozenset({"dot_general", "conv_general_dilated"})


def fits(reason: str, eqn: compat.Eqn, compute_dtype: str) -> bool:
    """Whether ``reason`` can be why matmul or convolution ``eqn`` ran as it did:
    one that read compute-dtype operands was lowered (its reason is not one of
    keeping it: `KEPT`), one that read float32 was not, and a dtype the reason
    names is one it ran in. (Any other op: True; `agree` words its reason.)"""
    if eqn.primitive.name not in _ALLOW_OPS or compute_dtype == "float32":
        return True
    ran = ran_in(eqn).split("->")[-1].split(",")
    claim = claimed_dtype(reason, compute_dtype)
    if claim is not None and ran != ["-"] and claim not in ran:
        return False
    low = compute_dtype in ran
    return low != (_keeps(reason) or reason.startswith(_NOT_LOWERED))


#: reasons of an allow op that amp did not lower (its operands are as written)
_NOT_LOWERED = ("full_precision scope", "never class", "deny class", "policy override: numer")


def _keeps(reason: str) -> bool:
    """Whether ``reason`` is one of keeping an op in its original precision (`KEPT`)."""
    text = reason.split("; attention", 1)[0]
    return text in _KEPT_TEXTS or text.startswith(("backend-aware:", "no amp decision"))


def _decision_in_scope(
    decisions: Decisions, primitive: str, scope: str
) -> collections.Counter | None:
    """The reasons decided for ``primitive`` at ``scope`` on any source line, if
    they are one reason (an op amp evaluated itself has no source line)."""
    found: collections.Counter[Any] = collections.Counter()
    for (_, prim), by_scope in decisions.items():
        if prim == primitive and scope in by_scope:
            found.update(by_scope[scope])
    return found if len(found) == 1 else None


def line_in_scope(decisions: Decisions, primitive: str, scope: str) -> str | None:
    """The one source line with a decision for ``primitive`` at ``scope``, if one:
    where an op amp evaluated itself (no source line of its own) comes from."""
    lines = {w for (w, prim), by in decisions.items() if prim == primitive and scope in by}
    return lines.pop() if len(lines) == 1 else None


# -- a reason that agrees with the dtype shown ------------------------------------------

_CLAIM = re.compile(r"\bruns? in (bfloat16|float16|float32|float64)\b")
#: elementwise ops of several operands: painted low with a float32 operand, they promote
_NARY = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "select_n", "nextafter"}
)


_NO_FLOAT = "no floating operand"
_KEPT_TEXTS = frozenset(KEPT.values())


def claimed_dtype(reason: str, compute_dtype: str) -> str | None:
    """The dtype ``reason`` says its op runs in: ``runs in X``, or the compute
    dtype for a painting (``painting: ... between two bfloat16 ops``); None
    when it names none (``keeps its operands' dtypes``, a cast)."""
    m = _CLAIM.search(reason)
    if m is not None:
        return m.group(1)
    return compute_dtype if "painting:" in reason else None


def agree(
    reason: str,
    eqn: compat.Eqn,
    compute_dtype: str,
    *,
    backward: bool = False,
    decided: bool = True,
    dead: bool = False,
) -> str:
    """``reason``, or the rule that really set ``eqn``'s dtype where the two disagree.

    A plan decides the dtype an op *reads* its operands in; what an op of the
    rewritten program ran in can still differ from the decision of its line:
    a low elementwise op with a float32 operand (a parameter) is promoted to
    float32, a backward op runs in the dtype of the gradient it gets, an op
    JAX derived runs in the dtype of its inputs, and an op nothing reads
    (``dead``) is removed by XLA: said so, whatever its line decided.
    ``decided``: the reason is the plan's decision for this op (not one
    derived from its line).
    """
    ran = ran_in(eqn).split("->")[-1].split(",")
    if dead:  # (whatever rule gave its dtype: it never runs)
        return f"unused: nothing reads its result, XLA removes it ({ran[0]})"
    claim = claimed_dtype(reason, compute_dtype)
    if _NO_FLOAT in reason and ran != ["-"]:  # (an int op's decision at the same line)
        claim, decided = "-", False
    if claim is None or claim in ran:
        return reason
    dtype = ran[0]
    if not decided:
        return f"derived by JAX from this line's ops: runs in {dtype}, its inputs' dtype"
    if backward:
        return f"backward of a {claim} op: runs in {dtype}, the dtype of its gradient"
    if eqn.primitive.name in _NARY and claim == compute_dtype and len(eqn.invars) > 1:
        return (
            f"runs in {dtype}: painted {compute_dtype}, promoted by a {dtype} operand "
            f"(a parameter), result cast to {compute_dtype}"
        )
    return f"runs in {dtype}, its inputs' dtype (amp decided {claim} for this line)"


def _derived(decisions: Decisions, line: str) -> str:
    """The reason of an op no plan decided: its source line's decisions, if any."""
    at_line = [c for (w, _), by in decisions.items() if w == line for c in by.values()]
    merged: collections.Counter[str] = sum(at_line, collections.Counter())
    return (
        f"derived by JAX from this line's ops ({merged.most_common(1)[0][0]})"
        if merged
        else "no amp decision (added by a JAX transformation, or outside the amp function)"
    )
