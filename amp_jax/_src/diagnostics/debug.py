"""Finding where low precision overflowed or underflowed.

[`first_nonfinite`][amp_jax.debug.first_nonfinite] traces the program [`amp`][amp_jax.amp] runs and the original
one (``jax.make_jaxpr``) and evaluates both eagerly, eqn by eqn (``scan``,
``while``, ``cond`` and call-like primitives such as ``jit``, ``checkpoint``,
``custom_jvp``/``custom_vjp`` are entered, so the op found is a first-order
one with its source line). ``jax.experimental.checkify``'s ``nan_checks``
would stop at the first NaN only, not at the overflow to inf that precedes it
in float16, and does not know the float32 program; ``jax_debug_nans`` the
same. [`underflow_report`][amp_jax.debug.underflow_report] compares float32 gradients with what float16
keeps of them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from amp_jax._src import compat, jaxprs
from amp_jax._src.calling import Call
from amp_jax._src.diagnostics.reasons import (
    Decisions,
    decisions_of,
    full_stack,
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
from amp_jax._src.policy import Policy, is_managed_float
from amp_jax._src.transform import AmpFunction


class _Stop(Exception):
    pass


def _is_float_array(x: object) -> bool:
    return hasattr(x, "dtype") and is_managed_float(x.dtype)


def _finite(x: jax.Array) -> bool:
    return bool(jnp.all(jnp.isfinite(x)))


def _max_abs(xs: Sequence[Any]) -> float | None:
    vals = [
        float(jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0).astype(jnp.float32)))
        for x in xs
        if _is_float_array(x) and x.size
    ]
    return max(vals) if vals else None


@dataclasses.dataclass(frozen=True)
class _Hit:
    """The first op whose output became non-finite while its inputs were finite."""

    eqn: Any
    src: Any  # for a cast: the first-order eqn whose result it casts, else None
    stack: str
    kind: str  # "inf", "nan" or "inf and nan"
    input_max_abs: float | None
    out_dtype: str


class _Probe:
    """Watches every first-order eqn's outputs during an eager evaluation."""

    def __init__(self, stop_at_first: bool):
        self.stop_at_first = stop_at_first
        self.first: _Hit | None = None
        #: (source line, primitive) -> [max |finite output|, any non-finite output]
        self.ranges: dict[tuple[str, str], list[Any]] = {}
        #: id(value) -> (value, the first-order eqn that produced it), to trace
        #: a cast back to the op whose result it casts (values keep their
        #: identity through calls and bodies; the value is kept alive with it)
        self.producer: dict[int, tuple[Any, Any]] = {}

    def check(
        self, eqn: compat.Eqn, stack: str, invals: Sequence[Any], outs: Sequence[Any]
    ) -> None:
        floats = [o for o in outs if _is_float_array(o)]
        if not floats:
            return
        key = (compat.source_line(eqn), eqn.primitive.name)
        finite = all(_finite(o) for o in floats)
        entry = self.ranges.setdefault(key, [0.0, False])
        entry[0] = max(entry[0], _max_abs(floats) or 0.0)
        entry[1] = entry[1] or not finite
        if finite or self.first is not None:
            return
        if not all(_finite(x) for x in invals if _is_float_array(x)):
            return  # propagated from an earlier op
        bad = next(o for o in floats if not _finite(o))
        kinds = [k for k, f in (("inf", jnp.isinf), ("nan", jnp.isnan)) if bool(jnp.any(f(bad)))]
        src = None
        if eqn.primitive.name == "convert_element_type" and invals:
            src = self.producer.get(id(invals[0]), (None, None))[1]
        self.first = _Hit(
            eqn=eqn,
            src=src,
            stack=stack,
            kind=" and ".join(kinds),
            input_max_abs=_max_abs(invals),
            out_dtype=str(bad.dtype),
        )
        if self.stop_at_first:
            raise _Stop


def _run_closed(
    closed: compat.ClosedJaxpr, args: Sequence[Any], stack: tuple[str, ...], probe: _Probe
) -> list[Any]:
    """``closed`` evaluated eagerly on ``args``, every first-order eqn's outputs
    checked by ``probe`` (``stack``: the name stacks of the enclosing eqns)."""

    def probing(i: int, eqn: compat.Eqn, env: jaxprs.Env) -> Sequence[Any]:
        invals = env.operands(eqn)
        outs = _unrolled(eqn, invals, (*stack, str(eqn.source_info.name_stack)), probe)
        if outs is None:
            outs = compat.bind_eqn(eqn, invals)
            probe.check(eqn, full_stack(eqn, stack), invals, outs)
        for o in outs:
            probe.producer.setdefault(id(o), (o, eqn))
        return outs

    jaxpr, consts = jaxprs.open_jaxpr(closed)
    return jaxprs.eval_jaxpr(jaxpr, consts, args, probing)


def _unrolled(
    eqn: compat.Eqn, invals: list[Any], stack: tuple[str, ...], probe: _Probe
) -> list[Any] | None:
    """A higher-order eqn evaluated eagerly by running its bodies through
    `_run_closed` (a loop's body once per iteration, the taken branch of a
    ``cond``, a call's body), so that the probe sees their first-order eqns;
    None for a first-order eqn or one not entered (it is then bound whole).
    ``scan``/``while``/``cond`` would trace their bodies abstractly if bound."""
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        nc, ncarry = compat.scan_split(p)
        length = int(p["length"])
        if length == 0:
            return None
        consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        ys: list[list[Any]] = []
        for i in reversed(range(length)) if p.get("reverse") else range(length):
            outs = _run_closed(p["jaxpr"], [*consts, *carry, *(x[i] for x in xs)], stack, probe)
            carry, y = outs[:ncarry], outs[ncarry:]
            ys.append(y)
        if p.get("reverse"):
            ys.reverse()
        stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys and ys[0] else []
        return [*carry, *stacked]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        while bool(_run_closed(p["cond_jaxpr"], [*cconsts, *carry], stack, probe)[0]):
            carry = _run_closed(p["body_jaxpr"], [*bconsts, *carry], stack, probe)
        return carry
    if name == "cond":
        index = int(invals[0])
        return _run_closed(p["branches"][index], invals[1:], stack, probe)
    sub = jaxprs.called_jaxpr(eqn)  # jit, checkpoint, custom_jvp/vjp calls, closed_call
    return None if sub is None else _run_closed(sub, invals, stack, probe)


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
    probe = _Probe(stop_at_first=True)
    try:
        _run_closed(new, dyn, (), probe)
    except _Stop:
        pass
    if probe.first is None:
        return None
    ref = _Probe(stop_at_first=False)
    _run_closed(old, dyn, (), ref)
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
        if not (dyn and _is_float_array(leaf)) or _finite(leaf):
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
            input_max_abs=_max_abs([leaf]),
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


def _float32_range(ref: _Probe, key: tuple[str, str]) -> tuple[float | None, bool]:
    """``(max |x|, finite)`` that the float32 program reached at ``key``'s op, else
    at its source line (``(None, True)`` when it ran nothing there)."""
    same = ref.ranges.get(key)
    line = [r for (w, _), r in ref.ranges.items() if w == key[0]]
    if same is None and line:
        same = [max(r[0] for r in line), any(r[1] for r in line)]
    return (same[0], not same[1]) if same else (None, True)


def _found(hit: _Hit, ref: _Probe, decisions: Decisions) -> FirstNonfinite:
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


@dataclasses.dataclass(frozen=True)
class UnderflowRow:
    """Underflow of one gradient leaf (see [`underflow_report`][amp_jax.debug.underflow_report]).

    Attributes:
      path: the leaf's path in the parameters (``jax.tree_util.keystr``).
      nonzero: how many of its float32 gradient values are nonzero.
      flushed: share of those that become 0 when the scaled float32 gradient
        is stored in the low dtype.
      subnormal: share that land in the low dtype's subnormal range (fewer
        significant bits).
      lost_in_amp: share that are 0 in the gradient the amp program computed
        (scaled, then unscaled in float32) where float32 has a nonzero value.
      max_abs: the largest float32 gradient magnitude (unscaled).
    """

    path: str
    nonzero: int
    flushed: float
    subnormal: float
    lost_in_amp: float
    max_abs: float


@dataclasses.dataclass(frozen=True)
class UnderflowReport:
    """What [`underflow_report`][amp_jax.debug.underflow_report] returns.

    Attributes:
      dtype: the low-precision dtype.
      loss_scale: the loss scale that was applied.
      rows: one [`UnderflowRow`][amp_jax.debug.UnderflowRow] per floating gradient leaf.
      flushed: share of all nonzero float32 gradient values that flush to 0.
      lost_in_amp: share of them that are 0 in the amp program's gradient.
      suggested_scale: a power of two that puts the largest gradient a factor
        of 2 below the dtype's maximum (a starting point: activation
        gradients inside the backward pass can be larger).
    """

    dtype: str
    loss_scale: float
    rows: list[UnderflowRow]
    flushed: float
    lost_in_amp: float
    suggested_scale: float

    def __str__(self) -> str:
        width = max([len(r.path) for r in self.rows] + [9])
        lines = [
            f"{'parameter':<{width}}  {'nonzero':>9}  {'flushed':>8}  {'subnorm':>8}  "
            f"{'lost amp':>8}  {'max |g|':>9}"
        ]
        for r in self.rows:
            lines.append(
                f"{r.path:<{width}}  {r.nonzero:>9}  {100 * r.flushed:>7.2f}%  "
                f"{100 * r.subnormal:>7.2f}%  {100 * r.lost_in_amp:>7.2f}%  {r.max_abs:>9.3g}"
            )
        lines.append(
            f"{self.dtype}, loss scale {self.loss_scale:g}: {100 * self.flushed:.2f}% of nonzero "
            f"float32 gradient values flush to 0 in {self.dtype}; {100 * self.lost_in_amp:.2f}% are "
            f"0 in the amp gradient; suggested loss scale {self.suggested_scale:g}"
        )
        return "\n".join(lines)


class _LeafCounts(NamedTuple):
    """Counts of one gradient leaf's values (what an `UnderflowRow` reports as shares)."""

    path: str
    nonzero: int
    flushed: int
    subnormal: int
    lost: int
    max_abs: float

    def row(self) -> UnderflowRow:
        n = self.nonzero
        share = lambda k: k / n if n else 0.0  # noqa: E731
        return UnderflowRow(
            self.path, n, share(self.flushed), share(self.subnormal), share(self.lost), self.max_abs
        )


def _leaf_counts(
    path: compat.KeyPath, a: ArrayLike, b: ArrayLike, scale: float, low: DTypeLike, tiny: float
) -> _LeafCounts:
    """Counts of float32 gradient ``a`` against its ``low`` storage (scaled by
    ``scale``) and against the amp program's gradient ``b``."""
    a32 = jnp.asarray(a, jnp.float32)
    nz = a32 != 0
    scaled = a32 * scale
    stored = scaled.astype(low)
    return _LeafCounts(
        jax.tree_util.keystr(path) or "(params)",
        int(jnp.sum(nz)),
        int(jnp.sum(nz & (stored == 0))),
        int(jnp.sum(nz & (stored != 0) & (jnp.abs(scaled) < tiny))),
        int(jnp.sum(nz & (jnp.asarray(b, jnp.float32) == 0))),
        float(jnp.max(jnp.abs(a32))) if a32.size else 0.0,
    )


def underflow_report(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    policy: Policy | str | DTypeLike = "float16",
    loss_scale: float = 1.0,
    **kwargs: Any,
) -> UnderflowReport:
    """How much of a loss's gradient the low-precision dtype flushes to zero.

    Computes the float32 gradient of ``loss_fn`` with respect to ``params``
    and, per leaf, the share of its nonzero values that become 0 (or
    subnormal) when multiplied by ``loss_scale`` and stored in the policy's
    dtype -- what a float16 gradient without enough loss scale loses -- and
    the share that is 0 in the gradient the amp program computes with the
    same scale (unscaled in float32 afterwards).

    Args:
      loss_fn: the float32 loss (or an [`amp`][amp_jax.amp]-wrapped one), returning
        a scalar; ``params`` is its first argument.
      params: the parameters (a pytree of float32 arrays).
      *args: the other positional arguments of ``loss_fn``.
      policy: the policy of the amp program (default ``"float16"``).
      loss_scale: the loss scale to evaluate (> 0), e.g. the value
        [`amp_jax.optim.loss_scale`][amp_jax.optim.loss_scale] returns.
      **kwargs: keyword arguments of ``loss_fn``.

    Returns:
      An [`UnderflowReport`][amp_jax.debug.UnderflowReport] (print it for a table).

    Raises:
      ValueError: ``loss_scale`` is not a finite positive number.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import debug
      >>> loss = lambda w, x: 1e-7 * jnp.sum(x @ w)
      >>> w, x = jnp.ones((4, 2)), jnp.full((3, 4), 1e-2)
      >>> debug.underflow_report(loss, w, x).flushed
      1.0
      >>> debug.underflow_report(loss, w, x, loss_scale=2.0**12).flushed
      0.0
    """
    scale = float(loss_scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"loss_scale must be a finite number > 0, got {loss_scale!r}; e.g. 2.0**12."
        )
    base, pol = split_fn(loss_fn, policy)
    low = pol.compute_dtype
    g32 = jax.grad(lambda p: jnp.asarray(base(p, *args, **kwargs), jnp.float32))(params)
    amp_loss = AmpFunction(base, pol)
    gamp = jax.grad(lambda p: jnp.asarray(amp_loss(p, *args, **kwargs), jnp.float32) * scale)(
        params
    )
    info = jnp.finfo(low)
    counts = [
        _leaf_counts(path, a, b, scale, low, float(info.tiny))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g32), jax.tree.leaves(gamp))
        if _is_float_array(a)
    ]
    rows = [c.row() for c in counts]
    tot_nz = sum(c.nonzero for c in counts)
    tot_flushed = sum(c.flushed for c in counts)
    tot_lost = sum(c.lost for c in counts)
    max_all = max([0.0, *(c.max_abs for c in counts)])
    if max_all > 0:
        suggested = float(2.0 ** np.clip(np.floor(np.log2(float(info.max) / max_all)) - 1, 0, 24))
    else:
        suggested = 1.0
    return UnderflowReport(
        str(np.dtype(low)),
        scale,
        rows,
        tot_flushed / tot_nz if tot_nz else 0.0,
        tot_lost / tot_nz if tot_nz else 0.0,
        suggested,
    )
