"""The mixed-precision policy: `Policy` (a frozen dataclass: the compute dtype, the op
classes, the scopes and rules) and `get_policy`, which reads a policy from a name.

The op classes themselves are data in `op_classes`; the names a policy goes by
(presets, aliases, Keras and jmp spellings) are `policy_names`'.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from amp_jax._src.op_classes import (
    DEFAULT_ALLOW,
    DEFAULT_CLEAR,
    DEFAULT_DENY,
    DEFAULT_FOLLOW,
    DEFAULT_NEVER,
    OP_CLASSES,
    check_spelling,
    name_set,
)
from amp_jax._src.op_classes import RANGE_WIDENING as RANGE_WIDENING
from amp_jax._src.op_classes import SOLVES as SOLVES
from amp_jax._src.op_classes import has_narrow_range as has_narrow_range
from amp_jax._src.policy_names import ALIASES, PRESETS, as_dtype, named_fields

#: Named scope that [`amp_jax.full_precision`][amp_jax.full_precision] opens; eqns under it are kept.
FULL_PRECISION_SCOPE = "amp_full_precision"


@functools.lru_cache(maxsize=1024)
def scope_in(stack: str, scopes: tuple[str, ...]) -> str | None:
    """The first of ``scopes`` that is a whole scope name in the name stack
    ``stack`` (``"model/head"``, ``"transpose(jvp(head))"``), or None.

    Names are matched whole, not as substrings: ``"head"`` is not in
    ``"multihead_attention"``. A scope name with a ``/`` in it matches that
    run of names. Cached: planning asks it of every eqn, and a program's eqns
    have few different name stacks.
    """
    names = [n for n in re.split(r"[/()]", stack) if n]
    joined = "/" + "/".join(names) + "/"
    for s in scopes:
        if ("/" in s and f"/{s.strip('/')}/" in joined) or s in names:
            return s
    return None


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the compute dtype and the op classification.

    Frozen and hashable: it is part of [`amp_jax.amp`][amp_jax.amp]'s trace cache key.

    Attributes:
      compute_dtype: dtype that ``allow`` ops (and low-precision ``follow`` /
        ``clear`` regions between them) compute in: ``bfloat16``, ``float16``
        or ``float32`` (``float32`` makes [`amp_jax.amp`][amp_jax.amp] the identity).
        A policy name works too, every one [`get_policy`][amp_jax.get_policy]
        takes (``Policy("mixed_bfloat16")``, ``Policy("float8")``).
      allow: primitive names run with compute-dtype operands and float32
        accumulation.
      deny: primitive names always computed in float32.
      follow: elementwise primitive names that follow their inputs.
      clear: data-movement primitive names that follow their inputs.
      never: primitive names whose operands are never cast.
      overrides: per-primitive class overrides, ``{name: class}``; they win
        over the lists above. Stored as a sorted tuple of pairs.
      full_precision_scopes: ``jax.named_scope`` names whose ops are left in
        their original precision (the scope of [`amp_jax.full_precision`][amp_jax.full_precision]
        is always included).
      strict: raise ``NotImplementedError`` for a primitive in no class
        instead of treating it as ``follow``.
      backend_aware: keep ops in float32 on backends where the compute dtype
        makes them slower (measured: convolutions on CPU; bfloat16 matmuls on a
        CPU without bfloat16 dot instructions, `amp_jax.cpu_bf16_support`). See
        the docs.
      allow_outputs: the dtype ``allow`` ops write (they accumulate in
        float32 either way): ``"auto"`` (default) takes it per backend from
        [`BACKEND_LOW_OUTPUTS`][amp_jax.BACKEND_LOW_OUTPUTS] -- the compute dtype on GPU, where cuBLAS
        and cuDNN accumulate in float32 internally and a bf16 result halves
        the activation traffic, float32 elsewhere (XLA:CPU runs bf16 dots
        fastest with a float32 result); ``"float32"`` or ``"compute"`` force
        one.
      float8: ``"off"`` (default); ``"tensorwise"`` or ``"rowwise"`` run large
        unbatched matmuls with ``float8_e4m3fn`` operands (``float8_e5m2``
        gradients in the backward pass), dynamic power-of-two scales per
        tensor or per row, float32 accumulation; emulated (fp8 round trip +
        bf16 dot) where the backend has no fp8 matmuls. Needs
        ``compute_dtype=bfloat16``. Presets ``"float8"`` and
        ``"float8_rowwise"``. See "Float8".
      float8_min_flops: an fp8-eligible matmul of fewer FLOPs than this
        (default ``2**20``) runs the bfloat16 rule instead: the amax
        reductions and casts of fp8 cost more than they save on small ones.
      min_low_contraction: an ``allow`` op whose contraction (the product of
        a dot's contracting dims; a convolution's input features times its
        window) is shorter than this stays float32. Default 8.
      min_low_flops: an ``allow`` op of fewer FLOPs (twice its multiply-adds)
        than this stays float32, and so does a vector-vector dot product
        while this is nonzero. Default 256. Together these keep a solver's
        own small contractions (a Runge-Kutta step's 7 stage weights, a dot
        product of two state vectors) out of bf16, where they buy no speed
        and can cost the solver its accuracy; see "How amp works". ``0`` for
        both lowers everything.
      attention: attention written out (``einsum`` -> scale -> mask or
        additive bias -> softmax -> ``einsum``, grouped-query spellings
        included, or ``jax.nn.dot_product_attention`` on float32 inputs) is
        recognised and run as one fused attention in the compute dtype:
        ``"auto"`` (default) uses cuDNN flash attention on GPU where cuDNN
        takes it and leaves it as written elsewhere, with the reason in
        ``dtype_report``/``explain``; ``"off"`` never rewrites; ``"cudnn"``
        or ``"xla"`` force that implementation. See "How amp works".
      rules: what the matmuls and convolutions at a path run in, as an ordered
        mapping (a dict or ``(pattern, target)`` pairs) from a path pattern to
        a target: ``"float32"`` (left in its original precision),
        ``"bfloat16"``, ``"float16"``, ``"float8"`` or ``"float8_rowwise"``.
        A path is the op's ``jax.named_scope`` path (``"Model/head"``) or the
        pytree key path of a parameter it reads, ``/``-joined
        (``"params/head/kernel"``, ``"layers/0/weight"``). A pattern is a glob
        (`fnmatch`) that matches a whole path or a leading part of it, ``re:``
        then a regular expression searched in the path, or ``"@first"`` /
        ``"@last"`` (the first or last matmul of the function). The first
        matching rule wins; one that matches nothing warns (raises with
        ``strict=True``). Stored as a tuple of pairs. See "Rules by path".

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import Policy
      >>> p = Policy(jnp.float16, overrides={"tanh": "deny"})
      >>> p.class_of("tanh"), p.class_of("dot_general")
      ('deny', 'allow')
    """

    # The fields hold what `__post_init__` stores (a numpy dtype, frozensets, sorted
    # tuples); the constructor takes more (the `__init__` below, for type checkers only:
    # tests/repository/test_typing.py keeps its parameters and defaults those of the fields).
    compute_dtype: np.dtype = np.dtype(jnp.bfloat16)
    allow: frozenset[str] = DEFAULT_ALLOW
    deny: frozenset[str] = DEFAULT_DENY
    follow: frozenset[str] = DEFAULT_FOLLOW
    clear: frozenset[str] = DEFAULT_CLEAR
    never: frozenset[str] = DEFAULT_NEVER
    overrides: tuple[tuple[str, str], ...] = ()
    full_precision_scopes: tuple[str, ...] = ()
    strict: bool = False
    backend_aware: bool = True
    allow_outputs: str = "auto"
    attention: str = "auto"
    min_low_contraction: int = 8
    min_low_flops: int = 256
    float8: str = "off"
    float8_min_flops: int = 2**20
    rules: tuple[tuple[str, str], ...] = ()

    if TYPE_CHECKING:

        def __init__(
            self,
            compute_dtype: DTypeLike | str = jnp.bfloat16,
            allow: Iterable[str] = DEFAULT_ALLOW,
            deny: Iterable[str] = DEFAULT_DENY,
            follow: Iterable[str] = DEFAULT_FOLLOW,
            clear: Iterable[str] = DEFAULT_CLEAR,
            never: Iterable[str] = DEFAULT_NEVER,
            overrides: Mapping[str, str] | Iterable[tuple[str, str]] = (),
            full_precision_scopes: str | Iterable[str] = (),
            strict: bool = False,
            backend_aware: bool = True,
            allow_outputs: str = "auto",
            attention: str = "auto",
            min_low_contraction: int = 8,
            min_low_flops: int = 256,
            float8: str = "off",
            float8_min_flops: int = 2**20,
            rules: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        ) -> None: ...

    def __post_init__(self) -> None:
        if isinstance(self.compute_dtype, str):  # a policy name, as amp(policy=...) takes
            named = named_fields(self.compute_dtype, "Policy(compute_dtype)")
            if self.float8 == "off" and "float8" in named:  # ("float8": bf16 + float8 matmuls)
                object.__setattr__(self, "float8", named["float8"])
            object.__setattr__(self, "compute_dtype", named["compute_dtype"])
        object.__setattr__(self, "compute_dtype", as_dtype(self.compute_dtype, "compute_dtype"))
        for field in OP_CLASSES:
            object.__setattr__(self, field, name_set(getattr(self, field), field))
        object.__setattr__(self, "overrides", _checked_overrides(self.overrides))
        _check_disjoint(self)
        scopes = _checked_scopes(self.full_precision_scopes)
        object.__setattr__(self, "full_precision_scopes", scopes)
        if not isinstance(self.strict, bool) or not isinstance(self.backend_aware, bool):
            raise TypeError("strict and backend_aware must be bools.")
        for name in ("min_low_contraction", "min_low_flops", "float8_min_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(
                    f"Policy({name}={value!r}) must be an int >= 0 (0 lowers every allow op)."
                )
            object.__setattr__(self, name, int(value))
        _check_modes(self)
        object.__setattr__(self, "rules", _checked_rules(self.rules))
        if self.rules and self.is_identity:
            raise ValueError(
                "Policy(rules=...) needs a low-precision compute_dtype (bfloat16 or float16): "
                "under float32 amp leaves every op as written. Use e.g. "
                "Policy('bfloat16', rules={'head/*': 'float32'})."
            )

    def __repr__(self) -> str:
        """The compute dtype and only the fields that differ from their defaults."""
        parts = [f"compute_dtype={self.compute_dtype.name}"]
        for field in dataclasses.fields(self)[1:]:
            default: Any
            value, default = getattr(self, field.name), field.default
            if field.name in OP_CLASSES:
                default = name_set(default, field.name)
            if value == default:
                continue
            if field.name in OP_CLASSES:
                added, removed = sorted(value - default), sorted(default - value)
                value = f"DEFAULT_{field.name.upper()}"
                value += f" | {set(added)}" if added else ""
                value += f" - {set(removed)}" if removed else ""
                parts.append(f"{field.name}={value}")
            else:
                parts.append(f"{field.name}={value!r}")
        return f"Policy({', '.join(parts)})"

    # -- queries -----------------------------------------------------------
    @property
    def is_identity(self) -> bool:
        """True when the policy changes nothing (compute dtype float32)."""
        return self.compute_dtype == np.dtype(np.float32)

    def class_of(self, name: str) -> str | None:
        """The class of primitive ``name``, or ``None`` when it is in no list."""
        for n, cls in self.overrides:
            if n == name:
                return cls
        for cls in OP_CLASSES:
            if name in getattr(self, cls):
                return cls
        return None

    def replace(self, **changes: Any) -> Policy:
        """A copy of this policy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def table(self) -> list[tuple[str, str]]:
        """``(primitive name, class)`` rows of the whole classification, sorted."""
        names = set(dict(self.overrides)).union(*(getattr(self, c) for c in OP_CLASSES))
        rows: dict[str, Any] = {n: self.class_of(n) for n in names}  # each name has a class
        return sorted(rows.items(), key=lambda r: (OP_CLASSES.index(r[1]), r[0]))


_ALLOW_OUTPUTS = ("auto", "float32", "compute")
_FLOAT8 = ("off", "tensorwise", "rowwise")
_ATTENTION = ("auto", "off", "cudnn", "xla")


def _checked_overrides(
    overrides: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, str], ...]:
    """``Policy.overrides`` (a mapping or pairs) as sorted ``(name, class)`` pairs."""
    given = overrides
    if isinstance(overrides, Mapping):
        overrides = overrides.items()
    elif overrides and not all(isinstance(o, tuple) and len(o) == 2 for o in overrides):
        raise TypeError(
            f"overrides={given!r} must map primitive names to classes, e.g. "
            "overrides={'exp': 'follow'}."
        )
    pairs = []
    for name, cls in overrides or ():
        check_spelling(str(name), "overrides")
        if cls not in OP_CLASSES:
            raise ValueError(
                f"overrides[{name!r}]={cls!r} is not an op class; use one of {OP_CLASSES}."
            )
        pairs.append((str(name), cls))
    return tuple(sorted(pairs))


def _check_disjoint(policy: Policy) -> None:
    """Refuses a primitive in two of the policy's class lists."""
    for i, a in enumerate(OP_CLASSES):
        for b in OP_CLASSES[i + 1 :]:
            both = getattr(policy, a) & getattr(policy, b)
            if both:
                name = sorted(both)[0]
                raise ValueError(
                    f"Policy: {sorted(both)} are in both `{a}` and `{b}`; a primitive has one "
                    f"class. To move one, keep the default lists and use "
                    f"overrides={{{name!r}: {b!r}}} (or remove it from `{a}`)."
                )


def _checked_scopes(scopes: str | Iterable[str] | None) -> tuple[str, ...]:
    """``Policy.full_precision_scopes`` (a name or names) as a sorted tuple."""
    given = scopes
    if isinstance(scopes, str):
        scopes = (scopes,)
    if scopes and (not isinstance(scopes, Iterable) or not all(isinstance(x, str) for x in scopes)):
        raise TypeError(
            f"full_precision_scopes={given!r} must be jax.named_scope names "
            "(a str or a tuple of str), e.g. full_precision_scopes=('head',)."
        )
    return tuple(sorted(set(scopes or ())))


#: what a rule of ``Policy.rules`` can give the matmuls it matches
RULE_TARGETS: tuple[str, ...] = ("float32", "bfloat16", "float16", "float8", "float8_rowwise")


def rule_fields(target: str) -> dict[str, Any]:
    """The Policy fields the matmuls of a rule with ``target`` run under: the
    preset of that name (``"float8"``: bfloat16 with tensorwise float8), float8
    off unless the target names it."""
    return {"float8": "off", **named_fields(target, "rules")}


def _checked_rules(
    rules: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, str], ...]:
    """``Policy.rules`` (a mapping or pairs, in order) as ``(pattern, target)`` pairs."""
    given = rules
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    elif isinstance(rules, str) or not isinstance(rules, Iterable):
        rules = [rules]  # (refused below)
    valid = ", ".join(map(repr, RULE_TARGETS))
    out = []
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise ValueError(
                f"rules={given!r} must map path patterns to targets ({valid}), as a dict or "
                "(pattern, target) pairs, e.g. rules={'params/head/*': 'float32'}."
            )
        pattern, target = rule
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"rules: pattern {pattern!r} must be a non-empty str: a glob such as "
                f"'params/head/*', 're:' and a regular expression, or '@first' / '@last'."
            )
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise ValueError(f"rules: {pattern!r} is not a regular expression: {e}") from None
        elif pattern.startswith("@") and pattern not in ("@first", "@last"):
            raise ValueError(f"rules: {pattern!r}: the '@' patterns are '@first' and '@last'.")
        key = ALIASES.get(target.lower(), target.lower()) if isinstance(target, str) else None
        if key not in RULE_TARGETS:
            raise ValueError(
                f"rules[{pattern!r}]={target!r} is not a target; rules map a pattern to one "
                f"of {valid}."
            )
        out.append((pattern, key))
    return tuple(out)


def _check_modes(policy: Policy) -> None:
    """Refuses an unknown ``attention``, ``float8`` or ``allow_outputs`` mode."""
    if policy.attention not in _ATTENTION:
        raise ValueError(
            f"Policy(attention={policy.attention!r}) is not one of {_ATTENTION}: 'auto' fuses "
            "attention with cuDNN on GPU, 'off' never rewrites, 'cudnn'/'xla' force one."
        )
    if policy.float8 not in _FLOAT8:
        raise ValueError(
            f"Policy(float8={policy.float8!r}) is not one of {_FLOAT8}: 'tensorwise' scales "
            "each fp8 operand by one dynamic scale, 'rowwise' by one per row, 'off' keeps "
            "bfloat16 matmuls (or use policy='float8' / 'float8_rowwise')."
        )
    if policy.float8 != "off" and policy.compute_dtype != np.dtype(jnp.bfloat16):
        raise ValueError(
            f"Policy(float8={policy.float8!r}) needs compute_dtype=jnp.bfloat16 (the dtype of "
            f"the dequantized fp8 operands and of every other low op), got "
            f"compute_dtype={policy.compute_dtype.name!r}; or set float8='off'."
        )
    if policy.allow_outputs not in _ALLOW_OUTPUTS:
        raise ValueError(
            f"Policy(allow_outputs={policy.allow_outputs!r}) is not one of {_ALLOW_OUTPUTS}: "
            "'auto' picks per backend, 'float32' or 'compute' force the dtype allow ops write."
        )


def get_policy(policy: Policy | str | DTypeLike) -> Policy:
    """Resolves ``policy`` (a [`Policy`][amp_jax.Policy], a preset name or a dtype) to a Policy.

    Args:
      policy: a [`Policy`][amp_jax.Policy]; one of the preset names ``"bfloat16"``,
        ``"float16"``, ``"float32"`` (aliases ``"bf16"``, ``"f16"``,
        ``"f32"``...), ``"float8"`` (aliases ``"fp8"``, ``"f8"``: the
        bfloat16 policy with ``float8="tensorwise"``) or ``"float8_rowwise"``;
        Keras' ``"mixed_bfloat16"`` / ``"mixed_float16"``; a jmp policy string
        with float32 parameters and outputs (``"p=f32,c=bf16,o=f32"``,
        ``"params=float32,compute=float16,output=float32"``); or a dtype such
        as ``jnp.bfloat16``.

    Returns:
      The [`Policy`][amp_jax.Policy].

    Raises:
      ValueError: for an unknown name or a dtype that is not a float type amp
        can compute in; the message lists the valid choices.

    Examples:
      >>> from amp_jax import get_policy
      >>> get_policy("bf16").compute_dtype
      dtype(bfloat16)
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(**named_fields(policy, "policy"))
    try:
        return Policy(policy)
    except ValueError as e:
        raise ValueError(
            f"policy={policy!r} is neither an amp_jax.Policy, a preset name "
            f"({', '.join(map(repr, PRESETS))}) nor a supported float dtype."
        ) from e


def is_managed_float(dtype: DTypeLike | None) -> TypeGuard[DTypeLike]:
    """Floats amp may recast: float32, bfloat16, float16 (never f64, fp8, complex)."""
    try:
        return np.dtype(dtype) in _MANAGED
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes
        return False


_MANAGED = frozenset(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
HIGH_DTYPE = np.dtype(np.float32)
