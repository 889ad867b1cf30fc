"""Rewriting a jaxpr under a mixed-precision policy.

:func:`rewrite` (and :func:`evaluate`, its eager form) run the same pipeline
for the top-level jaxpr and every sub-jaxpr:

1. *Prepare* (:meth:`Context.prepare`): inline ``jit`` eqns that carry no
   shardings, so that the analysis sees through ``jax.nn``/``jnp`` helpers
   that are jitted internally.
2. *Plan* (:func:`plan`): give every eqn a class (allow / deny /
   follow / clear, or kept high with a reason: :meth:`Context.classify`) and
   a color -- ``low`` (compute dtype), ``high`` (float32) or ``orig`` (its
   original dtypes) -- with the pure painting of ``painting.py`` (after
   TensorFlow's auto-mixed-precision pass), keep the values that decide
   control flow out of the compute dtype, and find the attentions that run
   fused (``attention.py``).
3. *Evaluate*: bind every eqn under the caller's trace through its rule in
   the primitive-keyed table of ``rules.py`` (:func:`rule_for`). A rule casts
   its operands (:mod:`casting`: each (value, dtype) cast is made once and
   shared) and says which operands it reads only in the compute dtype.
   Higher-order primitives get their sub-jaxprs rewritten with the same
   policy and keep their boundary dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import attention, casting, compat, float8, painting, rules
from amp_jax._src.painting import KEEP, LOW, OPAQUE, ORIG, SKIP
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, is_managed_float, scope_in


class Context:
    """What an evaluation needs besides the jaxpr: the policy and backend."""

    def __init__(self, policy: Policy, backend: str, vjp_rules: bool = True):
        self.policy = policy
        self.backend = backend
        #: use the custom_vjp rules of allow ops; off in code JAX will transpose
        #: (custom JVP rules), where a custom_vjp cannot appear.
        self.vjp_rules = vjp_rules
        self._linear: Context | None = None
        self.identity = policy.is_identity
        self.scopes = (FULL_PRECISION_SCOPE, *policy.full_precision_scopes)
        # Everything derived from a jaxpr or an eqn is made once per context
        # (per trace of the amp function), keyed by (kind, id(object)); the
        # object is kept with its entry so that the id stays unique.
        self._memo: dict[tuple[str, int], tuple[Any, Any]] = {}
        #: (source line of the scores matmul, implementation or None, reason)
        #: for every attention recognised while rewriting (see attention.py).
        self.attention_log: list[tuple[str, str | None, str]] = []
        #: allow eqns kept in their original precision, with the reason tag
        #: (see :func:`stays_high`); bound under a ``named_scope`` of the tag
        #: so that dtype_report can say why.
        self.kept_high: dict[int, str] = {}
        #: low allow eqns whose results decide control flow: they write float32.
        self.f32_out: set[int] = set()
        #: {id(closed sub-jaxpr): (it, output positions that decide control flow)}
        self._decides: dict[int, tuple[Any, frozenset[int]]] = {}
        #: {id(closed loop body): (it, output positions carried to the next iteration)}
        self._carries: dict[int, tuple[Any, frozenset[int]]] = {}

    def cached(self, kind: str, obj: Any, make: Any) -> Any:
        """``make()``, computed once per ``obj`` (by identity) and ``kind``."""
        key = (kind, id(obj))
        hit = self._memo.get(key)
        if hit is None or hit[0] is not obj:
            hit = self._memo[key] = (obj, make())
        return hit[1]

    @property
    def linear(self) -> Context:
        """This context without the custom_vjp rules (for JVP-rule jaxprs)."""
        if not self.vjp_rules:
            return self
        if self._linear is None:
            self._linear = Context(self.policy, self.backend, vjp_rules=False)
        return self._linear

    def prepare(self, closed: Any) -> Any:
        """Inlines sharding-free jits (not under the identity policy, which keeps
        the structure exactly so that results stay bitwise equal). Once per
        ``closed``: the eqns keep their identity for the per-eqn records."""
        if self.identity:
            return closed
        return self.cached("prepare", closed, lambda: inline_jits(closed))

    def decides(self, closed: Any) -> frozenset[int]:
        """Output positions of sub-jaxpr ``closed`` that decide control flow."""
        hit = self._decides.get(id(closed))
        return hit[1] if hit is not None and hit[0] is closed else frozenset()

    def mark_decides(self, closed: Any, outs: Iterable[int]) -> None:
        self._decides[id(closed)] = (closed, self.decides(closed) | frozenset(outs))

    def carries(self, closed: Any) -> frozenset[int]:
        """Output positions of loop body ``closed`` that are carried to its next iteration."""
        hit = self._carries.get(id(closed))
        return hit[1] if hit is not None and hit[0] is closed else frozenset()

    def mark_carries(self, closed: Any, outs: Iterable[int]) -> None:
        self._carries[id(closed)] = (closed, self.carries(closed) | frozenset(outs))

    # -- classification -------------------------------------------------
    def classify(self, eqn: Any) -> str:
        sub = compat.has_subjaxprs(eqn)
        if self.identity or self.in_full_precision(eqn):
            # (everything an eqn in a full_precision scope holds is in it too)
            return KEEP if sub else "never"
        avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
        if not any(is_managed_float(getattr(a, "dtype", None)) for a in avals):
            return OPAQUE if sub else SKIP
        if sub:
            return "follow" if self.is_transparent(eqn) else OPAQUE
        name = eqn.primitive.name
        cls = self.policy.effective_class_of(name, self.backend)
        if cls is None:
            if self.policy.strict:
                raise NotImplementedError(
                    f"amp_jax: primitive {name!r} has no class in the policy and "
                    "strict=True. Add it to a class, e.g. "
                    f"Policy(overrides={{{name!r}: 'follow'}})."
                )
            cls = "follow"
        if cls == "allow":
            why = stays_high(eqn, self.policy)
            if why is not None:
                self.kept_high[id(eqn)] = why  # (the eqn lives as long as its cached jaxpr)
                return "never"
            if eqn.invars and not rule_for(eqn, cls).reads_low(self, eqn, LOW, cls, eqn.invars[0]):
                # its rule runs it in float32 on this backend (XLA:CPU's batched
                # dots): recorded here, where it is decided, for explain/dtype_report
                self.kept_high[id(eqn)] = "backend_kernel"
        return cls

    def reason(self, eqn: Any) -> str | None:
        """Why this context kept ``eqn`` in its original precision, if a rule did."""
        tag = self.kept_high.get(id(eqn))
        return KEEP_REASONS[tag] if tag else float8.reason(self, eqn)

    def is_transparent(self, eqn: Any) -> bool:
        """A ``custom_jvp_call`` whose body only has follow/clear ops (``jax.nn.relu``).

        Such a call is painted like a follow op, so an activation between two
        matmuls runs in the compute dtype; its JVP rule still applies.
        """
        if eqn.primitive.name not in compat.CUSTOM_JVP_NAMES:
            return False
        body, _, n_consts = compat.custom_jvp_parts(eqn)
        if n_consts:
            return False
        return self.cached(
            "transparent",
            body,
            lambda: all(
                c in ("follow", "clear", SKIP)
                for c in (self.classify(e) for e in compat.jaxpr_of(self.prepare(body)).eqns)
            ),
        )

    def in_full_precision(self, eqn: Any) -> bool:
        return self.scope_of(eqn) is not None

    def scope_of(self, eqn: Any) -> str | None:
        """The full-precision scope (whole name) ``eqn`` is traced in, or None."""
        return scope_in(compat.name_stack_str(eqn), self.scopes)


# -- allow ops that stay in float32 ---------------------------------------------

#: reason tags of :func:`stays_high`, and what dtype_report prints for them.
KEEP_REASONS = {
    "wide_operand": "float64/complex operand: not ours to lower",
    "explicit_precision": "explicit precision=HIGH/HIGHEST (or an algorithm) asked for",
    "too_small": "too small to pay (Policy.min_low_contraction / min_low_flops)",
    "constant_range": "reads a constant the compute dtype cannot represent",
    "decides_control": "decides control flow (a while predicate or cond index reads it)",
    "loop_carry": "computes a loop-carried value: kept in the carry's dtype",
    "backend_kernel": "no low-precision kernel for it on this backend: runs in float32",
}
KEEP_SCOPE = "amp_keep_f32"


def _contraction_and_flops(eqn: Any) -> tuple[int, int] | None:
    name = eqn.primitive.name
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = int(np.prod([eqn.invars[0].aval.shape[d] for d in lc], dtype=np.int64))
    elif name == "conv_general_dilated":
        w = eqn.invars[1].aval.shape
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        k = int(np.prod(w, dtype=np.int64)) // max(int(w[rhs_spec[0]]), 1)  # in-features x window
    else:
        return None
    return k, 2 * k * int(np.prod(out.shape, dtype=np.int64))


def stays_high(eqn: Any, policy: Policy) -> str | None:
    """Why an ``allow`` eqn stays in its original precision, or None to lower it."""
    dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
    if any(
        d is not None and np.issubdtype(d, np.inexact) and not is_managed_float(d) for d in dtypes
    ):
        return "wide_operand"
    precision = eqn.params.get("precision")
    parts = precision if isinstance(precision, tuple) else (precision,)
    if any(p is not None and getattr(p, "name", str(p)) != "DEFAULT" for p in parts):
        return "explicit_precision"
    sizes = _contraction_and_flops(eqn)
    if sizes is not None and (
        sizes[0] < policy.min_low_contraction or sizes[1] < policy.min_low_flops
    ):
        return "too_small"
    if eqn.primitive.name == "dot_general" and policy.min_low_flops:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        free = [
            eqn.invars[0].aval.shape[d]
            for d in range(eqn.invars[0].aval.ndim)
            if d not in (*lc, *lb)
        ]
        free += [
            eqn.invars[1].aval.shape[d]
            for d in range(eqn.invars[1].aval.ndim)
            if d not in (*rc, *rb)
        ]
        if int(np.prod(free, dtype=np.int64)) == 1:  # a (batch of) vector-vector dot product(s)
            return "too_small"
    return None


# -- planning -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What amp decided for one (prepared) closed jaxpr, eqn by eqn."""

    closed: Any
    classes: tuple[str, ...]
    colors: tuple[str, ...]
    attention: attention.Plan

    @property
    def jaxpr(self) -> Any:
        return compat.jaxpr_of(self.closed)


_NO_ATTENTION = attention.Plan({}, [], {})


def paint_jaxpr(
    ctx: Context, jaxpr: Any, decide_outs: Iterable[int] = (), carry_outs: Iterable[int] = ()
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Classes and colors of ``jaxpr``'s eqns; ``decide_outs`` are output
    positions whose values decide control flow (a while predicate, a loop's
    carried decision), ``carry_outs`` those a loop carries to its next
    iteration (``jaxpr`` is the body)."""
    classes = [ctx.classify(e) for e in jaxpr.eqns]
    if ctx.identity:
        return tuple(classes), tuple(c if c in (OPAQUE, SKIP, KEEP) else ORIG for c in classes)
    for i in _reads_unrepresentable_constant(jaxpr, ctx.policy.compute_dtype):
        if classes[i] in ("allow", "follow", "clear"):
            classes[i] = "never"
            ctx.kept_high[id(jaxpr.eqns[i])] = "constant_range"
    colors = painting.paint(classes, jaxpr)
    seeds = painting.decision_seeds(jaxpr, decide_outs, lambda e: _loop_reads(ctx, e))
    _keep_slice(ctx, jaxpr, classes, colors, seeds, "decides_control")
    # A loop-carried float keeps its dtype through the ops that compute the
    # next carry (an EMA, an Euler step, a residual stream): rounding it in
    # every iteration compounds. The matmuls on the way still read
    # compute-dtype operands but write float32, as for decisions.
    outs = jaxpr.outvars
    carried = [outs[k] for k in carry_outs if is_managed_float(casting.dtype_of(outs[k]))]
    for i, k in _keep_slice(ctx, jaxpr, classes, colors, carried, "loop_carry"):
        for sub in _carry_bodies(jaxpr.eqns[i]):  # a cond's branches compute the carry too
            ctx.mark_carries(sub, [k])
    return tuple(classes), tuple(colors)


def _keep_slice(
    ctx: Context, jaxpr: Any, classes: Sequence[str], colors: list[str], seeds: list[Any], tag: str
) -> list[tuple[int, int]]:
    """Keeps what ``seeds`` are computed from out of the compute dtype (back
    to the matmuls, which write float32), recording ``tag`` as the reason.
    Returns the (eqn index, output position) of the higher-order eqns reached."""
    stops: list[tuple[int, int]] = []
    kept, f32_out, _ = painting.decision_slice(jaxpr, classes, colors, seeds, stops)
    for i in kept:
        if colors[i] == LOW:
            colors[i] = ORIG
            ctx.kept_high.setdefault(id(jaxpr.eqns[i]), tag)
    for i in f32_out:
        ctx.f32_out.add(id(jaxpr.eqns[i]))
        ctx.kept_high.setdefault(id(jaxpr.eqns[i]), tag)
    return stops


def _carry_bodies(eqn: Any) -> list[Any]:
    """The closed sub-jaxprs of ``eqn`` whose outputs are ``eqn``'s outputs
    (``cond`` branches, a ``jit``'s body); none for loops and custom rules."""
    if eqn.primitive.name == "cond":
        return list(eqn.params["branches"])
    if eqn.primitive.name in compat.JIT_NAMES and compat.is_closed_jaxpr(eqn.params["jaxpr"]):
        return [eqn.params["jaxpr"]]
    return []


def _reached_inputs(ctx: Context, closed: Any, outs: Iterable[int]) -> set[int]:
    """Input positions of ``closed`` that its decisions (and outputs ``outs``) read."""
    jaxpr = compat.jaxpr_of(ctx.prepare(closed))
    classes = [ctx.classify(e) for e in jaxpr.eqns]
    colors = painting.paint(classes, jaxpr)
    seeds = painting.decision_seeds(jaxpr, outs, lambda e: _loop_reads(ctx, e))
    return painting.decision_slice(jaxpr, classes, colors, seeds)[2]


def _loop_reads(ctx: Context, eqn: Any) -> list[int]:
    """Operand positions of a ``while``/``scan`` eqn whose values decide its
    control flow, through the loop's carry; marks the body's (and a while's
    predicate's) outputs that decide it, for when they are rewritten."""

    def make() -> list[int]:
        p = eqn.params
        if eqn.primitive.name == "while":
            cn, bn = compat.while_split(p)
            body, n_body_consts = p["body_jaxpr"], bn
            first = _reached_inputs(ctx, p["cond_jaxpr"], [0])
            ctx.mark_decides(p["cond_jaxpr"], [0])
            carry = {k - cn for k in first if k >= cn}
            reads = [k for k in first if k < cn]
            carry_at = cn + bn  # carry operands follow the cond and body consts
            n_out = len(eqn.outvars)
        else:  # scan: consts, carry, xs
            n_consts, n_carry = compat.scan_split(p)
            body, n_body_consts, first, reads = p["jaxpr"], n_consts, set(), []
            carry, carry_at = set(), n_consts
        body_reads: set[int] = set()
        while True:  # loop-carried: a carry read by a decision is one too
            body_reads = _reached_inputs(ctx, body, sorted(carry))
            new = carry | {k - n_body_consts for k in body_reads if k >= n_body_consts}
            if eqn.primitive.name == "scan":
                new = {k for k in new if k < n_carry}
            if new == carry:
                break
            carry = new
        if carry:
            ctx.mark_decides(body, carry)
        ctx.mark_carries(body, range(n_carry if eqn.primitive.name == "scan" else n_out))
        consts = [k for k in body_reads if k < n_body_consts]
        if eqn.primitive.name == "while":
            consts = [cn + k for k in consts]
        return sorted({*reads, *consts, *(carry_at + k for k in carry)})

    return ctx.cached("loop_reads", eqn, make)


def _unrepresentable(value: Any, dtype: np.dtype) -> bool:
    """A float constant that ``dtype`` turns into inf, 0 or a subnormal (off by more than its eps)."""
    v = np.asarray(value)
    if not np.issubdtype(v.dtype, np.floating) or v.size > 64:
        return False
    v = v.astype(np.float64)
    finite = np.isfinite(v)
    v = np.where(finite, v, 0.0)  # inf/nan constants are what they are in any dtype
    with np.errstate(all="ignore"):
        c = v.astype(dtype).astype(np.float64)
        bad = ~np.isfinite(c)
        # (more than normal rounding: flushed to zero or a subnormal's lost digits)
        bad |= (v != 0) & (np.abs(c - v) > float(jnp.finfo(dtype).eps) * np.abs(v))
    return bool(bad.any())


_CONSTANT_PASSTHROUGH = frozenset(
    {"broadcast_in_dim", "reshape", "convert_element_type", "copy", "squeeze", "expand_dims"}
)


def _reads_unrepresentable_constant(jaxpr: Any, dtype: np.dtype) -> list[int]:
    """Eqns that read a constant (a literal, or a broadcast of one) that
    ``dtype`` cannot represent: they keep their original precision."""
    if np.dtype(dtype).itemsize >= 4:
        return []
    bad: set[Any] = set()
    found = []
    for i, eqn in enumerate(jaxpr.eqns):
        reads_bad = any(
            (isinstance(v, compat.Literal) and _unrepresentable(compat.literal_value(v), dtype))
            or (not isinstance(v, compat.Literal) and v in bad)
            for v in eqn.invars
        )
        if not reads_bad:
            continue
        if eqn.primitive.name in _CONSTANT_PASSTHROUGH and len(eqn.invars) == 1:
            bad.update(eqn.outvars)  # still a constant: judged where it is used
        else:
            found.append(i)
    return found


def plan(ctx: Context, closed: Any) -> Plan:
    """The plan of closed jaxpr ``closed`` (prepared, painted, attention found), once per context."""

    def make() -> Plan:
        flat = ctx.prepare(closed)
        classes, colors = paint_jaxpr(
            ctx, compat.jaxpr_of(flat), ctx.decides(closed), ctx.carries(closed)
        )
        att = _plan_attention(ctx, flat)
        for i in (*att.skip, *att.fused):  # (an attention's own path is its reason)
            e = compat.jaxpr_of(flat).eqns[i]
            if ctx.kept_high.get(id(e)) == "backend_kernel":
                del ctx.kept_high[id(e)]
        return Plan(flat, classes, colors, att)

    return ctx.cached("plan", closed, make)


def _plan_attention(ctx: Context, closed: Any) -> attention.Plan:
    """The attentions of ``closed``: which run fused, and the named scope of each one's ops."""
    if ctx.identity or ctx.policy.attention == "off" or not ctx.vjp_rules:
        return _NO_ATTENTION
    jaxpr = compat.jaxpr_of(closed)
    consts = dict(zip(jaxpr.constvars, compat.consts_of(closed)))
    plan_ = attention.plan(
        jaxpr,
        consts,
        mode=ctx.policy.attention,
        backend=ctx.backend,
        compute_dtype=ctx.policy.compute_dtype,
        in_full_precision=ctx.in_full_precision,
    )
    ctx.attention_log.extend(plan_.log)
    return plan_


# -- evaluation -----------------------------------------------------------------


class _Env:
    """Values of a jaxpr being evaluated, and the casts made of them (each once)."""

    def __init__(self):
        self.vals: dict[Any, Any] = {}
        self.casts: dict[tuple[Any, Any], Any] = {}
        #: {var: (operand var, permutation)} of the ``transpose`` eqns evaluated
        #: (a dot reading one of them can contract the operand directly)
        self.transposes: dict[Any, tuple[Any, tuple[int, ...]]] = {}

    def write(self, v: Any, val: Any) -> None:
        if type(v).__name__ != "DropVar":
            self.vals[v] = val

    def read_broadcast(self, atom: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Reads ``atom`` broadcast to ``shape`` *before* casting it to ``dtype``.

        For an operand that a low-precision op broadcasts implicitly (a bias
        of shape [1, n] added to [b, n]): the transpose of the broadcast -- a
        sum over the batch -- then runs in the operand's float32, not bf16.
        """
        if isinstance(atom, compat.Literal) or tuple(atom.aval.shape) == tuple(shape):
            return self.read(atom, dtype)
        # Broadcast in the operand's own dtype, upcasting a value that its
        # producer already wrote low (a bias reshaped in bf16), so that the
        # backward sum accumulates in float32.
        orig = casting.dtype_of(atom)
        in_shape = tuple(atom.aval.shape)
        if (
            dtype is None
            or np.dtype(orig) == dtype
            or len(shape) != len(in_shape)
            or any(a not in (b, 1) for a, b in zip(in_shape, shape))
        ):
            return self.read(atom, dtype)
        key = (atom, dtype, tuple(shape))
        if key not in self.casts:
            val = self.read(atom, orig)
            full = lax.broadcast_in_dim(val, shape, tuple(range(val.ndim)))
            self.casts[key] = lax.convert_element_type(full, dtype)
        return self.casts[key]

    def read(self, atom: Any, dtype: Any) -> Any:
        if isinstance(atom, compat.Literal):
            val = compat.literal_value(atom)
            if dtype is not None and np.dtype(getattr(val, "dtype", type(val))) != dtype:
                return compat.cast_constant(val, dtype)
            return val
        val = self.vals[atom]
        if dtype is None or np.dtype(val.dtype) == dtype:
            return val
        key = (atom, dtype)
        if key not in self.casts:
            self.casts[key] = casting.cast(val, dtype)
        return self.casts[key]


def rewrite(ctx: Context, closed: Any, in_avals: Sequence[Any] | None = None) -> Any:
    """``closed`` rewritten under ``ctx``: a closed jaxpr with the same output
    avals, taking ``in_avals`` (default: ``closed``'s own). Once per context."""

    def make() -> Any:
        plan_ = plan(ctx, closed)
        avals = compat.in_avals(closed) if in_avals is None else in_avals
        return compat.trace_to_closed_jaxpr(lambda *a: evaluate(ctx, plan_, a), avals)

    key = "rewrite" if in_avals is None else ("rewrite", tuple(in_avals))
    return ctx.cached(key, closed, make)


def evaluate(
    ctx: Context, plan_: Plan, args: Sequence[Any], cast_outputs: bool = True
) -> list[Any]:
    """Evaluates a planned jaxpr on ``args`` under the caller's trace; outputs
    keep their dtypes (unless ``cast_outputs`` is false: then as computed)."""
    jaxpr = plan_.jaxpr
    env = _Env()
    for v, c in zip(jaxpr.constvars, compat.consts_of(plan_.closed)):
        env.write(v, c)
    for v, a in zip(jaxpr.invars, args):
        env.write(v, a)
    att = plan_.attention
    for idx, (eqn, cls, color) in enumerate(zip(jaxpr.eqns, plan_.classes, plan_.colors)):
        if idx in att.skip and idx not in att.fused:
            continue  # computed by the fused attention
        with contextlib.ExitStack() as stack:
            for m in compat.eqn_context(eqn):
                stack.enter_context(m)
            if id(eqn) in ctx.kept_high:
                stack.enter_context(jax.named_scope(f"{KEEP_SCOPE}.{ctx.kept_high[id(eqn)]}"))
            if idx in att.scopes:  # amp_attention[cudnn] / amp_attention[xla: <reason>]
                stack.enter_context(jax.named_scope(att.scopes[idx]))
            if idx in att.fused:
                match, impl = att.fused[idx]
                outs = [match.evaluate(env.read, ctx.policy.compute_dtype, impl)]
            else:
                outs = rule_for(eqn, cls).evaluate(ctx, eqn, color, cls, env)
        for v, o in zip(eqn.outvars, outs):
            env.write(v, o)
    cd = ctx.policy.compute_dtype
    return [
        env.read(v, casting.target(casting.dtype_of(v), ORIG, cd) if cast_outputs else None)
        for v in jaxpr.outvars
    ]


# -- the rules of higher-order primitives --------------------------------------------


def rule_for(eqn: Any, cls: str) -> rules.EqnRule:
    """The rule that binds ``eqn`` (of class ``cls``): its primitive's entry in
    ``rules.TABLE``, else the generic rule of higher-order primitives, the
    default ``allow`` rule, or the plain bind."""
    rule = rules.TABLE.get(eqn.primitive.name)
    if rule is not None:
        return rule
    if compat.has_subjaxprs(eqn):
        return _HIGHER_ORDER
    return _ALLOW if cls == "allow" else _BIND


class HigherOrderRule(rules.EqnRule):
    """A primitive with sub-jaxprs (``cond``, ``while``, ``remat``, ``pjit``,
    ``custom_vjp_call``, ...): unless the policy keeps it as written (a
    full_precision scope, the float32 policy), its operands keep their dtypes
    and its sub-jaxprs are rewritten with the same policy."""

    def evaluate(self, ctx: Any, eqn: Any, color: str, cls: str, env: Any) -> list[Any]:
        if color not in (OPAQUE, ORIG):
            return super().evaluate(ctx, eqn, color, cls, env)
        cd = ctx.policy.compute_dtype
        invals = [env.read(v, casting.target(casting.dtype_of(v), ORIG, cd)) for v in eqn.invars]
        return self.bind_rewritten(ctx, eqn, invals)

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        params = ctx.cached(
            "params",
            eqn,
            lambda: compat.map_subjaxprs(
                eqn,
                functools.partial(rewrite, ctx),
                functools.partial(rewrite, ctx.linear),
                functools.partial(_run_bwd, ctx),
            ),
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, color: str, cls: str, atom: Any) -> bool:
        return False


class ScanRule(HigherOrderRule):
    """``scan``: the casts of scanned-over inputs read only in the compute
    dtype are hoisted out of the loop (:func:`_plan_hoisted_casts`)."""

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        eqn = ctx.cached("masks", eqn, lambda: _with_constant_masks(eqn, invals))
        hoisted = ctx.cached("hoist", eqn, lambda: _plan_hoisted_casts(ctx, eqn))
        if not hoisted:
            return super().bind_rewritten(ctx, eqn, invals)
        hoist, new_params = hoisted
        cd = ctx.policy.compute_dtype
        invals = [casting.cast(x, cd) if i in hoist else x for i, x in enumerate(invals)]
        return compat.bind_eqn(eqn, invals, new_params)


def _with_constant_masks(eqn: Any, invals: list[Any]) -> Any:
    """``eqn`` (a scan) with its concrete boolean loop constants -- a causal mask
    closed over by the loop body -- made constants of its body, so that the
    body's plan sees their values (a constant causal mask becomes cuDNN's
    ``is_causal``, which skips the masked blocks, instead of a bias it must
    read). The operands stay; the body no longer reads them."""
    n_consts, _ = compat.scan_split(eqn.params)
    known = {
        i: x
        for i, x in enumerate(invals[:n_consts])
        if not isinstance(x, compat.Tracer) and np.dtype(x.dtype) == np.bool_
    }
    if not known:
        return eqn
    body = eqn.params["jaxpr"]
    run = compat.jaxpr_as_fun(body)
    new_body = compat.trace_to_closed_jaxpr(
        lambda *a: run(*[known.get(i, x) for i, x in enumerate(a)]), compat.in_avals(body)
    )
    return eqn.replace(params=compat.scan_params_with_body(eqn, new_body))


class ShardMapRule(HigherOrderRule):
    """``shard_map``: rebuilt as a public ``jax.shard_map`` whose body is
    evaluated under the policy (collectives need the manual-axes context)."""

    def bind_rewritten(self, ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
        return ctx.cached("shard_map", eqn, lambda: _shard_map_fn(ctx, eqn))(*invals)


class CustomJvpRule(HigherOrderRule):
    """``custom_jvp_call``: a transparent one (``jax.nn.relu``: only follow
    and clear ops) painted low runs its body in the compute dtype and keeps
    the user's JVP rule (:func:`_custom_jvp_low`)."""

    def evaluate(self, ctx: Any, eqn: Any, color: str, cls: str, env: Any) -> list[Any]:
        if color != LOW:
            return super().evaluate(ctx, eqn, color, cls, env)
        cd = ctx.policy.compute_dtype
        invals = [env.read(v, casting.target(casting.dtype_of(v), LOW, cd)) for v in eqn.invars]
        avals = tuple(compat.aval_of(x) for x in invals)
        params = ctx.cached(
            ("custom_jvp_low", avals), eqn, lambda: _custom_jvp_low(ctx, eqn, avals)
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, color: str, cls: str, atom: Any) -> bool:
        return color == LOW


_BIND = rules.EqnRule()
_ALLOW = rules.AllowRule()
_HIGHER_ORDER = HigherOrderRule()
rules.register_eqn_rule("scan", ScanRule())
rules.register_eqn_rule(compat.SHARD_MAP_NAMES, ShardMapRule())
rules.register_eqn_rule(compat.CUSTOM_JVP_NAMES, CustomJvpRule())


def _custom_jvp_low(ctx: Context, eqn: Any, low_avals: Sequence[Any]) -> dict[str, Any]:
    """Params to bind a transparent ``custom_jvp_call`` on compute-dtype operands.

    The body is evaluated with every op low. The JVP rule is the user's,
    evaluated in the original dtypes: primals and tangents are cast up, the
    output tangents cast back down to the dtypes of the low primal outputs.
    The primal outputs of the rule are the low body's, so the forward values
    are the same with and without differentiation.
    """
    call_jaxpr, rule_fun, _ = compat.custom_jvp_parts(eqn)
    body = ctx.prepare(call_jaxpr)
    classes = tuple(ctx.classify(e) for e in compat.jaxpr_of(body).eqns)
    low = Plan(body, classes, tuple(c if c == SKIP else LOW for c in classes), _NO_ATTENTION)
    orig_avals = [v.aval for v in eqn.invars]

    def primal(*xs):
        return evaluate(ctx, low, xs, cast_outputs=False)

    new_call = compat.trace_to_closed_jaxpr(primal, low_avals)

    def jvp_jaxpr(*zeros):
        jaxpr, consts, out_zeros = compat.call_thunk(rule_fun, *zeros)
        rule = compat.close(jaxpr, consts)
        tan_in = [
            (lo.to_tangent_aval(), hi.to_tangent_aval())
            for lo, hi, z in zip(low_avals, orig_avals, zeros)
            if not z
        ]

        def jvp(*xs):
            prims, tans = xs[: len(low_avals)], xs[len(low_avals) :]
            p_out = primal(*prims)
            up = [casting.cast(x, hi.dtype) for x, hi in zip(prims, orig_avals)]
            up += [casting.cast(t, hi.dtype) for t, (_, hi) in zip(tans, tan_in)]
            t_out = evaluate(ctx.linear, plan(ctx.linear, rule), up)[len(out_zeros) :]
            nz = [p for p, z in zip(p_out, out_zeros) if not z]
            return [
                *p_out,
                *(
                    casting.cast(t, compat.aval_of(p).to_tangent_aval().dtype)
                    for t, p in zip(t_out, nz)
                ),
            ]

        new = compat.trace_to_closed_jaxpr(jvp, [*low_avals, *(lo for lo, _ in tan_in)])
        return compat.jaxpr_of(new), compat.consts_of(new), out_zeros

    return compat.custom_jvp_params(eqn, new_call, compat.memoized_fun(jvp_jaxpr, rule_fun))


def _run_bwd(ctx: Context, key: Any, bwd: Any, args: Sequence[Any]) -> Any:
    """A ``custom_vjp`` backward rule ``bwd(*args)`` run under ``ctx``'s policy.

    A rule that recomputes primal values (diffrax's checkpointed adjoint
    re-runs the solver's steps) must see the policy its forward ran under,
    or it recomputes other values -- an adaptive solver accepts other steps
    -- than the forward did (PyTorch's ``custom_bwd`` does the same for
    autocast). Symbolic zeros (in and out) pass through as they are.
    """
    is_val = [isinstance(a, (jax.Array, compat.Tracer)) for a in args]
    vals = [a for a, v in zip(args, is_val) if v]
    others = tuple((i, a) for i, (a, v) in enumerate(zip(args, is_val)) if not v)
    avals = tuple(compat.aval_of(a) for a in vals)

    def make() -> tuple[Plan, dict[int, Any], Any]:
        # The rule's output is a pytree (the cotangents; from JAX 0.11 the
        # pair (cotangents, logs)) whose non-array leaves are symbolic zeros.
        zeros: dict[int, Any] = {}
        tree: list[Any] = []

        def traced(*xs):
            it = iter(xs)
            full = [a if not v else next(it) for a, v in zip(args, is_val)]
            leaves, treedef = jax.tree_util.tree_flatten(bwd(*full))
            tree.append(treedef)
            arrays = []
            for i, o in enumerate(leaves):
                if isinstance(o, (jax.Array, compat.Tracer)):
                    arrays.append(o)
                else:
                    zeros[i] = o  # a symbolic zero: no value to compute
            return arrays

        closed = compat.trace_to_closed_jaxpr(traced, avals)
        return plan(ctx, closed), zeros, tree[0]

    zkey = tuple((i, type(a).__name__, str(getattr(a, "aval", ""))) for i, a in others)
    plan_, zeros, treedef = ctx.cached(("bwd", avals, zkey), key, make)
    outs = iter(evaluate(ctx, plan_, vals))
    leaves = [zeros[i] if i in zeros else next(outs) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _shard_map_fn(ctx: Context, eqn: Any) -> Any:
    """The public ``jax.shard_map`` of ``eqn``'s body, evaluated under the policy."""
    plan_ = plan(ctx, compat.shard_map_body(eqn))
    return compat.shard_map_of(eqn, lambda *a: evaluate(ctx, plan_, a))


def _plan_hoisted_casts(ctx: Context, eqn: Any) -> tuple[list[int], dict[str, Any]] | None:
    """For a ``scan`` whose scanned-over inputs are read only in the compute
    dtype (stacked per-layer weights): the indices of those inputs, to be cast
    once outside the loop, and the scan's params with the body retyped.

    Cast inside the body, each layer's low copy of its weights would be a
    new value that the backward pass saves: a stacked copy of all weights.
    Cast outside, the residual is the (already low) input slice. As with
    hand-cast bf16 models and ``torch.autocast``, each layer's weight
    gradient then leaves its matmul rounded to the compute dtype before it is
    cast back to the parameter's dtype. None when nothing can be hoisted
    (the caller then rewrites the body as for any higher-order primitive).
    """
    found = compat.scan_xs(eqn)
    if found is None or ctx.identity:
        return None
    body, xs = found
    body_plan = plan(ctx, body)
    bj = body_plan.jaxpr
    cd = ctx.policy.compute_dtype
    hoist = []
    for i in xs:
        v = bj.invars[i]
        if (
            casting.target(casting.dtype_of(v), LOW, cd) in (None, np.dtype(casting.dtype_of(v)))
            or v in bj.outvars
        ):
            continue
        uses = [
            (e, k, c)
            for e, k, c in zip(bj.eqns, body_plan.classes, body_plan.colors)
            if any(v is a for a in e.invars)
        ]
        if uses and all(rule_for(e, k).reads_low(ctx, e, c, k, v) for e, k, c in uses):
            hoist.append(i)
    if not hoist:
        return None
    avals = compat.in_avals(body)
    avals = [a.update(dtype=cd) if i in hoist else a for i, a in enumerate(avals)]
    return hoist, compat.scan_params_with_body(eqn, rewrite(ctx, body, avals))


# -- inlining and sub-jaxprs ------------------------------------------------------------


def _has_inlinable_jit(jaxpr: Any) -> bool:
    return any(compat.jit_is_inlinable(e) for e in jaxpr.eqns)


def _eval_inlining(closed: Any, args: Sequence[Any]) -> list[Any]:
    jaxpr = compat.jaxpr_of(closed)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, compat.consts_of(closed)))
    env.update(zip(jaxpr.invars, args))

    def read(a):
        return compat.literal_value(a) if isinstance(a, compat.Literal) else env[a]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with contextlib.ExitStack() as stack:
            for m in compat.eqn_context(eqn):
                stack.enter_context(m)
            if compat.jit_is_inlinable(eqn):
                outs = _eval_inlining(compat.jit_jaxpr(eqn), invals)
            else:
                outs = compat.bind_eqn(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def inline_jits(closed: Any) -> Any:
    """``closed`` with every sharding-free ``jit`` eqn inlined (recursively)."""
    if not _has_inlinable_jit(compat.jaxpr_of(closed)):
        return closed
    return compat.trace_to_closed_jaxpr(
        lambda *a: _eval_inlining(closed, a), compat.in_avals(closed)
    )
