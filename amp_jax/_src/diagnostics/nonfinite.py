"""Finding where low precision overflowed: the first op whose result became inf or NaN.

[`first_nonfinite`][amp_jax.debug.first_nonfinite] traces the program [`amp`][amp_jax.amp] runs and the original
one (``jax.make_jaxpr``) and evaluates both eagerly, eqn by eqn (``scan``,
``while``, ``cond`` and call-like primitives such as ``jit``, ``checkpoint``,
``custom_jvp``/``custom_vjp`` are entered, so the op found is a first-order
one with its source line). ``jax.experimental.checkify``'s ``nan_checks``
would stop at the first NaN only, not at the overflow to inf that precedes it
in float16, and does not know the float32 program; ``jax_debug_nans`` the
same. (What float16 keeps of float32 gradients: `underflow.py`.)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.calling import Call
from amp_jax._src.diagnostics.probe import (
    Hit,
    Probe,
    Stop,
    is_finite,
    is_float_array,
    max_abs,
    run_closed,
)
from amp_jax._src.diagnostics.reasons import (
    Decisions,
    decisions_of,
    is_backward,
    ran_in,
    row_reason,
    scope_of,
)
from amp_jax._src.diagnostics.tracing import (
    check_grad,
    loss_of,
    model_as_argument,
    program,
    split_fn,
)
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction


@dataclasses.dataclass(frozen=True)
class FirstNonfinite:
    """The first op whose output became inf or NaN (see [`first_nonfinite`][amp_jax.debug.first_nonfinite]).

    Attributes:
      where: its source line, ``file:line:col (function)``.
      scope: its ``named_scope`` path (``-`` when none).
      backward: whether it belongs to the backward pass.
      primitive: the JAX primitive (``convert_element_type`` for a cast to a
        low-precision dtype that overflowed).
      cast_of: for a cast, the source line and primitive of the op whose
        (float32) result did not fit (``where`` is then that op's line too);
        None otherwise.
      dtype: the dtype it ran in (``a->b`` for a cast).
      kind: ``"inf"``, ``"nan"`` or ``"inf and nan"``.
      input_max_abs: the largest finite magnitude among its inputs.
      dtype_max: the largest finite value of its output dtype.
      float32_max_abs: the largest magnitude the same source line's ops reached
        in the original float32 program (None when unknown).
      float32_finite: whether the original program stayed finite there.
      decision: amp's decision for the op (for a cast: for the op whose
        result it casts), with its reason, as [`explain`][amp_jax.explain] states it.
      fix: what to do about it, in words.
    """

    where: str
    scope: str
    backward: bool
    primitive: str
    cast_of: str | None
    dtype: str
    kind: str
    input_max_abs: float | None
    dtype_max: float
    float32_max_abs: float | None
    float32_finite: bool
    decision: str
    fix: str

    def __str__(self) -> str:
        if self.primitive == "input":
            return "\n".join(
                [
                    f"first non-finite value ({self.kind}) at {self.where}, before any op ran",
                    f"  fix: {self.fix}",
                ]
            )
        f32 = (
            "unknown"
            if self.float32_max_abs is None
            else f"max |x| = {self.float32_max_abs:.4g}"
            + ("" if self.float32_finite else ", non-finite too")
        )
        ins = "-" if self.input_max_abs is None else f"{self.input_max_abs:.4g}"
        return "\n".join(
            [
                f"first non-finite value ({self.kind}) at {self.where}",
                f"  op: {self.primitive} in {self.dtype} ({'backward' if self.backward else 'forward'} pass, "
                f"scope {self.scope})"
                + (f", casting the result of {self.cast_of}" if self.cast_of else ""),
                f"  largest finite input |x| = {ins}; the output dtype's finite range is +-{self.dtype_max:.4g}",
                f"  the float32 program at this line: {f32}",
                f"  amp's decision: {self.decision}",
                f"  fix: {self.fix}",
            ]
        )


def _fix_text(
    prim: str,
    where: str,
    dtype: str,
    backward: bool,
    f32_finite: bool,
    f32_max: float | None,
    dtype_max: float,
    cast: bool,
) -> str:
    if not f32_finite:
        return (
            "the float32 program is non-finite here too: this is not a precision problem "
            "(check the inputs, the learning rate, a log or division of 0)."
        )
    low = dtype.split("->")[-1]
    if backward:
        return (
            f"the backward pass overflowed {low}: lower the loss scale (amp_jax.optim."
            "dynamic_loss_scale skips such a step and halves the scale; a static scale must be "
            f"smaller), or keep the forward code at {where} in float32 with amp_jax.full_precision."
        )
    fits = f32_max is not None and f32_max <= dtype_max
    ranges = (
        f"the values reach {f32_max:.4g} in float32, beyond {low}'s {dtype_max:.4g}; "
        if f32_max is not None and not fits
        else ""
    )
    override = (
        "" if cast else f"or make the op float32 with Policy(overrides={{{prim!r}: 'deny'}}), "
    )
    what = "its result and the ops that read it" if cast else "the code"
    return (
        f"{ranges}wrap {what} at {where} in amp_jax.full_precision (or "
        f"Policy(full_precision_scopes=...) with a jax.named_scope), {override}"
        "or use policy='bfloat16' (float32's range); "
        "scaling the values down (e.g. by 1/sqrt(d) before a matmul) also helps."
    )


def first_nonfinite(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | DTypeLike | None = None,
    grad: bool | int | tuple[int, ...] = False,
    has_aux: bool = False,
    **kwargs: Any,
) -> FirstNonfinite | None:
    """Runs the program [`amp`][amp_jax.amp] makes of ``fn`` and finds its first non-finite op.

    Both the rewritten and the original float32 program are traced and
    evaluated eagerly, op by op, entering ``scan``/``while``/``cond`` bodies
    and ``jit``/``checkpoint``/``custom_jvp``/``custom_vjp`` calls. The first
    first-order op whose floating outputs hold an inf or NaN while its inputs
    were finite is reported with its source line, the dtype it ran in, the
    value range its source line reached in float32, and a fix. Meant for
    debugging: every op is dispatched separately (slow for big programs;
    shrink the batch first).

    Args:
      fn: the float32 function, or an [`amp`][amp_jax.amp]-wrapped one (whose policy
        is used unless ``policy`` is given).
      *args: its positional arguments (concrete arrays).
      policy: the policy (default: ``fn``'s, else ``"float16"``).
      grad: ``True`` or argnums: run ``jax.value_and_grad`` of ``fn`` (a
        non-scalar output is summed), to also search the backward pass.
      has_aux: as in ``jax.value_and_grad``: ``fn`` returns ``(loss, aux)``;
        only the loss is searched.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A [`FirstNonfinite`][amp_jax.debug.FirstNonfinite], or ``None`` when every value,
      the arguments' included, stayed finite. An argument that already holds an
      inf or NaN is reported as such (``primitive="input"``, ``where`` naming
      the argument and the first bad index): not a precision problem.

    Raises:
      TypeError: ``fn`` is not callable or ``grad`` is not a bool/int/tuple.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import Policy, debug
      >>> f16 = Policy(jnp.float16, allow_outputs="float32")  # float32 matmul results, as on CPU
      >>> def f(x, w):
      ...     h = x @ w                    # 16 * 100 * 50 = 80000 > float16's 65504
      ...     return jnp.sum(h @ w)
      >>> x, w = jnp.full((2, 16), 100.0), jnp.full((16, 16), 50.0)
      >>> found = debug.first_nonfinite(f, x, w, policy=f16)
      >>> found.primitive, found.dtype, found.float32_finite
      ('convert_element_type', 'float32->float16', True)
      >>> debug.first_nonfinite(f, x / 100, w, policy=f16) is None
      True
    """
    base, pol = split_fn(fn, policy, default="float16")
    base, args, g = model_as_argument(base, args, check_grad(grad))
    if (bad := _nonfinite_input(base, args, kwargs)) is not None:
        return bad
    base = loss_of(base, has_aux, "first_nonfinite", g is not None)
    old, dyn = program(base, args, kwargs, g)
    new, _ = program(AmpFunction(base, pol), args, kwargs, g)
    probe = Probe(stop_at_first=True)
    try:
        run_closed(new, dyn, (), probe)
    except Stop:
        pass
    if probe.first is None:
        return None
    ref = Probe(stop_at_first=False)
    run_closed(old, dyn, (), ref)
    # the plan's decision for the op (a cast's: the op whose result it casts)
    decisions = decisions_of(base, pol, args, kwargs)
    return _found(probe.first, ref, decisions)


def _nonfinite_input(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> FirstNonfinite | None:
    """The report of the first argument leaf that holds an inf or NaN, or None.

    NaN in the data is among the commonest causes of a NaN loss, and no op
    of the program makes it: the first non-finite value is the input itself.
    """
    call = Call.of(fn, args, kwargs)
    paths = jax.tree_util.tree_flatten_with_path((call.args, call.kwargs))[0]
    for (path, leaf), dyn in zip(paths, call.dynamic_mask):
        if not (dyn and is_float_array(leaf)) or is_finite(leaf):
            continue
        x = np.asarray(leaf)
        kinds = [k for k, f in (("inf", np.isinf), ("nan", np.isnan)) if f(x).any()]
        first = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        name = call.path_name(path)
        at = f"{name}[{', '.join(map(str, first))}]" if first else name
        return FirstNonfinite(
            where=f"argument `{at}`",
            scope="-",
            backward=False,
            primitive="input",
            cast_of=None,
            dtype=str(x.dtype),
            kind=" and ".join(kinds),
            input_max_abs=max_abs([leaf]),
            dtype_max=float(jnp.finfo(x.dtype).max),
            float32_max_abs=None,
            float32_finite=False,
            decision="none: the value was non-finite before any op ran",
            fix=(
                f"the argument `{name}` holds {' and '.join(kinds)} (first at `{at}`): this "
                "is not a precision problem; check the data pipeline or the previous step "
                "(for instance with jnp.isfinite on the batch before the step)."
            ),
        )
    return None


def _float32_range(ref: Probe, key: tuple[str, str]) -> tuple[float | None, bool]:
    """``(max |x|, finite)`` that the float32 program reached at ``key``'s op, else
    at its source line (``(None, True)`` when it ran nothing there)."""
    same = ref.ranges.get(key)
    line = [r for (w, _), r in ref.ranges.items() if w == key[0]]
    if same is None and line:
        same = [max(r[0] for r in line), any(r[1] for r in line)]
    return (same[0], not same[1]) if same else (None, True)


def _found(hit: Hit, ref: Probe, decisions: Decisions) -> FirstNonfinite:
    """The report of ``hit``, beside the float32 run ``ref`` and amp's decisions."""
    eqn, stack, src = hit.eqn, hit.stack, hit.src
    where, prim = compat.source_line(eqn), eqn.primitive.name
    cast_of = None
    key = (where, prim)
    if src is not None:
        key = (compat.source_line(src), src.primitive.name)
        where, cast_of = key[0], f"{src.primitive.name} at {key[0]}"
    f32_max, f32_finite = _float32_range(ref, key)
    dtype_max = float(jnp.finfo(hit.out_dtype).max)
    backward = is_backward(stack)
    dtype = ran_in(eqn)
    empty: collections.Counter[tuple[Any, ...]] = collections.Counter()
    decided = row_reason(decisions, eqn if src is None else src, stack, empty, empty)
    if src is not None:
        low = dtype.split("->")[-1]
        decided = (
            f"a cast amp inserted: an op reads {src.primitive.name}'s result in {low} ({decided})"
        )
    return FirstNonfinite(
        where=where,
        scope=scope_of(stack),
        backward=backward,
        primitive=prim,
        cast_of=cast_of,
        dtype=dtype,
        kind=hit.kind,
        input_max_abs=hit.input_max_abs,
        dtype_max=dtype_max,
        float32_max_abs=f32_max,
        float32_finite=f32_finite,
        decision=decided,
        fix=_fix_text(
            prim, where, dtype, backward, f32_finite, f32_max, dtype_max, src is not None
        ),
    )
