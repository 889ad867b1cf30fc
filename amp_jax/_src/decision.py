"""What amp decided for one eqn, and why: the typed record of a plan.

Planning (``planning.py``) gives every eqn of a jaxpr one `Decision`:
its *kind* (an op to paint, an eqn without floats, a higher-order eqn whose
bodies are rewritten or one bound as written), its policy `OpClass`,
its `Color` (the dtype its operands are read in), the dtype an
``allow`` op writes and the function it runs (`Variant`), the
attention it belongs to, and the `Reason` for all of it, recorded
where the decision is made. A higher-order eqn's decision holds the plans
of its sub-jaxprs (`BodyPlan`): a plan (``plans.py``) is a tree, complete
when made; only a body JAX traces later (a custom derivative rule) is a
`LazyBody`, planned when its rule has its jaxpr. The rules (``rules/``) bind
the eqn as its decision says, ``explain`` shows the reason: neither decides again.

A reason also travels with the ops amp emits, through ``jax.grad`` into the
backward pass, as a ``jax.named_scope``: this module is the only one that
writes reasons into scopes (`scopes`, `float8_scope`) and reads
them back from a name stack (`from_stack`, `attention_from_stack`),
which is how [`amp_jax.dtype_report`][amp_jax.dtype_report] says why an op of any program ran
as it did.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from amp_jax._src import compat
from amp_jax._src.backends import Backend
from amp_jax._src.policy import FULL_PRECISION_SCOPE, rule_fields, scope_in


class OpClass(enum.Enum):
    """The class of an op, as the policy's lists (and the planning) give it."""

    ALLOW = "allow"  # low precision: matmuls, convolutions
    DENY = "deny"  # numerically sensitive: float32
    FOLLOW = "follow"  # elementwise: low between two low ops
    CLEAR = "clear"  # data movement: low next to a low op
    NEVER = "never"  # left as written


class Kind(enum.Enum):
    """What sort of eqn a decision is about, which says how it is bound."""

    OP = "op"  # an op on managed floats (or a transparent custom_jvp): painted
    NO_FLOAT = "no_float"  # no managed float operand or result: bound as it is
    NESTED = "nested"  # higher-order: bodies rewritten, boundary dtypes kept
    AS_WRITTEN = "as_written"  # higher-order, bound as written (identity, full_precision)


class Color(enum.Enum):
    """The dtype an eqn reads its managed-float operands in (``casting.target``)."""

    LOW = "low"  # the compute dtype
    HIGH = "high"  # float32
    ORIG = "orig"  # as they are


class Variant(enum.Enum):
    """The function an ``allow`` eqn painted low runs."""

    COMPUTE = "compute"  # its rule's compute-dtype function
    FLOAT8 = "float8"  # the fp8 form of the dot rule (``Policy(float8=...)``)
    FLOAT32 = "float32"  # no compute-dtype kernel on this backend: float32 operands


class Fused(enum.Enum):
    """The eqn's part in a fused attention (``attention/``)."""

    NO = "no"
    HERE = "here"  # the fused attention is computed at this eqn (its second matmul)
    INSIDE = "inside"  # computed by a fused attention: not bound


class Why(enum.Enum):
    """The closed set of reasons for a decision."""

    IDENTITY = "identity"
    FULL_PRECISION = "full_precision"
    NO_FLOAT = "no_float"
    HIGHER_ORDER = "higher_order"
    POLICY_CLASS = "policy_class"
    PAINTING = "painting"
    BACKEND_CLASS = "backend_class"
    FLOAT8 = "float8"
    ATTENTION = "attention"
    RULE = "rule"  # a rule of Policy.rules matched the op's path
    # kept in their original precision (travel through grad as ``amp_keep_f32.<value>``):
    WIDE_OPERAND = "wide_operand"
    EXPLICIT_PRECISION = "explicit_precision"
    TOO_SMALL = "too_small"
    CONSTANT_RANGE = "constant_range"
    DECIDES_CONTROL = "decides_control"
    DECIDES_EXIT = "decides_exit"
    FEEDS_SOLVE = "feeds_solve"
    FLOAT16_RANGE = "float16_range"
    LOOP_CARRY = "loop_carry"
    BACKEND_KERNEL = "backend_kernel"


#: the reasons an op amp would lower is kept in its original precision, in words.
KEPT = {
    Why.WIDE_OPERAND: "float64/complex operand: not ours to lower",
    Why.EXPLICIT_PRECISION: "explicit precision=HIGH/HIGHEST (or an algorithm) asked for",
    Why.TOO_SMALL: "too small to pay (Policy.min_low_contraction / min_low_flops)",
    Why.CONSTANT_RANGE: "reads a constant the compute dtype cannot represent",
    Why.DECIDES_CONTROL: "decides control flow (a while predicate or cond index reads it)",
    Why.DECIDES_EXIT: (
        "decides when a while loop stops (its exit test reads it, directly or through the "
        "carry): float32, matmuls included, so a convergence test can reach its tolerance"
    ),
    Why.FEEDS_SOLVE: (
        "a factorization or solve (cholesky, lu, qr, eigh, svd, a linear solve) reads its "
        "result, or its gradient: the solve amplifies rounding, so float32"
    ),
    Why.FLOAT16_RANGE: (
        "can leave float16's range (max 65504: a power, a reciprocal, a product of two "
        "activations): float32"
    ),
    Why.LOOP_CARRY: "computes a loop-carried value: kept in the carry's dtype",
    Why.BACKEND_KERNEL: "no low-precision kernel for it on this backend: runs in float32",
}


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a decision was made: one of the closed set, and its words."""

    why: Why
    text: str

    @classmethod
    def kept(cls, why: Why) -> Reason:
        """A reason an op is kept in its original precision (one of `KEPT`)."""
        return cls(why, KEPT[why])

    @classmethod
    def low_f32_result(cls, why: Why, low_text: str) -> Reason:
        """An ``allow`` op that reads compute-dtype operands (``low_text``: why)
        but writes float32, for ``why`` (one of `KEPT`): its result decides
        control flow, feeds a solve or is carried by a loop."""
        return cls(why, f"{low_text}; writes float32: {KEPT[why]}")

    @property
    def keeps_high(self) -> bool:
        return self.why in KEPT

    @property
    def low_operands(self) -> bool:
        """A `low_f32_result` reason: low operands, a float32 result."""
        return self.keeps_high and self.text != KEPT[self.why]


@dataclasses.dataclass(frozen=True)
class PathRule:
    """The rule of ``Policy.rules`` that decided a matmul or convolution.

    Attributes:
      index: its position in ``Policy.rules``.
      pattern: its pattern, as written.
      target: what it runs the op in (one of ``policy.RULE_TARGETS``).
      path: the path of the op it matched (a scope or a parameter's key path).
    """

    index: int
    pattern: str
    target: str
    path: str

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype the rule gives (float32: the op stays as written)."""
        return np.dtype(rule_fields(self.target)["compute_dtype"])

    @property
    def recipe(self) -> str:
        """Its float8 recipe (``Policy.float8``): ``"off"`` unless a float8 target."""
        return str(rule_fields(self.target)["float8"])

    @property
    def text(self) -> str:
        """``rule 'params/head/*' -> float32``: how explain names it."""
        return f"rule {self.pattern!r} -> {self.target}"


@dataclasses.dataclass(frozen=True)
class AttentionPath:
    """The path an attention took: fused by ``impl``, or left as written (None)."""

    impl: str | None
    reason: str

    @property
    def text(self) -> str:
        if self.impl == "cudnn":
            return "attention: cuDNN flash attention"
        if self.impl is not None:
            return f"attention: fused, {self.impl} implementation"
        return f"attention left as written (xla: {_scope_text(self.reason)})"


@dataclasses.dataclass(frozen=True)
class BodyHints:
    """What the plan of a sub-jaxpr needs from its parent's plan: its output
    positions that decide control flow (a while predicate, a loop-carried
    decision), those of them that decide when a while loop stops, and those a
    loop carries to its next iteration (planning keeps what computes them out
    of the compute dtype)."""

    decides: frozenset[int] = frozenset()
    exits: frozenset[int] = frozenset()
    carries: frozenset[int] = frozenset()

    def __or__(self, other: BodyHints) -> BodyHints:
        return BodyHints(
            self.decides | other.decides, self.exits | other.exits, self.carries | other.carries
        )

    def __bool__(self) -> bool:
        return bool(self.decides or self.exits or self.carries)

    def __str__(self) -> str:
        parts = [
            f"{name}={{{', '.join(map(str, sorted(outs)))}}}"
            for name, outs in (
                ("decides", self.decides),
                ("exits", self.exits),
                ("carries", self.carries),
            )
            if outs
        ]
        return " ".join(parts) or "-"


NO_HINTS = BodyHints()


@dataclasses.dataclass(frozen=True)
class LazyBody:
    """A sub-jaxpr of a higher-order eqn that exists only when JAX traces it,
    after planning: a ``custom_jvp`` rule (traced when JAX differentiates the
    call), a ``custom_vjp``'s forward under differentiation and its backward
    rule, a ``scan`` body retraced with the loop's concrete masks. Its rule
    plans it then (``ctx.plan_lazy``: ``planning.plan_lazy``), under the same
    context; the only body a plan does not hold.

    Attributes:
      what: what the body is, for `plans.format_plan`.
      linear: planned without the custom_vjp rules (code JAX transposes).
    """

    what: str
    linear: bool = False


@dataclasses.dataclass(frozen=True)
class BodyPlan:
    """One sub-jaxpr of a higher-order eqn and its plan, made with the eqn's.

    Attributes:
      where: the param that holds it (``"body_jaxpr"``, ``"branches[1]"``,
        ``"jvp_jaxpr_fun"``, ...).
      plan: its ``plans.Plan`` (a tree: its own decisions hold their
        bodies), or a `LazyBody` for one traced after planning.
      source: the closed jaxpr planned (the param's, or the open one closed),
        to find the plan of a sub-jaxpr by (`body_plan`); None for a lazy body.
    """

    where: str
    plan: Any
    source: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What amp does with one eqn, and why.

    Attributes:
      kind: what sort of eqn it is (`Kind`).
      op_class: its class under the policy (None for kinds other than ``OP``).
      color: the dtype its managed-float operands are read in.
      reason: why, recorded where the decision was made.
      out_dtype: what an ``allow`` op painted low writes (None for other ops:
        they write what their operands give).
      variant: the function an ``allow`` op painted low runs.
      attention: the path of the attention the eqn is part of, if any.
      fused: its part in a fused attention.
      hints: for a higher-order eqn, the `BodyHints` of its sub-jaxprs, as
        ``(param, hints)`` pairs (``param``: ``"body_jaxpr"``,
        ``"branches[1]"``, ...); sub-jaxprs not named have none.
      bodies: for a higher-order eqn whose sub-jaxprs amp rewrites, their
        plans (`BodyPlan`), each made with the hints it gets, in the order of
        the eqn's params; a body JAX traces later is a `LazyBody`.
      rule: the rule of ``Policy.rules`` that decided the op (`PathRule`), if any.
    """

    kind: Kind
    op_class: OpClass | None
    color: Color
    reason: Reason
    out_dtype: np.dtype | None = None
    variant: Variant = Variant.COMPUTE
    attention: AttentionPath | None = None
    fused: Fused = Fused.NO
    hints: tuple[tuple[str, BodyHints], ...] = ()
    bodies: tuple[BodyPlan, ...] = dataclasses.field(default=(), repr=False)
    rule: PathRule | None = None

    @property
    def lowered(self) -> bool:
        """An ``allow`` op that runs its low-precision function."""
        return self.color is Color.LOW and self.op_class is OpClass.ALLOW


def body_hints(eqn: compat.Eqn, d: Decision, sub: Any) -> BodyHints:
    """The hints ``d`` (the decision of higher-order ``eqn``) gives its sub-jaxpr
    ``sub``: a closed jaxpr of ``eqn``'s params, or one closed again."""
    if not d.hints:
        return NO_HINTS
    jaxpr = compat.jaxpr_of(sub)
    found = NO_HINTS
    for where, hints in d.hints:
        name, _, index = where.partition("[")
        param = eqn.params[name]
        if index:
            param = param[int(index[:-1])]
        if compat.jaxpr_of(param) is jaxpr:
            found |= hints
    return found


def body_plan(d: Decision, sub: Any) -> Any:
    """The plan ``d`` holds of sub-jaxpr ``sub`` (a closed jaxpr of its eqn's
    params, or an open one closed again), else None."""
    jaxpr = compat.jaxpr_of(sub)
    for b in d.bodies:
        if b.source is not None and (b.source is sub or compat.jaxpr_of(b.source) is jaxpr):
            return b.plan
    return None


def body_at(d: Decision, where: str) -> Any:
    """The plan (or `LazyBody`) ``d`` holds at param ``where``, else None."""
    for b in d.bodies:
        if b.where == where:
            return b.plan
    return None


def lazy_body(d: Decision, where: str) -> LazyBody | None:
    """The `LazyBody` ``d`` holds at param ``where``, else None."""
    found = body_at(d, where)
    return found if isinstance(found, LazyBody) else None


# -- how a reason travels through grad: named scopes -----------------------------------------

KEEP_SCOPE = "amp_keep_f32"  # amp_keep_f32.<Why value>
#: a low allow op that writes float32: amp_f32_result.<Why value>.<compute dtype>[.override]
F32_RESULT_SCOPE = "amp_f32_result"
ATTENTION_SCOPE = "amp_attention"  # amp_attention[cudnn] / [xla-fused] / [xla: <reason>]
FLOAT8_SCOPE = "amp_float8"  # amp_float8.<recipe>[.backward]
RULE_SCOPE = "amp_rule"  # amp_rule.<index in Policy.rules>


def _scope_text(reason: str) -> str:
    # (a name stack splits at "/", and the attention scope ends at the first "]")
    return reason.replace("/", " or ").replace("[", "(").replace("]", ")")


def attention_scope(path: AttentionPath) -> str:
    """``amp_attention[cudnn]``, ``amp_attention[xla-fused]`` or ``amp_attention[xla: why]``."""
    if path.impl == "cudnn":
        return f"{ATTENTION_SCOPE}[cudnn]"
    if path.impl is not None:
        return f"{ATTENTION_SCOPE}[{path.impl}-fused]"
    return f"{ATTENTION_SCOPE}[xla: {_scope_text(path.reason)}]"


def scopes(d: Decision) -> list[str]:
    """The named scopes an eqn is bound under, so that its reason reaches its ops."""
    out = []
    if d.reason.low_operands:
        dtype = d.reason.text.split(" runs in ", 1)[1].split()[0]
        override = ".override" if d.reason.text.startswith("policy override") else ""
        out.append(f"{F32_RESULT_SCOPE}.{d.reason.why.value}.{dtype}{override}")
    elif d.reason.keeps_high:
        out.append(f"{KEEP_SCOPE}.{d.reason.why.value}")
    if d.attention is not None and (d.attention.impl is None or d.fused is Fused.HERE):
        out.append(attention_scope(d.attention))
    if d.rule is not None:
        out.append(rule_scope(d.rule))
    return out


def rule_scope(rule: PathRule) -> str:
    """``amp_rule.<index>``: the scope of the ops of a matmul a rule decided
    (forward and, through ``jax.grad``, backward), by which diagnostics tell
    apart the ops of one source line that two rules decided."""
    return f"{RULE_SCOPE}.{rule.index}"


def has_rule_scope(stack: str) -> bool:
    """Whether a name stack is that of an op a rule of ``Policy.rules`` decided."""
    return RULE_SCOPE + "." in stack


def float8_scope(recipe: str, backward: bool = False) -> str:
    """The scope of the ops of an fp8 product (forward, or its backward products)."""
    return f"{FLOAT8_SCOPE}.{recipe}" + (".backward" if backward else "")


def float8_text(recipe: str, backend: Backend) -> str:
    """The words for an fp8 product of ``recipe`` on ``backend``."""
    how = "per-tensor" if recipe == "tensorwise" else "per-row"
    name, native = backend.name, backend.native_float8_matmul()
    where = (
        f"native fp8 GEMM on {name}"
        if native
        else f"emulated on {name} (no fp8 matmul units): fp8 round trip + bf16 dot"
    )
    if recipe == "rowwise" and native:
        where = f"native fp8 GEMM on {name}, per-row scales applied to its result"
    return (
        f"float8 {recipe}: e4m3 operands, e5m2 gradient, {how} dynamic scales, "
        f"float32 accumulation; {where}"
    )


def attention_from_stack(stack: str) -> AttentionPath | None:
    """The path of the attention whose scope a name stack holds, if any."""
    i = stack.find(ATTENTION_SCOPE + "[")
    if i < 0:
        return None
    j = stack.find("]", i)
    what = stack[i + len(ATTENTION_SCOPE) + 1 : j if j > 0 else None]
    if what == "cudnn":
        return AttentionPath("cudnn", "cuDNN flash attention")
    if what.endswith("-fused"):
        return AttentionPath(what[: -len("-fused")], "fused")
    return AttentionPath(None, what[len("xla: ") :] if what.startswith("xla: ") else what)


def from_stack(stack: str, backend: Backend) -> Reason | None:
    """The reason amp left an op of a rewritten program as it is, from its name
    stack (the op may be a backward op of ``jax.grad``), if amp gave one: that of
    the innermost of amp's scopes (an op of a body amp rewrote inside a kept
    function has its own)."""
    found = _innermost_kept(stack)
    if found is not None:
        return found
    path = attention_from_stack(stack)
    if path is not None:
        return Reason(Why.ATTENTION, path.text)
    if scope_in(stack, (FULL_PRECISION_SCOPE,)):
        return Reason(Why.FULL_PRECISION, "full_precision scope")
    if FLOAT8_SCOPE + "." in stack:
        recipe = "rowwise" if float8_scope("rowwise") in stack else "tensorwise"
        return Reason(Why.FLOAT8, float8_text(recipe, backend))
    return None


def _innermost_kept(stack: str) -> Reason | None:
    """The reason of the innermost ``amp_keep_f32`` / ``amp_f32_result`` scope of ``stack``."""
    for part in reversed(stack.replace("(", "/").replace(")", "/").split("/")):
        kind, _, rest = part.partition(".")
        if kind == KEEP_SCOPE and rest in _WHYS:
            return Reason.kept(_WHYS[rest])
        if kind == F32_RESULT_SCOPE:
            value, _, dtype = rest.partition(".")
            dtype, _, override = dtype.partition(".")
            if value in _WHYS:
                return Reason.low_f32_result(_WHYS[value], low_allow_text(dtype, bool(override)))
    return None


_WHYS = {w.value: w for w in KEPT}


def low_allow_text(compute_dtype: str, override: bool = False) -> str:
    """Why an allow op reads ``compute_dtype`` operands: its class (or an override)."""
    src = "policy override" if override else "allow class"
    return f"{src}: runs in {compute_dtype} (float32 accumulation)"
