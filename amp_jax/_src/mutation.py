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
refused with the construct and the fix, never dropped. What keeps the NNX
nodes the caller's objects (shared, swapped and captured nodes, the
write-back itself) is nnx_nodes.py's.

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
from amp_jax._src.nnx_nodes import (
    Aliases,
    Moves,
    NodePath,
    aliases,
    first_paths,
    moves,
    refuses_flatten,
    tie,
    write_back,
)


class Snapshot:
    """The leaves (by key path), structure, shared NNX nodes and NNX node
    paths (`first_paths`) of the argument tree before ``fn`` ran."""

    __slots__ = (
        "flat",
        "leaves",
        "treedef",
        "by_path",
        "aliases",
        "node_paths",
        "node_at",
        "nodes",
    )

    def __init__(self, tree: object) -> None:
        self.treedef: compat.PyTreeDef
        self.flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.leaves = [leaf for _, leaf in self.flat]
        self.by_path = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(self.flat)}
        self.aliases = aliases(tree)
        self.node_paths: dict[int, NodePath]
        self.node_at: set[tuple[int, NodePath]]
        self.nodes: list[Any]
        self.node_paths, self.node_at, self.nodes = first_paths(tree)


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
        if refuses_flatten(x):
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
      aliases: the NNX nodes the tree after ``fn`` holds at several paths.
      moves: the argument nodes ``fn`` moved (`moves`), for `write_back`.
    """

    __slots__ = ("treedef", "sources", "outputs", "constants", "aliases", "moves")

    def __init__(
        self,
        treedef: compat.PyTreeDef,
        sources: list[int | None],
        outputs: list[Any],
        constants: dict[int, Any],
        aliases: Aliases = (),
        moves: Moves = (),
    ) -> None:
        self.treedef, self.sources = treedef, sources
        self.outputs, self.constants = outputs, constants
        self.aliases, self.moves = aliases, moves

    def after(self, leaves: Sequence[Any], values: Sequence[Any]) -> Any:
        """The argument tree after ``fn``: unchanged ``leaves`` and written
        ``values`` (shared NNX nodes one object, as in ``fn``)."""
        it = iter(values)
        flat = [
            leaves[s] if s is not None else self.constants[i] if i in self.constants else next(it)
            for i, s in enumerate(self.sources)
        ]
        return tie(jax.tree.unflatten(self.treedef, flat), self.aliases)


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
    moved = moves(snap.node_paths, snap.node_at, tree)
    if (
        treedef == snap.treedef
        and all(a is b for (_, a), b in zip(flat, snap.leaves))
        and not moved
    ):
        return None
    sources: list[int | None] = []
    for path, leaf in flat:
        i = snap.by_path.get(jax.tree_util.keystr(path))
        sources.append(i if i is not None and snap.leaves[i] is leaf else None)
    written = [i for i, s in enumerate(sources) if s is None]
    outputs = [flat[i][1] for i in written if _is_array(flat[i][1])]
    constants = {i: flat[i][1] for i in written if not _is_array(flat[i][1])}
    writes = Writes(treedef, sources, outputs, constants, aliases(tree), moved)
    # Check that the write-back reproduces the change, on a copy of the snapshot.
    copy = tie(jax.tree.unflatten(snap.treedef, snap.leaves), snap.aliases)
    write_back(copy, tree, moved)
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
