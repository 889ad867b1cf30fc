"""Rules by path: the paths of a program's matmuls, and the rule each one matches.

``Policy(rules=...)`` maps path patterns to what the matched matmuls and
convolutions run in. A matmul has two kinds of path:

* its *scope*: the ``jax.named_scope`` names it was traced under inside the
  function, ``/``-joined, without JAX's transformation wrappers
  (``vmap(eqx.nn.MLP)`` is ``eqx.nn.MLP``): ``Model/head`` for a Flax linen
  module, ``mlp/linear_0`` for Haiku, ``head`` for a Keras layer;
* the *key path of each parameter it reads*: an input leaf of the function,
  followed to the matmul through the ops that only move or cast it (casts,
  reshapes, transposes, broadcasts, squeezes, copies) and into the bodies of
  ``jit``, ``checkpoint``, custom-derivative calls, loops and conditionals.

A key path is written as its keys joined by ``/``: a dict key as it is, an
attribute by its name, a sequence index by its number (`path_of`); the
argument itself is left out (``loss(params, x)``: ``params["params"]["head"]
["kernel"]`` is ``params/head/kernel``), except for an argument that is
itself an array, whose path is its parameter's name. A Flax NNX variable's
trailing ``.value`` is left out too. So: ``params/Dense_0/kernel`` (Flax
linen), ``layers/0/attn/q_proj/kernel`` (NNX state), ``layers/0/weight``
(Equinox's ``.layers[0].weight``), ``mlp/~/linear_0/w`` (Haiku).

`Paths` walks a planned program once per trace (`Paths.walk`, from
``planning.plan``), and gives each matmul the first rule that matches one of
its paths (`Paths.rule_of`); `Paths.check` reports the rules that matched
nothing.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from amp_jax._src import compat
from amp_jax._src.decision import PathRule
from amp_jax._src.policy import Policy, is_managed_float

#: ops whose result is their operand moved or cast: a parameter read through them is still it
_PASSTHROUGH = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "reduce_precision",
        "sharding_constraint",
        "device_put",
        "optimization_barrier",
        "pvary",
    }
)

FIRST, LAST = "@first", "@last"


# -- the canonical path ---------------------------------------------------------------


def key_name(key: Any) -> str:
    """One key of a JAX key path as a path component."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_of(keys: Sequence[Any]) -> str:
    """A JAX key path as amp's path string: its keys ``/``-joined (`key_name`),
    an NNX variable's trailing ``value`` attribute left out."""
    if len(keys) > 1 and isinstance(keys[-1], jax.tree_util.GetAttrKey):
        if keys[-1].name in ("value", "raw_value"):
            keys = keys[:-1]
    return "/".join(key_name(k) for k in keys)


def input_paths(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: Sequence[str], mask: Sequence[bool]
) -> tuple[str, ...]:
    """The paths of the traced leaves of a call ``fn(*args, **kwargs)`` (those
    ``mask`` marks, in order: the jaxpr's inputs), inside their arguments;
    an argument that is a leaf itself is its parameter's name (``names``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    out = []
    for (keys, _), traced in zip(flat, mask):
        if not traced:
            continue
        inner = path_of(keys[2:])
        if not inner:
            where = keys[1]
            if isinstance(where, jax.tree_util.SequenceKey):
                inner = names[where.idx] if where.idx < len(names) else f"arg{where.idx}"
            else:
                inner = key_name(where)
        out.append(inner)
    return tuple(out)


def scope_path(stack: str) -> str:
    """A name stack as a scope path: JAX's transformation wrappers removed
    (``transpose(jvp(head))`` -> ``head``), empty names dropped."""
    parts = []
    for part in stack.split("/"):
        while "(" in part and part.endswith(")"):
            part = part[part.index("(") + 1 : -1]
        if part:
            parts.append(part)
    return "/".join(parts)


def matches(pattern: str, path: str) -> bool:
    """Whether rule ``pattern`` matches ``path``: ``re:`` and a regular
    expression found in it, or a glob (`fnmatch`, case-sensitive) that matches
    the whole path or a leading part of it (``params/head`` matches
    ``params/head/kernel``)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + "/*")


# -- the paths of a program's matmuls -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """The paths of one matmul or convolution.

    Attributes:
      scope: its scope path (empty when it has none).
      params: the key paths of the parameters it reads.
      ordinal: its place among the function's matmuls outside loops and
        conditionals (for ``@first`` / ``@last``), or None inside one.
    """

    scope: str
    params: tuple[str, ...]
    ordinal: int | None

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.scope, *self.params) if p)


def _bodies(eqn: compat.Eqn) -> Iterator[tuple[str, compat.ClosedJaxpr]]:
    """``(param name, closed jaxpr)`` of ``eqn``'s sub-jaxprs (an open one
    closed; one with constvars skipped: its constants are the trace's)."""
    for k, v in eqn.params.items():
        for x in v if isinstance(v, tuple) else (v,):
            if compat.is_closed_jaxpr(x):
                yield k, x
            elif compat.is_open_jaxpr(x) and not x.constvars:
                yield k, compat.close(x, [])


def _operands(eqn: compat.Eqn, where: str, n: int) -> list[Any]:
    """The operands of ``eqn`` that its sub-jaxpr at param ``where`` (of ``n``
    inputs) reads unchanged as its inputs, by position (None: a loop carry,
    which changes); [] where they cannot be aligned."""
    ins: list[Any] = list(eqn.invars)
    name = eqn.primitive.name
    if name == "cond":
        ins = ins[1:]
    elif name == "while":
        cn, bn = compat.while_split(eqn.params)
        consts = ins[:cn] if where == "cond_jaxpr" else ins[cn : cn + bn]
        ins = consts + [None] * (len(ins) - cn - bn)
    elif name == "scan":
        nc, ncarry = compat.scan_split(eqn.params)
        ins = ins[:nc] + [None] * ncarry + ins[nc + ncarry :]
    return ins if len(ins) == n else []


class Paths:
    """The paths of the matmuls of one trace, and the rules they matched.

    Made by ``planning.plan`` when the policy has rules (once per trace, in
    its memo); `walk` the program first, then ask `rule_of` while planning.
    """

    def __init__(self, policy: Policy, in_paths: Sequence[str]):
        self.rules = policy.rules
        self.policy = policy
        self.in_paths = tuple(in_paths)
        #: parameter paths of vars (a program's inputs, what passes them on, bodies' inputs)
        self.var_paths: dict[Any, frozenset[str]] = {}
        #: the scope path a sub-jaxpr's eqns are under, by id of the jaxpr (kept alive)
        self.outer: dict[int, tuple[Any, str]] = {}
        #: the paths of each matmul, by id of its eqn (kept alive)
        self.sites: dict[int, tuple[compat.Eqn, Site]] = {}
        self.walked: set[int] = set()
        self.count = 0  # matmuls with an ordinal
        self.hits: set[int] = set()
        self.seen: dict[str, None] = {}  # every matmul path, in order

    def start(self, jaxpr: compat.Jaxpr) -> None:
        """Gives the top-level jaxpr's inputs their paths."""
        for v, p in zip(jaxpr.invars, self.in_paths):
            self.var_paths[v] = frozenset({p})

    def walk(
        self,
        jaxpr: compat.Jaxpr,
        prepare: Callable[[compat.ClosedJaxpr], Any] | None,
        outer: str = "",
        ordered: bool = True,
    ) -> None:
        """Records the paths of ``jaxpr``'s matmuls (and, with ``prepare``, of
        its sub-jaxprs', each prepared as the planner will: recursively).
        ``outer``: the scope path of the eqn that holds ``jaxpr``;
        ``ordered``: its matmuls count for ``@first`` / ``@last``."""
        if id(jaxpr) in self.walked:
            return
        self.walked.add(id(jaxpr))
        self.outer.setdefault(id(jaxpr), (jaxpr, outer))
        for eqn in jaxpr.eqns:
            here = "/".join(s for s in (outer, scope_path(str(eqn.source_info.name_stack))) if s)
            self._propagate(eqn)
            if self.policy.class_of(eqn.primitive.name) == "allow":
                self._site(eqn, here, ordered)
            for where, sub in _bodies(eqn):
                body = compat.jaxpr_of(sub)
                ops = _operands(eqn, where, len(body.invars))
                for bv, ov in zip(body.invars, ops):
                    found = self.var_paths.get(ov) if isinstance(ov, compat.Var) else None
                    if found:
                        self.var_paths[bv] = self.var_paths.get(bv, frozenset()) | found
                self.outer.setdefault(id(body), (body, here))
                if prepare is None:
                    continue
                prepared = compat.jaxpr_of(prepare(sub))
                self.outer.setdefault(id(prepared), (prepared, here))
                call = ordered and eqn.primitive.name in compat.CALL_LIKE_NAMES
                self.walk(prepared, prepare, here, call)

    def _propagate(self, eqn: compat.Eqn) -> None:
        if eqn.primitive.name not in _PASSTHROUGH:
            return
        ins = [self.var_paths.get(v) if isinstance(v, compat.Var) else None for v in eqn.invars]
        if len(eqn.invars) == len(eqn.outvars) and len(ins) > 1:  # (positional: a barrier)
            pairs = list(zip(eqn.outvars, ins))
        else:
            pairs = [(o, ins[0] if ins else None) for o in eqn.outvars]
        for o, found in pairs:
            if found:
                self.var_paths[o] = found

    def _site(self, eqn: compat.Eqn, scope: str, ordered: bool) -> None:
        if id(eqn) in self.sites:
            return  # (a body shared by two calls: its first call's paths)
        if not any(is_managed_float(getattr(v.aval, "dtype", None)) for v in eqn.invars):
            return
        params: set[str] = set()
        for v in eqn.invars:
            if isinstance(v, compat.Var):
                params |= self.var_paths.get(v, frozenset())
        ordinal = None
        if ordered:
            ordinal, self.count = self.count, self.count + 1
        site = Site(scope, tuple(sorted(params)), ordinal)
        self.sites[id(eqn)] = (eqn, site)
        self.seen.update(dict.fromkeys(site.paths))

    # -- matching --------------------------------------------------------------------

    def rule_of(self, eqn: compat.Eqn, jaxpr: compat.Jaxpr) -> PathRule | None:
        """The first rule that matches a path of matmul ``eqn`` of ``jaxpr``, or None."""
        hit = self.sites.get(id(eqn))
        if hit is None or hit[0] is not eqn:
            if id(jaxpr) not in self.walked:  # (a body planned after the walk)
                _, outer = self.outer.get(id(jaxpr), (None, ""))
                self.walk(jaxpr, None, outer, ordered=False)
            hit = self.sites.get(id(eqn))
            if hit is None or hit[0] is not eqn:
                return None
        site = hit[1]
        for index, (pattern, target) in enumerate(self.rules):
            path = self._match(pattern, site)
            if path is not None:
                self.hits.add(index)
                return PathRule(index, pattern, target, path)
        return None

    def _match(self, pattern: str, site: Site) -> str | None:
        if pattern in (FIRST, LAST):
            want = 0 if pattern == FIRST else self.count - 1
            if site.ordinal is None or site.ordinal != want:
                return None
            return (site.paths or (pattern,))[0]
        return next((p for p in site.paths if matches(pattern, p)), None)

    def check(self, fn_name: str) -> None:
        """Warns (raises under ``Policy(strict=True)``) for every rule that
        matched no matmul or convolution of the trace, naming its pattern and
        paths it could have matched."""
        missed = [(p, t) for i, (p, t) in enumerate(self.rules) if i not in self.hits]
        if not missed:
            return
        seen = list(self.seen)
        some = ", ".join(map(repr, seen[:12])) + (", ..." if len(seen) > 12 else "")
        for pattern, target in missed:
            msg = (
                f"amp({fn_name}): Policy.rules pattern {pattern!r} (-> {target}) matched no "
                f"matmul or convolution (or only ones an earlier rule decided). Their paths (scopes and parameter key paths) are: "
                f"{some or 'none'}. A glob matches a whole path or its leading part "
                "(e.g. 'params/head' or '*/head'); see 'Rules by path' in the docs."
            )
            if self.policy.strict:
                raise ValueError(msg)
            warnings.warn(msg, UnmatchedRuleWarning, stacklevel=4)


class UnmatchedRuleWarning(UserWarning):
    """A rule of ``Policy.rules`` matched no matmul or convolution of a traced function."""


# -- presets ------------------------------------------------------------------------------


def float8_except_first_and_last(target: str = "bfloat16") -> tuple[tuple[str, str], ...]:
    """Rules that keep the first and last matmul of a function out of float8.

    The usual float8 training recipe (torchao, Transformer Engine): the first
    layer reads the raw inputs and the last writes the logits, and both are
    the most sensitive to fp8's 3-bit mantissa. Use with a float8 policy.

    Args:
      target: what those two run in instead (default ``"bfloat16"``).

    Returns:
      ``Policy.rules`` pairs: ``(("@first", target), ("@last", target))``.

    Examples:
      >>> import amp_jax
      >>> amp_jax.Policy("float8", rules=amp_jax.float8_except_first_and_last()).rules
      (('@first', 'bfloat16'), ('@last', 'bfloat16'))
    """
    return ((FIRST, target), (LAST, target))


#: path components of embeddings, LM heads and MoE routers (their whole name, or a part of it)
_HIGH_PATHS = r"re:(^|/)([^/]*(embed|router|wte|wpe)[^/]*|lm_head|head|unembed|gate|logits)(/|$)"


def float32_embeddings_head_routers() -> tuple[tuple[str, str], ...]:
    """A rule that keeps the matmuls of embeddings, the LM head and MoE routers in float32.

    What fine-tuners keep in high precision: a path component that contains
    ``embed``, ``router``, ``wte`` or ``wpe``, or is ``lm_head``, ``head``,
    ``unembed``, ``gate`` (a Mixtral router) or ``logits``. One pattern, so it
    warns only when none of them is found.

    Returns:
      ``Policy.rules`` pairs: one regular expression -> ``"float32"``.

    Examples:
      >>> import amp_jax
      >>> from amp_jax._src.paths import matches
      >>> ((pattern, target),) = amp_jax.float32_embeddings_head_routers()
      >>> [matches(pattern, p) for p in ("params/lm_head/kernel", "layers/0/gate_proj/kernel")]
      [True, False]
    """
    return ((_HIGH_PATHS, "float32"),)
