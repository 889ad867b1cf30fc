"""What a function writes into its arguments, carried out of ``amp``'s trace.

``amp`` traces ``fn`` on a copy of its arguments (their pytree leaves
replaced by tracers). A Flax NNX module is a mutable pytree: ``fn`` may write
its ``Variable``s (BatchNorm statistics, RNG counts, ``sow``), and those
writes land in the copy. While tracing, `collect` compares the copy
after ``fn`` with its snapshot from before, returns the changed leaves (extra
outputs of the jaxpr) and checks that `write_back` reproduces the
change; after evaluation `write_back` updates the caller's objects with
the public NNX API (``nnx.state`` / ``nnx.update``), as ``nnx.jit`` does. A
change it cannot reproduce (a plain container or attribute written) is
refused with the construct and the fix, never dropped.

Haiku keeps parameters, state and random keys in the frame of its transform,
outside the arguments: `haiku_guard` refuses a function that touches
them while amp traces it inside a transform (the fix: ``amp(model.apply)``).

Flax and Haiku are never imported here: their objects exist only if the
caller imported them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from amp_jax._src import compat
from amp_jax._src.compat import KeyPath


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


class Snapshot:
    """The leaves (by key path) and structure of the argument tree before ``fn`` ran."""

    __slots__ = ("flat", "leaves", "treedef", "by_path")

    def __init__(self, tree: object) -> None:
        self.treedef: compat.PyTreeDef
        self.flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.leaves = [leaf for _, leaf in self.flat]
        self.by_path = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(self.flat)}


def _refuses_flatten(x: object) -> bool:
    """Whether the pytree node ``x`` refuses to be flattened: a value ``fn``
    consumed (an Equinox ``State`` once a stateful layer has used it)."""
    try:
        jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    except Exception:  # (whatever the library raises)
        return True
    return False


def _flatten_after(
    snap: Snapshot, tree: object
) -> tuple[list[tuple[KeyPath, Any]], compat.PyTreeDef]:
    """The leaves (with key paths) and structure of ``tree`` after ``fn`` ran.

    A node that ``fn`` consumed and that now refuses to be flattened (an
    Equinox ``State`` that a layer used: Equinox invalidates it) was not
    written in place; its leaves are the snapshot's. This must never fail
    where the function worked: under ``jax.jit`` the caller's value would
    stay valid too.
    """
    try:
        return jax.tree_util.tree_flatten_with_path(tree)
    except Exception:  # (a consumed node; whatever its library raises)
        pass
    consumed: set[int] = set()

    def stop_at_consumed(x: object) -> bool:
        if _refuses_flatten(x):
            consumed.add(id(x))
            return True
        return False

    flat: list[tuple[KeyPath, Any]] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop_at_consumed)[0]:
        if id(leaf) in consumed:
            n = len(path)
            flat += [(p, x) for p, x in snap.flat if tuple(p[:n]) == tuple(path)]
        else:
            flat.append((path, leaf))
    return flat, snap.treedef


class Writes:
    """What ``fn`` wrote into its arguments, found while tracing it.

    Attributes:
      treedef: the structure of the argument tree after ``fn``.
      sources: for each leaf after ``fn``: the index of the unchanged leaf
        before it, or ``None`` for a written leaf.
      outputs: the written leaves that are arrays (extra jaxpr outputs), in order.
      constants: {position: value} of the written leaves that are not arrays.
    """

    __slots__ = ("treedef", "sources", "outputs", "constants")

    def __init__(
        self,
        treedef: compat.PyTreeDef,
        sources: list[int | None],
        outputs: list[Any],
        constants: dict[int, Any],
    ) -> None:
        self.treedef, self.sources = treedef, sources
        self.outputs, self.constants = outputs, constants

    def after(self, leaves: Sequence[Any], values: Sequence[Any]) -> Any:
        """The argument tree after ``fn``: unchanged ``leaves`` and written ``values``."""
        it = iter(values)
        flat = [
            leaves[s] if s is not None else self.constants[i] if i in self.constants else next(it)
            for i, s in enumerate(self.sources)
        ]
        return jax.tree.unflatten(self.treedef, flat)

    def changed(self, after: object) -> set[int]:
        """The ids of the leaves of ``after`` (a tree from `after`) that were written."""
        flat = jax.tree.leaves(after)
        return {id(flat[i]) for i, s in enumerate(self.sources) if s is None}


def _is_array(x: object) -> bool:
    return isinstance(x, (jax.Array, compat.Tracer))


def collect(snap: Snapshot, tree: object, describe: Callable[[KeyPath], str]) -> Writes | None:
    """The writes ``fn`` made into ``tree`` since ``snap`` (None if none).

    Raises:
      TypeError: a write that `write_back` cannot carry to the caller;
        ``describe`` turns a key path (into ``tree``) into the argument's name
        and the reason, for the message.
    """
    flat, treedef = _flatten_after(snap, tree)
    if treedef == snap.treedef and all(a is b for (_, a), b in zip(flat, snap.leaves)):
        return None
    sources: list[int | None] = []
    for path, leaf in flat:
        i = snap.by_path.get(jax.tree_util.keystr(path))
        sources.append(i if i is not None and snap.leaves[i] is leaf else None)
    written = [i for i, s in enumerate(sources) if s is None]
    outputs = [flat[i][1] for i in written if _is_array(flat[i][1])]
    constants = {i: flat[i][1] for i in written if not _is_array(flat[i][1])}
    writes = Writes(treedef, sources, outputs, constants)
    # Check that the write-back reproduces the change, on a copy of the snapshot.
    copy = jax.tree.unflatten(snap.treedef, snap.leaves)
    write_back(copy, tree, writes.changed(tree))
    got, got_def = jax.tree_util.tree_flatten_with_path(copy)
    if got_def != treedef or any(a is not b for (_, a), (_, b) in zip(got, flat)):
        raise TypeError(_refusal(got, flat, describe))
    return writes


def _refusal(
    got: list[tuple[KeyPath, Any]],
    flat: list[tuple[KeyPath, Any]],
    describe: Callable[[KeyPath], str],
) -> str:
    """Why the write-back (``got``: the copy's leaves after it) misses ``flat``."""
    have = {jax.tree_util.keystr(p): leaf for p, leaf in got}
    missed = (p for p, leaf in flat if have.get(jax.tree_util.keystr(p), have) is not leaf)
    where = next(missed, None)
    if where is not None:
        what = f"wrote `{describe(where)}`"
    elif len(flat) != len(got):
        what = "removed an entry from an argument"
    else:
        what = "changed a static (non-array) attribute or field of an argument"
    return (
        f"{what}, but amp runs the function on a copy of its arguments and carries out "
        "only writes into Flax NNX Variables (nnx.Param, nnx.BatchStat, RNG counts, sow). "
        "Return the new value from the function instead, hold it in an nnx.Variable, or "
        "make the change outside the amp function."
    )


def write_back(dest: object, src: object, changed: set[int]) -> None:
    """Writes into the NNX objects of ``dest`` the Variables of ``src`` (the
    same tree, after ``fn``) that hold a leaf whose id is in ``changed``.

    New Variables (``sow``) are added; other Variables are left alone (one
    shared with another argument keeps the value written through that one).
    """
    nnx = _nnx()
    if nnx is None or not changed:
        return
    is_node = nnx.graph.is_graph_node
    dests = jax.tree.leaves(dest, is_leaf=is_node)
    srcs = jax.tree.leaves(src, is_leaf=is_node)
    if len(dests) != len(srcs):
        return  # (a container changed: collect refuses it)

    def written(_path: KeyPath | None, v: object) -> bool:
        return isinstance(v, nnx.Variable) and any(id(x) in changed for x in jax.tree.leaves(v))

    for d, s in zip(dests, srcs):
        if not (is_node(d) and is_node(s)):
            continue
        if isinstance(s, nnx.Variable):
            if written(None, s):
                nnx.update(d, s)
            continue
        state = nnx.state(s, written)
        if jax.tree.leaves(state):
            nnx.update(d, state)


_HAIKU_FIX = (
    "amp traces the function on its own, so Haiku's parameters, state and random keys "
    "would be baked into its cached trace or leak out of it as tracers. Apply amp to the "
    "transformed function instead: `amp(model.apply)(params, state, rng, x)`, or amp on a "
    "loss function that calls model.apply."
)


@contextlib.contextmanager
def haiku_guard(fn_name: str) -> Iterator[None]:
    """Refuses, while amp traces ``fn`` inside a Haiku transform, any use of
    the transform's parameters, state or random keys."""
    hk = sys.modules.get("haiku")
    try:
        rng = hk.maybe_get_rng_sequence_state() if hk is not None else None
    except ValueError:  # (not inside a Haiku transform)
        hk = None
    if hk is None:
        yield
        return

    def refuse(what: str, context: Any) -> None:  # (a Haiku context)
        raise TypeError(
            f"amp({fn_name}): the function uses the Haiku {what} `{context.full_name}` "
            f"inside a Haiku transform. {_HAIKU_FIX}"
        )

    def creator(
        next_creator: object, shape: object, dtype: object, init: object, context: Any
    ) -> None:
        refuse("parameter or state", context)

    def getter(next_getter: object, value: object, context: Any) -> None:
        refuse("parameter or state", context)

    def setter(next_setter: object, value: object, context: Any) -> None:
        refuse("state", context)

    with (
        hk.custom_creator(creator, state=True),
        hk.custom_getter(getter, state=True),
        hk.custom_setter(setter),
    ):
        yield
    if not _same_leaves(hk.maybe_get_rng_sequence_state(), rng):
        raise TypeError(
            f"amp({fn_name}): the function draws Haiku random keys (hk.next_rng_key) "
            f"inside a Haiku transform. {_HAIKU_FIX}"
        )


def _same_leaves(a: object, b: object) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))
