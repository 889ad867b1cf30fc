"""A small jaxpr toolkit: what every walker of a jaxpr in amp needs.

Opening a sub-jaxpr (closed or not), iterating the eqns of a jaxpr and of
its sub-jaxprs, def-use maps, the size of a contraction, and the one
evaluator (`eval_jaxpr`, with a per-eqn hook). The interpreter, planning,
``attention``, ``explain``, ``dtype_report``, debug and eager use these
instead of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax.extend import core as jex_core

from amp_jax._src import compat

#: a name stack (``eqn.source_info.name_stack``)
NameStack = Any


def open_jaxpr(sub: compat.Jaxpr | compat.ClosedJaxpr) -> tuple[compat.Jaxpr, list[Any]]:
    """``(jaxpr, consts)`` of a sub-jaxpr found in an eqn's params (closed or not)."""
    if compat.is_closed_jaxpr(sub):
        return compat.jaxpr_of(sub), list(compat.consts_of(sub))
    return sub, []


def closed_subjaxprs(eqn: compat.Eqn) -> list[compat.ClosedJaxpr]:
    """The sub-jaxprs of ``eqn``, each as a closed jaxpr."""
    return [
        s if compat.is_closed_jaxpr(s) else compat.close(s, [])
        for s in jex_core.jaxprs_in_params(eqn.params)
    ]


#: primitives that call their sub-jaxpr once, whose jaxpr JAX may have traced
#: (and cached) at another call site: their eqns' source lines are the call's
_CALLS = compat.JIT_NAMES | compat.CUSTOM_JVP_NAMES | compat.CUSTOM_VJP_NAMES


def line_site(eqn: compat.Eqn, site: compat.Eqn | None = None) -> compat.Eqn | None:
    """The eqn whose source line the eqns of ``eqn``'s sub-jaxprs have
    (`iter_eqns`): ``site`` (an enclosing call's), else ``eqn`` if it is a
    call, else None (their own)."""
    return site if site is not None or eqn.primitive.name not in _CALLS else eqn


def iter_eqns(
    jaxpr: compat.Jaxpr,
    path: str = "",
    times: int = 1,
    stack: tuple[str, ...] = (),
    site: compat.Eqn | None = None,
) -> Iterator[tuple[compat.Eqn, str, int, tuple[str, ...], compat.Eqn]]:
    """``(eqn, enclosing primitives, times it runs, enclosing eqns' name
    stacks, the eqn whose source line it has)`` for every first-order eqn of
    ``jaxpr`` and of its sub-jaxprs (a ``scan`` body runs ``length`` times; a
    ``while`` body is counted once, every ``cond`` branch once). A
    sub-jaxpr's name stacks are relative to the eqn that holds it: the full
    stack is ``(*stack, eqn's own)``. An eqn inside a ``jit`` or custom
    derivative call has the source line of the outermost such call: JAX
    reuses a traced body at every call site with the same types (amp's dots),
    so the body's own tracebacks can name another call."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(jex_core.jaxprs_in_params(eqn.params))
        if subs:
            inner = times * int(eqn.params.get("length", 1)) if name == "scan" else times
            inner_stack = (*stack, str(eqn.source_info.name_stack))
            # (a jit JAX inlines where it stages it -- amp's dots, jnp's helpers -- is no place)
            here = path if compat.jit_inlined_by_jax(eqn) else f"{path}/{name}" if path else name
            at = line_site(eqn, site)
            for sub in subs:
                yield from iter_eqns(open_jaxpr(sub)[0], here, inner, inner_stack, at)
            continue
        yield eqn, path, times, stack, (eqn if site is None else site)


def def_use(jaxpr: compat.Jaxpr) -> tuple[dict[compat.Var, int], dict[compat.Var, list[int]]]:
    """``(producer, consumers)``: the index of the eqn that writes each var, and
    the indices of the eqns that read it (literals are nobody's)."""
    producer: dict[compat.Var, int] = {}
    consumers: dict[compat.Var, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.outvars:
            producer[v] = i
        for a in e.invars:
            if not isinstance(a, compat.Literal):
                consumers.setdefault(a, []).append(i)
    return producer, consumers


def shape_of(atom: compat.Atom) -> tuple[int, ...]:
    """The shape of a jaxpr variable or literal (``()`` for tokens and the like)."""
    return tuple(getattr(atom.aval, "shape", ()))


def read(env: dict[compat.Var, Any], atom: compat.Atom) -> Any:
    """The value of a var in ``env``, or of a literal."""
    return compat.literal_value(atom) if isinstance(atom, compat.Literal) else env[atom]


# -- the evaluator ----------------------------------------------------------------


class Values(Protocol):
    """What `eval_jaxpr` needs of an environment: writing a var's value, and
    reading the outputs (unless an ``output`` function reads them)."""

    def read(self, atom: compat.Atom) -> Any: ...

    def write(self, var: compat.Var, value: Any) -> None: ...


class Env:
    """The values of a jaxpr's vars in one evaluation, in some value domain.

    ``literal`` gives a literal's value in the domain: by default its
    constant; an abstract analysis (a dependency set per var) gives its own.
    """

    def __init__(
        self,
        literal: Callable[[compat.Literal], Any] = compat.literal_value,
        vals: dict[compat.Var, Any] | None = None,
    ):
        self.vals: dict[compat.Var, Any] = {} if vals is None else vals
        self.literal = literal

    def read(self, atom: compat.Atom) -> Any:
        return self.literal(atom) if isinstance(atom, compat.Literal) else self.vals[atom]

    def write(self, var: compat.Var, value: Any) -> None:
        if not compat.is_drop_var(var):
            self.vals[var] = value

    def operands(self, eqn: compat.Eqn) -> list[Any]:
        """The values of ``eqn``'s operands."""
        return [self.read(v) for v in eqn.invars]


#: ``hook(i, eqn, env)``: the results of ``eqn``, the ``i``-th eqn of its jaxpr,
#: read from ``env`` (the hook decides how: bind it, bind it through a rule,
#: inline it, probe it, propagate an abstract value)
Hook = Callable[[int, compat.Eqn, Any], Sequence[Any]]


def bind(i: int, eqn: compat.Eqn, env: Env) -> list[Any]:
    """The default `Hook`: binds ``eqn`` as it is, on its operands' values."""
    del i
    return compat.bind_eqn(eqn, env.operands(eqn))


def bind_jitted(eqn: compat.Eqn, invals: Sequence[Any]) -> list[Any] | None:
    """``eqn`` bound on ``invals`` as `bind` binds it, but through a
    ``jax.jit(..., inline=True)`` cached per primitive, params, literal
    operands and caller's source line, as ``jnp``'s own functions are: under
    ``grad`` JAX then linearizes the op once per jaxpr and reuses that at every
    layer, instead of once per call, and inlines it where it stages it, so the
    program is the one `bind` gives. None where that does not hold (no
    operand of a program being staged: eager values, or an eager ``grad``, whose
    ops run one by one, as written; a JAX that keeps such calls in the jaxpr (0.11+), a
    primitive with effects or sub-jaxprs, unhashable params): bind it there."""
    if not (compat.inline_jits_staged() and any(compat.is_staged(x) for x in invals)):
        return None
    if eqn.effects or compat.has_subjaxprs(eqn):
        return None
    lits = {k: a for k, a in enumerate(eqn.invars) if isinstance(a, compat.Literal)}
    key = (
        eqn.primitive,
        len(eqn.invars),  # (sort: the same params on one operand or more)
        tuple(eqn.params.items()),
        tuple((k, _literal_key(a)) for k, a in lits.items()),
        compat.current_source_line(),  # (a reused trace keeps its first call's lines)
    )
    try:
        fn = _JITTED.get(key)
    except TypeError:  # (unhashable params)
        return None
    if fn is None:
        if len(_JITTED) >= _JITTED_MAX:
            _JITTED.clear()
        fixed = {k: compat.literal_value(a) for k, a in lits.items()}
        fn = _JITTED[key] = _jitted_bind(eqn, fixed)
    out = fn(*(x for k, x in enumerate(invals) if k not in lits))
    return list(out) if eqn.primitive.multiple_results else [out]


#: `bind_jitted`'s functions, by primitive, params, literals and source line
_JITTED: dict[tuple[Any, ...], Callable[..., Any]] = {}
_JITTED_MAX = 4096


def _jitted_bind(eqn: compat.Eqn, fixed: dict[int, Any]) -> Callable[..., Any]:
    """``eqn``'s primitive bound with its params, its literal operands ``fixed``
    (by position: closed over, so that they stay literals), jitted inline."""
    n = len(eqn.invars)

    def bound(*args: Any) -> Any:
        rest = iter(args)
        operands = [fixed[k] if k in fixed else next(rest) for k in range(n)]
        out = compat.bind_eqn(eqn, operands)
        return out if eqn.primitive.multiple_results else out[0]

    return jax.jit(bound, inline=True)


def _run(eqns: Iterable[compat.Eqn], env: Values, hook: Hook) -> None:
    for i, eqn in enumerate(eqns):
        source, ctx = compat.eqn_context(eqn)  # its source line and name stack; its ctx
        with source, ctx:
            outs = hook(i, eqn, env)
        for v, o in zip(eqn.outvars, outs):
            env.write(v, o)


def eval_jaxpr(
    jaxpr: compat.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    hook: Hook = bind,
    env: Values | None = None,
    output: Callable[[compat.Atom], Any] | None = None,
) -> list[Any]:
    """``jaxpr`` evaluated on ``args``: the one walk of a jaxpr in amp.

    Writes ``consts`` and ``args`` into ``env`` (default: a fresh `Env`),
    gets each eqn's results from ``hook`` under the eqn's source context and
    writes them (a dropped var is not kept), and reads the outputs with
    ``output`` (default: ``env.read``). The interpreter, jit inlining, debug's
    probes and eager's dependency analysis are hooks on it.
    """
    env = Env() if env is None else env
    for v, c in zip(jaxpr.constvars, consts):
        env.write(v, c)
    for v, a in zip(jaxpr.invars, args):
        env.write(v, a)
    _run(jaxpr.eqns, env, hook)
    output = env.read if output is None else output
    return [output(v) for v in jaxpr.outvars]


def run_eqns(eqns: Iterable[compat.Eqn], env: dict[compat.Var, Any], hook: Hook = bind) -> None:
    """Evaluates ``eqns`` (a slice of a jaxpr) in order as `eval_jaxpr` does,
    reading their operands from the plain dict ``env`` and writing their
    results there."""
    _run(eqns, Env(vals=env), hook)


def inline(
    closed: compat.ClosedJaxpr,
    inlinable: Callable[[compat.Eqn], bool],
    body: Callable[[compat.Eqn], compat.ClosedJaxpr],
) -> compat.ClosedJaxpr:
    """``closed`` with every eqn that ``inlinable`` accepts replaced by the eqns
    of its closed jaxpr ``body(eqn)`` (recursively), spliced in place.

    The other eqns are kept as they are (the same objects) unless they read a
    result that an inlined body forwards from its inputs or writes as a literal.
    A spliced eqn gets fresh vars, or the inlined eqn's own result vars, and
    the name stack of the eqn it came from in front of its own, as tracing
    the body in place under that eqn's context would give it. The bodies'
    constants become constants of the result.
    """
    jaxpr = compat.jaxpr_of(closed)
    if not any(inlinable(e) for e in jaxpr.eqns):
        return closed
    constvars, consts = list(jaxpr.constvars), list(compat.consts_of(closed))
    eqns: list[compat.Eqn] = []
    folds = _Folds()  # (a helper's body eqn, inlined at every layer, folds once)

    def splice(
        src: Iterable[compat.Eqn], sub: dict[compat.Var, compat.Atom], stack: NameStack | None
    ) -> None:
        def atom(a: compat.Atom) -> compat.Atom:
            return a if isinstance(a, compat.Literal) else sub.get(a, a)

        def results(e: compat.Eqn) -> list[compat.Var]:
            # its result vars here: own ones at the top (a result var maps to a var)
            if stack is None:
                return list(e.outvars)
            for v in e.outvars:
                if v not in sub and not compat.is_drop_var(v):
                    sub[v] = jex_core.Var(v.aval)
            return [cast(compat.Var, sub.get(v, v)) for v in e.outvars]

        for e in src:
            invars = [atom(v) for v in e.invars]
            if inlinable(e):
                inner, bconsts = open_jaxpr(body(e))
                own = dict(zip(inner.invars, invars))
                for cv, c in zip(inner.constvars, bconsts):
                    fresh = jex_core.Var(cv.aval)
                    own[cv] = fresh
                    constvars.append(fresh)
                    consts.append(c)
                made = {v for be in inner.eqns for v in be.outvars}
                outs = results(e)
                for bo, ov in zip(inner.outvars, outs):  # results keep their vars
                    lit = isinstance(bo, compat.Literal)
                    if not lit and bo in made and bo not in own and not compat.is_drop_var(ov):
                        own[bo] = ov
                here = (
                    e.source_info.name_stack if stack is None else stack + e.source_info.name_stack
                )
                splice(inner.eqns, own, here)
                for v, bo, ov in zip(e.outvars, inner.outvars, outs):
                    if isinstance(bo, compat.Literal):
                        sub[v] = bo
                    elif not compat.is_drop_var(ov) and own.get(bo) is not ov:
                        sub[v] = own[bo]
                continue
            if stack is None:  # an eqn of ``closed`` itself
                eqns.append(e if invars == list(e.invars) else e.replace(invars=invars))
                continue
            folded = folds.get(e, invars) if invars != list(e.invars) else None
            if folded is not None:  # as tracing it in place folds it
                sub.update(zip(e.outvars, folded))
                continue
            info = e.source_info.replace(name_stack=stack + e.source_info.name_stack)
            eqns.append(e.replace(invars=invars, outvars=results(e), source_info=info))

    top: dict[compat.Var, compat.Atom] = {}
    splice(jaxpr.eqns, top, None)
    outvars = [v if isinstance(v, compat.Literal) else top.get(v, v) for v in jaxpr.outvars]
    new = jex_core.Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)
    return compat.close(new, consts)


class _Folds:
    """`_folded` of the eqns one `inline` splices, each traced once per eqn
    and literal operands: the body of a ``jnp`` helper is one jaxpr at every
    call site (JAX caches its trace), so the same body eqn folds the same
    literals at each of a model's layers. A hit gives new `Literal` objects
    (each spliced eqn its own, as a trace in place would)."""

    def __init__(self) -> None:
        #: (id of the body eqn, its literal operands) -> (the eqn, what it folds to)
        self.made: dict[tuple[Any, ...], tuple[compat.Eqn, list[compat.Atom] | None]] = {}

    def get(self, eqn: compat.Eqn, invars: list[compat.Atom]) -> list[compat.Atom] | None:
        """``_folded(eqn, invars)``, traced once per eqn and literal operands."""
        if not invars or not all(isinstance(v, compat.Literal) for v in invars):
            return None
        try:
            key = (id(eqn), *(_literal_key(v) for v in invars if isinstance(v, compat.Literal)))
            hit = self.made.get(key)
        except TypeError:  # (a literal numpy cannot read, e.g. of an extended dtype: not kept)
            return _folded(eqn, invars)
        if hit is None or hit[0] is not eqn:
            hit = self.made[key] = (eqn, _folded(eqn, invars))
        lits = cast(list[compat.Literal] | None, hit[1])  # (all literals, or None)
        return None if lits is None else [jex_core.Literal(v.val, v.aval) for v in lits]


def _literal_key(lit: compat.Literal) -> tuple[Any, ...]:
    """A literal by value: its Python type, aval (dtype, weak type) and bytes."""
    val = compat.literal_value(lit)
    arr = np.asarray(val)
    return (type(val), lit.aval, arr.dtype.str, arr.shape, arr.tobytes())


def _folded(eqn: compat.Eqn, invars: list[compat.Atom]) -> list[compat.Atom] | None:
    """The literal results of ``eqn`` on ``invars`` when all are literals and
    JAX's tracing folds it (a ``convert_element_type`` of a constant), else None."""
    if not invars or not all(isinstance(v, compat.Literal) for v in invars):
        return None
    if eqn.effects or any(True for _ in jex_core.jaxprs_in_params(eqn.params)):
        return None
    vals = [compat.literal_value(v) for v in invars if isinstance(v, compat.Literal)]
    staged = compat.trace_to_closed_jaxpr(lambda: compat.bind_eqn(eqn, vals), [])
    outs = compat.jaxpr_of(staged).outvars
    if compat.jaxpr_of(staged).eqns or not all(isinstance(v, compat.Literal) for v in outs):
        return None
    return list(outs)


def called_jaxpr(eqn: compat.Eqn) -> compat.Jaxpr | compat.ClosedJaxpr | None:
    """The one sub-jaxpr that ``eqn`` runs once on its operands, giving its
    results (``jit``, ``checkpoint``, a ``custom_jvp``/``custom_vjp`` call),
    else None."""
    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if len(subs) != 1:
        return None
    j = open_jaxpr(subs[0])[0]
    if len(j.invars) == len(eqn.invars) and len(j.outvars) == len(eqn.outvars):
        return subs[0]
    return None


def contraction_and_flops(eqn: compat.Eqn) -> tuple[int, int] | None:
    """``(contraction length, FLOPs)`` of a ``dot_general`` or convolution eqn, else None."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = shape_of(eqn.invars[0])
        k = int(np.prod([lhs[d] for d in lc], dtype=np.int64))
    elif name == "conv_general_dilated":
        w = shape_of(eqn.invars[1])
        dn = eqn.params.get("dimension_numbers")
        out_dim = dn.rhs_spec[0] if dn is not None and hasattr(dn, "rhs_spec") else 0
        k = int(np.prod(w, dtype=np.int64)) // max(int(w[out_dim]), 1)  # in-features x window
    else:
        return None
    return k, 2 * k * int(np.prod(shape_of(eqn.outvars[0]), dtype=np.int64))
