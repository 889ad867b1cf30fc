"""`AmpFunction`, what [`amp`][amp_jax.amp] returns (api.py): the transformation at work.

A call takes its arguments apart
(calling.py's `Call`), finds the plan of their signature in its `TraceCache`
(else traces ``fn`` and plans the jaxpr), and evaluates the plan under the
caller's trace; what ``fn`` wrote into its arguments is carried back
(mutation.py, nnx_nodes.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from amp_jax._src import backends, compat, mutation, nnx_nodes, paths, plans
from amp_jax._src.calling import (
    Call,
    CallKey,
    TraceCache,
    fn_name,
    is_tree,
    name_like,
    shared_cache,
    unwrap_statics,
)
from amp_jax._src.compat import KeyPath
from amp_jax._src.context import Context
from amp_jax._src.interpreter import EVALUATOR, evaluate
from amp_jax._src.plain_objects import check_arguments, check_no_leak
from amp_jax._src.planning import plan
from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, scope_in
from amp_jax._src.returning import (
    InputRef,
    as_output,
    fresh,
    is_output_value,
    out_refs,
    static_outputs,
)

#: the traces amp functions evaluate while `recording_traces` is open (diagnostics)
_RECORDED: contextvars.ContextVar[list[Traced] | None] = contextvars.ContextVar(
    "amp_jax_recorded", default=None
)


@contextlib.contextmanager
def recording_traces() -> Iterator[list[Traced]]:
    """Collects the `Traced` of every amp function called inside: what
    [`dtype_report`][amp_jax.dtype_report] reads the decisions of a program
    that calls amp functions (``jax.grad(amp(f))``) from."""
    found: list[Traced] = []
    token = _RECORDED.set(found)
    try:
        yield found
    finally:
        _RECORDED.reset(token)


@dataclasses.dataclass(frozen=True)
class Traced:
    """What tracing one `Call` gives: the plan amp evaluates on every call.

    Attributes:
      plan: the plan of the traced jaxpr (one decision per equation).
      out_tree: the structure of ``fn``'s output.
      statics: its static leaves (a string, a callable, a Python scalar;
        `returning.is_output_value`)
        by index, returned as they are: the jaxpr's outputs are the others.
      ctx: the context the plan was made in (it holds the sub-jaxprs' plans).
      writes: what ``fn`` writes into its arguments (the jaxpr's last outputs), or None.
      staged: the evaluation of the plan as a ``jax.jit``, when ``fn`` is itself
        a jitted function (its whole program one ``jit``): amp keeps that jit,
        so that an eager call compiles once, as ``jax.jit(h)(x)`` does, rather
        than dispatching each op; None otherwise.
      new_refs: the output leaves that are mutable arrays ``fn`` made
        (``jax.new_ref``): the jaxpr returns their values, amp new Refs of them.
      out_aliases: the Flax NNX nodes the output holds that are an argument's
        or another output's (key paths into ``((args, kwargs), out)``): the
        output gives back that one object, as ``fn`` did.
    """

    plan: plans.Plan
    out_tree: compat.PyTreeDef
    ctx: Context
    writes: mutation.Writes | None = None
    staged: Callable[..., list[Any]] | None = None
    out_aliases: nnx_nodes.Aliases = ()
    statics: tuple[tuple[int, Any], ...] = ()
    new_refs: tuple[int, ...] = ()

    @property
    def num_outputs(self) -> int:
        """How many of the jaxpr's outputs are ``fn``'s (the rest are its writes)."""
        return self.out_tree.num_leaves - len(self.statics)

    @property
    def reusable(self) -> bool:
        """False when the jaxpr captured tracers of an enclosing transformation:
        it is only valid inside that transformation."""
        return not any(isinstance(c, compat.Tracer) for c in compat.consts_of(self.plan.closed))


class _Counter:
    """How many times an amp function (and the copies JAX makes of it as a
    pytree) traced ``fn``. Part of its pytree structure, and equal to every
    other counter, so that two equal amp functions are equal pytrees."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Counter)

    def __hash__(self) -> int:
        return hash(_Counter)


@jax.tree_util.register_pytree_with_keys_class
class AmpFunction:
    """The callable returned by [`amp`][amp_jax.amp]; also exposes its trace cache.

    A pytree whose one child is ``fn``: ``amp(model)`` of an Equinox or Flax
    NNX module holds the model's arrays, so ``eqx.filter_grad``,
    ``nnx.grad`` and ``jax.tree`` functions see them (as with
    ``eqx.filter_jit(model)``), and each call traces them as arguments.
    """

    # amp's own state lives in slots, not in ``__dict__``: ``functools.wraps``,
    # ``jax.jit``, ``jax.grad`` and ``jax.vmap`` copy a function's ``__dict__``
    # onto their wrapper, and an amp function applied to such a wrapper of
    # another amp function would otherwise take the inner one's ``fn`` and
    # trace cache for its own (slots, data descriptors, win over ``__dict__``)
    __slots__ = (
        "fn",
        "policy",
        "cache_size",
        "_shared",
        "_anchored",
        "_count",
        "_scopes",
        "__dict__",
        "__weakref__",
    )

    def __init__(self, fn: Callable[..., Any], policy: Policy, cache_size: int = 64):
        # (a pytree fn's __dict__ holds its arrays: not copied, they would go stale)
        functools.update_wrapper(self, fn, updated=() if is_tree(fn) else ("__dict__",))
        self.fn = fn
        self.policy = policy
        self.cache_size = cache_size
        # (shared by every amp(fn) of an equal fn and options: equal pytrees, one trace)
        self._shared, self._anchored = shared_cache(fn, (policy, cache_size))
        self._count = _Counter()
        self._scopes = (FULL_PRECISION_SCOPE, *policy.full_precision_scopes)

    def tree_flatten_with_keys(
        self,
    ) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, Callable[..., Any]]], tuple[Any, ...]]:
        return ((jax.tree_util.GetAttrKey("fn"), self.fn),), (
            self.policy,
            self.cache_size,
            self._shared,
            self._anchored,
            self._count,
        )

    @classmethod
    def tree_unflatten(
        cls,
        aux: tuple[Policy, int, TraceCache[Traced], bool, _Counter],
        children: Sequence[Callable[..., Any]],
    ) -> AmpFunction:
        new = cls.__new__(cls)
        functools.update_wrapper(new, children[0], updated=())
        new.policy, new.cache_size, new._shared, new._anchored, new._count = aux
        new.fn = children[0]
        new._scopes = (FULL_PRECISION_SCOPE, *new.policy.full_precision_scopes)
        return new

    def __eq__(self, other: object) -> bool:
        """Equal when ``fn`` is (the same module structure with the same
        arrays, an equal callable) and the options are: ``amp(f)`` made twice
        is one function to ``jax.jit``'s cache, as ``eqx.filter_jit``'s are."""
        if not isinstance(other, AmpFunction):
            return NotImplemented
        if (self.policy, self.cache_size) != (other.policy, other.cache_size):
            return False
        if is_tree(self.fn) or is_tree(other.fn):
            tree: compat.PyTreeDef
            other_tree: compat.PyTreeDef
            mine, tree = jax.tree.flatten(self.fn)
            theirs, other_tree = jax.tree.flatten(other.fn)
            return (
                tree == other_tree
                and len(mine) == len(theirs)
                and all(a is b for a, b in zip(mine, theirs))
            )
        try:
            return bool(self.fn == other.fn)
        except Exception:  # (an fn whose == is not a bool, e.g. elementwise)
            return self.fn is other.fn

    def __hash__(self) -> int:
        if is_tree(self.fn):
            leaves, treedef = jax.tree.flatten(self.fn)
            try:
                structure = hash(treedef)
            except TypeError:
                structure = hash(type(self.fn))
            return hash((self.policy, self.cache_size, structure, *map(id, leaves)))
        try:
            fn_hash = hash(self.fn)
        except TypeError:
            fn_hash = hash(type(self.fn))
        return hash((self.policy, self.cache_size, fn_hash))

    @property
    def _cache(self) -> OrderedDict[CallKey, Traced]:
        return self._shared.entries

    @property
    def trace_count(self) -> int:
        """How many times this function (and the copies JAX makes of it) traced
        and rewrote ``fn``: one per new input signature, so a count that keeps
        growing means the cache keeps missing. Amp functions of an equal
        ``fn`` and options share their traces: a fresh ``amp(fn)`` finds the
        traces an earlier one made and counts none for them."""
        return self._count.n

    def __repr__(self) -> str:
        return f"amp({getattr(self.fn, '__qualname__', self.fn)!r}, policy={self.policy.compute_dtype.name!r})"

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        # behave like a function as a method
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        if compat.jit_disabled():
            # under ``jax.disable_jit()`` amp, as jax.jit, runs ``fn`` as Python
            # on concrete values (a debugger, print and Equinox's
            # ``currently_jitting()`` see no tracer), in its own dtypes
            return self.fn(*args, **kwargs)
        if self.policy.is_identity:
            # float32 changes nothing: run the function itself, so that results,
            # gradients and state writes are bitwise its own, eagerly too, and
            # JAX sees its jitted helpers (a re-evaluated jaxpr sums cotangents
            # in another order on JAX 0.12)
            out = self.fn(*args, **kwargs)
            return jax.tree.map(lambda x: as_output(x) if is_output_value(x) else x, out)
        call = Call.of(self.fn, args, kwargs)
        if nnx_nodes.needs_lojax(call.leaves):
            return nnx_nodes.through_lojax(
                lambda *a, **k: self._run(Call.of(call.target, a, k)), call.args, call.kwargs
            )
        return self._run(call)

    def _run(self, call: Call) -> Any:
        """Evaluates ``call``'s plan (traced or from the cache) and gives ``fn``'s output."""
        traced = self._cached_trace(call)
        recorded = _RECORDED.get()
        if recorded is not None:
            recorded.append(traced)
        if traced.staged is not None:
            outs = traced.staged(*call.dynamic)
        else:
            outs = evaluate(traced.ctx, traced.plan, call.dynamic)
        return self._outputs(call, traced, outs)

    def traces(self) -> list[Traced]:
        """The traces this function keeps, least recently used first: what a
        diagnostic that has just called it reads instead of tracing again."""
        return list(self._shared.entries.values())

    def trace_for_inspection(self, *args: object, **kwargs: object) -> Traced:
        """The plan a call with these arguments evaluates, traced afresh (not
        cached): what [`explain`][amp_jax.explain] and the debug tools read."""
        call = Call.of(self.fn, args, kwargs)
        check_arguments(self.fn, call)
        return self._trace(call)

    def _cached_trace(self, call: Call) -> Traced:
        """The trace of ``call``'s signature: from the cache, else traced and kept."""
        in_scope = scope_in(compat.current_name_stack_str(), self._scopes) is not None
        key = call.key(full_precision=in_scope, anchored=self._anchored)
        traced = self._shared.get(key)
        if traced is None:
            check_arguments(self.fn, call)
            traced = self._trace(call)
            if traced.reusable:
                self._shared.put(key, traced, self.cache_size)
        return traced

    def _trace(self, call: Call) -> Traced:
        """Traces ``call`` with the user's name, source line and signature (through
        ``__wrapped__``), so that JAX's errors name them and the arguments as
        jax.jit does, and plans the jaxpr."""
        found: list[mutation.Writes | None] = []
        shared: list[nnx_nodes.Aliases] = []
        outputs: list[tuple[compat.PyTreeDef, dict[int, Any], list[int]]] = []

        def traced_fn(*args: object, **kwargs: object) -> Any:
            tree = nnx_nodes.tie(unwrap_statics((args, kwargs)), call.aliases)
            snap = mutation.Snapshot(tree)
            with mutation.haiku_guard(fn_name(self.fn)):
                out = call.target(*tree[0], **tree[1])
            check_no_leak(self.fn, call)
            _refuse_cycle(fn_name(self.fn), call, nnx_nodes.find_cycle((tree, out)))
            try:
                writes = mutation.collect(snap, tree, call.path_name)
            except TypeError as e:
                raise TypeError(f"amp({fn_name(self.fn)}): the function {e}") from None
            found.append(writes)
            shared.append(nnx_nodes.output_aliases(tree, out))
            # (a non-array leaf -- a model's activation function, an aux string
            # -- is carried out of the trace as it is, as eqx.filter_jit does)
            # (and a module fn captured, as itself: as plain Python returns it)
            kept = set() if call.fn_is_argument else nnx_nodes.captured_outputs(self.fn, tree, out)
            leaves, out_tree = jax.tree.flatten(
                out, is_leaf=(lambda x: id(x) in kept) if kept else None
            )
            statics = static_outputs(leaves, fn_name(self.fn), kept)
            made = out_refs(leaves, statics, jax.tree.leaves((args, kwargs)))
            outputs.append((out_tree, statics, made))
            arrays = [x for i, x in enumerate(leaves) if i not in statics]
            return arrays if writes is None else (arrays, writes.outputs)

        name_like(traced_fn, self.fn, self_first=call.fn_is_argument)
        t_args, t_kwargs = call.abstract()
        closed, _ = compat.trace_with_shape_kw(traced_fn, t_args, t_kwargs)
        if len(compat.in_avals(closed)) != sum(call.dynamic_mask):  # pragma: no cover
            raise AssertionError("amp_jax: traced arguments do not match; please report this.")
        self._shared.trace_count += 1
        self._count.n += 1
        writes = found[0]
        out_tree, statics, made = outputs[0]
        in_paths: tuple[str, ...] = ()
        if self.policy.rules:  # (what Policy.rules match parameters by)
            in_paths = paths.input_paths(call.args, call.kwargs, call.names, call.dynamic_mask)
        ctx = Context(self.policy, backends.current(), in_paths=in_paths, evaluator=EVALUATOR)
        planned = plan(ctx, closed)
        if ctx.memo.paths is not None:
            ctx.memo.paths.check(fn_name(self.fn))
        name = _whole_jit_name(closed)
        staged = None
        if name is not None:

            def run(*args: object) -> list[Any]:
                return evaluate(ctx, planned, args)

            run.__name__ = run.__qualname__ = name
            staged = jax.jit(run)
        statics = dict(sorted(statics.items()))
        return Traced(
            planned, out_tree, ctx, writes, staged, shared[0], tuple(statics.items()), tuple(made)
        )

    def _outputs(self, call: Call, traced: Traced, outs: list[Any]) -> Any:
        """``fn``'s output from the evaluated jaxpr's; its writes carried to the arguments."""
        n = traced.num_outputs
        if traced.writes is not None:
            # (a constant written is a jaxpr literal: an Array, as jit stores it)
            after = traced.writes.after(call.leaves, [as_output(o) for o in outs[n:]])
            nnx_nodes.write_back((call.args, call.kwargs), after, traced.writes.moves)
        # an input returned as it is (``amp(jnp.asarray)``: the jaxpr has no
        # eqn) is a new value, as jit's outputs are: under ``jax.jvp`` of a
        # Python float, that input is a tracer of a float, and ``jax.jvp``
        # would hand the float back where ``jax.jvp(jnp.asarray)`` gives an Array
        inputs = {id(x) for x in call.dynamic}
        outs = [fresh(o) if id(o) in inputs else as_output(o) for o in outs[:n]]
        for i, value in traced.statics:
            outs.insert(i, call.dynamic[value.index] if isinstance(value, InputRef) else value)
        for i in traced.new_refs:  # (a Ref fn made: a new one, as nnx.jit returns it)
            outs[i] = jax.new_ref(outs[i])
        out = jax.tree.unflatten(traced.out_tree, outs)
        if traced.out_aliases:
            out = nnx_nodes.tie(((call.args, call.kwargs), out), traced.out_aliases)[1]
        return out


def _refuse_cycle(name: str, call: Call, cycle: tuple[KeyPath, KeyPath] | None) -> None:
    """A clear error where ``fn`` left an NNX node below itself in its
    arguments or output (``m.ref = m``), before a flatten recurses without end."""
    if cycle is None:
        return

    def where(path: KeyPath) -> str:
        if path[0] == jax.tree_util.SequenceKey(1):
            return f"the output{jax.tree_util.keystr(tuple(path[1:]))}"
        return f"`{call.path_name(tuple(path[1:]))}`"

    inner, outer = cycle
    raise TypeError(
        f"amp({name}): the function made a cycle: {where(inner)} is {where(outer)}, which "
        "holds it. amp carries writes and outputs out as pytrees, which cannot hold a "
        "cycle; keep the reference outside the amp function, or run this step with "
        "nnx.jit (its graph mode follows references)."
    )


def _whole_jit_name(closed: compat.ClosedJaxpr) -> str | None:
    """The name of the ``jit`` that is the whole of ``closed`` (``fn`` is a
    jitted function: one jit eqn, fed the program's inputs, giving its
    outputs), unless JAX inlines that jit itself; else None."""
    jaxpr = compat.jaxpr_of(closed)
    if len(jaxpr.eqns) != 1:
        return None
    (eqn,) = jaxpr.eqns
    if eqn.primitive.name not in compat.JIT_NAMES or compat.jit_inlined_by_jax(eqn):
        return None
    if list(eqn.invars) != list(jaxpr.invars) or list(eqn.outvars) != list(jaxpr.outvars):
        return None
    return str(eqn.params.get("name", "jit"))
