"""Seeing what amp did: the dtypes every primitive ran in."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
from jax.typing import DTypeLike

from amp_jax._src import backends, compat, decision
from amp_jax._src.diagnostics.measure import unused_eqns
from amp_jax._src.diagnostics.reasons import (
    Decisions,
    SourceLines,
    claimed_dtype,
    decisions_of_traces,
    fits,
    float_dtypes,
    full_stack,
    is_float_cast,
    ran_in,
    row_reason,
)
from amp_jax._src.diagnostics.tracing import (
    check_grad,
    flat_call,
    loss_of,
    model_as_argument,
    split_fn,
)
from amp_jax._src.jaxprs import iter_eqns
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction, recording_traces


def _walk(
    jaxpr: compat.ClosedJaxpr,
    counts: collections.Counter[tuple[str, str, str, str, str]],
    path: str,
    decisions: Decisions,
    compute: str | None,
) -> None:
    lines = SourceLines()
    backend = backends.current()
    unused = unused_eqns(jaxpr) if decisions else frozenset()
    # a cast at a line whose original code casts is the program's; any other is amp's
    orig = collections.Counter({k: 1 << 30 for k in decisions if k[1] == "convert_element_type"})
    seen: collections.Counter = collections.Counter()
    derived: dict[str, str] = {}
    for eqn, where, _, outer, site in iter_eqns(jaxpr, path):
        name = eqn.primitive.name
        ins = ",".join(str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))
        outs = ",".join(str(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype"))
        stack = full_stack(eqn, outer)
        # a kept op's reason travels in its name stack (through grad too), but for a
        # cast (amp's or the program's) and an op of an attention left as written
        # (the rule of its dtype, then the attention's): explain's reason for both
        # (an op a rule of Policy.rules decided: the rule, from the plan's decisions)
        kept = None if decision.has_rule_scope(stack) else decision.from_stack(stack, backend)
        decided = bool(decisions) and compute is not None and _is_float(eqn)
        if decided and kept is not None and not _fits_scope(kept.text, eqn, compute or ""):
            kept = None  # (a scope of an enclosing op or function: the op's own decision)
        why = kept.text if kept is not None else ""
        if decided and kept is not None and (is_float_cast(eqn) or _left_as_written(stack)):
            why = ""
        if not why and decided:
            why = row_reason(
                decisions,
                eqn,
                stack,
                orig,
                seen,
                lines(site),
                derived,
                compute_dtype=compute,
                dead=id(eqn) in unused,
            )
        counts[(name, ins, outs, _user_path(where), why)] += 1


#: primitives JAX wraps code in that the user did not write as such (a custom
#: derivative, amp's own lowered matmul, a call JAX adds): not shown in ``inside``
_WRAPPERS = compat.CUSTOM_JVP_NAMES | compat.CUSTOM_VJP_NAMES | {"closed_call", "core_call"}


def _user_path(where: str) -> str:
    """The enclosing primitives of ``where`` that the user wrote (loops, conds,
    jits, checkpoints), without JAX's wrappers (`_WRAPPERS`); ``-`` if none."""
    return "/".join(p for p in where.split("/") if p and p not in _WRAPPERS) or "-"


def _fits_scope(reason: str, eqn: compat.Eqn, compute: str) -> bool:
    """Whether the reason of a scope ``eqn`` is in is its own: it names no dtype
    ``eqn`` did not run in (a float32 op of a low matmul's backward), and a
    matmul's operands agree with it (`fits`)."""
    claim = claimed_dtype(reason, compute)
    ran = ran_in(eqn).split("->")[-1].split(",")
    return (claim is None or ran == ["-"] or claim in ran) and fits(reason, eqn, compute)


def _left_as_written(stack: str) -> bool:
    """Whether ``stack`` is an attention's that amp left as written (not fused)."""
    path = decision.attention_from_stack(stack)
    return path is not None and path.impl is None


def _is_float(eqn: compat.Eqn) -> bool:
    return is_float_cast(eqn) or bool(float_dtypes(eqn.invars) or float_dtypes(eqn.outvars))


def dtype_report(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | DTypeLike | None = None,
    grad: bool | int | tuple[int, ...] = False,
    has_aux: bool = False,
    **kwargs: Any,
) -> list[tuple[str, str, str, str, int, str]]:
    """Which primitives ran with which dtypes when calling ``fn(*args, **kwargs)``.

    Traces ``fn`` and walks the resulting jaxpr, including every sub-jaxpr
    (``scan`` bodies, ``cond`` branches, ``custom_vjp`` calls, ...). It takes
    the same function and options as [`amp_jax.explain`][amp_jax.explain]: the float32
    function with ``policy=``, or an [`amp_jax.amp`][amp_jax.amp]-wrapped one, and
    ``grad=True`` for the training step's backward pass. Any other function
    (``jax.grad(amp(f))``) is traced as it is.

    Args:
      fn: the function to inspect: a float32 function (with ``policy``), an
        [`amp_jax.amp`][amp_jax.amp]-wrapped one, or any function of arrays.
      *args: its positional arguments.
      policy: run ``fn`` under ``amp`` with this policy (an amp function's own
        policy is replaced); ``None``: ``fn`` as given.
      grad: ``True`` (or argnums) to report ``jax.value_and_grad`` of ``fn``
        w.r.t. those arguments, backward pass included.
      has_aux: ``fn`` returns ``(loss, aux)``, as for ``jax.value_and_grad``;
        only the loss's computation is differentiated.
      **kwargs: its keyword arguments.

    Array leaves of the arguments are traced; other leaves (a mode string, a
    callable) are passed as they are, as [`amp_jax.amp`][amp_jax.amp] passes them.

    Returns:
      Rows ``(primitive, input dtypes, output dtypes, enclosing primitives (loops,
      conds, jits: not the custom-derivative wrappers JAX adds),
      count, why)``, sorted by primitive name. ``why`` is the rule that gave
      the op its dtype, as [`explain`][amp_jax.explain] words it: its class
      under the policy, the painting, a cast amp inserted, or why amp kept it
      in its original precision (a float64/complex operand, an explicit
      ``precision=``, too small to pay, a ``full_precision`` scope); empty for
      an op no amp function decided (outside one, or no float operand).

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import amp, dtype_report
      >>> a, b = jnp.ones((64, 64)), jnp.ones((64, 64))  # 2x2 is too small to pay
      >>> rows = dtype_report(lambda a, b: a @ b, a, b, policy="bfloat16")
      >>> [r[:3] for r in rows if r[0] == "dot_general"]
      [('dot_general', 'bfloat16,bfloat16', 'float32')]
      >>> rows == dtype_report(amp(lambda a, b: a @ b), a, b)
      True
    """
    g = check_grad(grad)
    if policy is not None or isinstance(fn, AmpFunction):
        base, pol = split_fn(fn, policy)
        base, args, g = model_as_argument(base, args, g)
        fn = AmpFunction(loss_of(base, has_aux, "dtype_report", g is not None), pol)
    else:
        fn, args, g = model_as_argument(fn, args, g)
        fn = loss_of(fn, has_aux, "dtype_report", g is not None)
    # Array leaves are traced; the others (a mode string, a callable) are
    # passed as they are, as amp passes them.
    run, dyn = flat_call(fn, args, kwargs, g)
    with recording_traces() as traces:  # the plans of the amp functions it calls
        closed = jax.make_jaxpr(run)(*dyn)
    policies = {t.ctx.policy.compute_dtype.name for t in traces}
    compute = policies.pop() if len(policies) == 1 else None
    counts: collections.Counter = collections.Counter()
    _walk(compat.jaxpr_of(closed), counts, "", decisions_of_traces(traces), compute)
    return sorted(
        ((*k[:4], n, k[4]) for k, n in counts.items()), key=lambda r: (r[0], r[3], r[1], r[5])
    )


def format_dtype_report(rows: list[tuple[str, str, str, str, int, str]]) -> str:
    """Formats [`dtype_report`][amp_jax.dtype_report] rows as an aligned text table."""
    header = ("primitive", "inputs", "outputs", "inside", "count", "why")
    table = [header, *[(a, b, c, d, str(n), *rest) for a, b, c, d, n, *rest in rows]]
    table = [r if len(r) == 6 else (*r, "") for r in table]
    widths = [max(len(r[i]) for r in table) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)
