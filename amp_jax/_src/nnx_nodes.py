"""Flax NNX graph nodes in an argument tree: their identity, and the write-back.

A pytree flatten copies an NNX graph node (a ``Variable``, a ``Module``) once
per path it is held at; amp traces ``fn`` on such copies. This module keeps
the caller's objects what they are: `aliases` finds the nodes held at several
paths and `tie` makes their copies one object again; `find_cycle` finds a
node below itself; `moves` finds the argument nodes ``fn`` swapped or assigned
elsewhere, and `captured_outputs` the nodes ``fn`` returns from its closure;
`write_back` updates the caller's nodes in place with what ``fn`` wrote (the
public NNX API, as ``nnx.jit`` does); a hijax ``Variable`` is traced as
itself (`is_hijax`), or, where Flax refuses its writes under a trace
(`needs_lojax`), `through_lojax` runs ``fn`` on plain copies. mutation.py finds the writes and decides
what to carry out.

Flax is never imported here: its objects exist only if the caller imported it.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

from amp_jax._src import compat
from amp_jax._src.compat import KeyPath


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


#: The NNX graph nodes a tree holds at more than one path: ``(path, first)``
#: for each later path, in the order a flatten meets them.
Aliases = tuple[tuple[KeyPath, KeyPath], ...]


def aliases(tree: object) -> Aliases:
    """Where ``tree`` holds one NNX graph node (a ``Variable``, a ``Module``)
    at several paths: weight tying, a module passed twice, a submodule shared.

    A pytree flatten copies such a node once per path; `tie` makes the copies
    one object again, as ``nnx.jit`` keeps them (and as plain Python does).
    """
    nnx = _nnx()
    if nnx is None:
        return ()
    is_node = _node_test(nnx)
    first: dict[int, KeyPath] = {}
    found: list[tuple[KeyPath, KeyPath]] = []

    def repeated(path: KeyPath, x: object, careful: bool = False) -> bool:
        if not is_node(x):
            return careful and refuses_flatten(x)
        if id(x) in first:
            found.append((tuple(path), first[id(x)]))
            return True  # (not flattened again)
        first[id(x)] = tuple(path)
        return False

    try:
        jax.tree_util.tree_flatten_with_path(tree, is_leaf=repeated, is_leaf_takes_path=True)
    except Exception:  # (a node fn consumed: an Equinox State; whatever its library raises)
        first.clear()
        found.clear()
        jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda p, x: repeated(p, x, True), is_leaf_takes_path=True
        )
    return tuple(found)


def find_cycle(tree: object) -> tuple[KeyPath, KeyPath] | None:
    """``(inner, outer)`` where ``tree`` holds an NNX graph node below itself
    (``m.ref = m``: the node at ``outer`` is again at ``inner``), else None.

    A pytree flatten of such a tree recurses without end, and JAX's C++
    flatten then leaves the interpreter's recursion depth spent: every later
    JAX call of the process fails. This walk stops at the first repeat.
    """
    nnx = _nnx()
    if nnx is None:
        return None
    is_node = _node_test(nnx)
    seen: dict[int, list[KeyPath]] = {}
    found: list[tuple[KeyPath, KeyPath]] = []

    def stop(path: KeyPath, x: object) -> bool:
        if found:
            return True
        if not is_node(x):
            return False
        path = tuple(path)
        earlier = seen.setdefault(id(x), [])
        outer = next((q for q in earlier if path[: len(q)] == q), None)
        if outer is not None:
            found.append((path, outer))
            return True
        earlier.append(path)
        return False

    try:
        jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop, is_leaf_takes_path=True)
    except Exception:  # (a node fn consumed, whatever its library raises: no cycle found)
        pass
    return found[0] if found else None


def _node_test(nnx: Any) -> Callable[[object], bool]:
    """``nnx.graph.is_graph_node``, remembered by type (a tracer asked each
    time: a hijax Variable's tracer is a Variable): ``aliases`` asks it of
    every node of the arguments on every call, and Flax's test takes a
    metaclass ``isinstance``."""
    memo: dict[type, bool] = {}
    is_node = nnx.graph.is_graph_node

    def test(x: object) -> bool:
        if isinstance(x, compat.Tracer):
            return bool(is_node(x))
        t = type(x)
        found = memo.get(t)
        if found is None:
            found = memo[t] = bool(is_node(x))
        return found

    return test


def output_aliases(tree: object, out: object) -> Aliases:
    """The NNX nodes of ``fn``'s output ``out`` that are nodes of the argument
    tree ``tree`` (after ``fn``), or that ``out`` holds twice: key paths into
    ``(tree, out)``, for `tie` to give the caller back one object per node
    (``amp(lambda m: (m, m))(m)`` returns ``(m, m)``, as ``nnx.jit`` does)."""
    return tuple(a for a in aliases((tree, out)) if a[0][0] == jax.tree_util.SequenceKey(1))


def captured_outputs(fn: Callable[..., Any], tree: object, out: object) -> set[int]:
    """The ``id`` of each NNX node of ``fn``'s output ``out`` that ``fn``
    captured rather than made or was given: a module of its closure, its
    defaults, a global it names, a ``functools.partial``'s or a bound
    method's object (and the nodes below those), none of whose arrays is a
    tracer. amp returns such a node as the object itself, as plain Python
    does, not a copy rebuilt from its arrays; then an ``nnx.vmap`` or
    ``nnx.jit`` around amp sees the captured node and raises its own error.
    """
    nnx = _nnx()
    if nnx is None:
        return set()
    is_node = _node_test(nnx)
    outs = [x for x in jax.tree.leaves(out, is_leaf=is_node) if is_node(x)]
    if not outs:
        return set()
    given = {id(x) for _, x in _node_walk(nnx, tree)}
    outs = [
        x
        for x in outs
        if id(x) not in given and not any(isinstance(v, compat.Tracer) for v in jax.tree.leaves(x))
    ]
    if not outs:
        return set()
    try:
        held = {id(x) for _, x in _node_walk(nnx, _captures(fn))}
    except Exception:  # (a node that refuses a flatten: whatever its library raises)
        return set()
    return {id(x) for x in outs if id(x) in held}


def _captures(fn: object, depth: int = 3) -> list[Any]:
    """What the callable ``fn`` holds (closure cells, defaults, the globals
    its code names, a partial's function and arguments, a bound method's
    object), and the items of the containers among them, ``depth`` deep."""
    found: list[Any] = []
    todo = [(fn, depth)]
    seen: set[int] = set()
    while todo:
        obj, d = todo.pop()
        if id(obj) in seen or d < 0:
            continue
        seen.add(id(obj))
        found.append(obj)
        items: list[Any] = []
        if isinstance(obj, functools.partial):
            items = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            items = [obj.__func__, obj.__self__]
        elif isinstance(obj, types.FunctionType):
            code, named = obj.__code__, obj.__globals__
            items = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            items += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
            items += [named[n] for n in code.co_names if n in named]
        elif isinstance(obj, (list, tuple)):
            items = list(obj)
        elif isinstance(obj, dict):
            items = list(obj.values())
        todo += [(x, d - 1) for x in items if not isinstance(x, types.ModuleType)]
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # (an empty cell)
        return False
    return True


def _one_level(x: object) -> tuple[list[tuple[KeyPath, Any]], compat.PyTreeDef]:
    """The children of the pytree node ``x`` (with their keys) and its one-level
    structure; a leaf is its own only child, at the empty path."""
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)


def _at(tree: object, path: KeyPath) -> Any:
    """The node of ``tree`` at ``path``; ``_MISSING`` where there is none."""
    for key in path:
        flat, _ = _one_level(tree)
        tree = next((c for p, c in flat if p and p[0] == key), _MISSING)
        if tree is _MISSING:
            break
    return tree


def _replaced(tree: object, path: KeyPath, value: object) -> Any:
    """``tree`` with ``value`` at ``path`` (the nodes above it rebuilt, new
    objects; ``tree`` itself when it already holds ``value`` there)."""
    if not path:
        return value
    flat, treedef = _one_level(tree)
    children = [c for _, c in flat]
    for i, (p, child) in enumerate(flat):
        if p and p[0] == path[0]:
            new = _replaced(child, path[1:], value)
            if new is child:
                return tree
            children[i] = new
            return jax.tree.unflatten(treedef, children)
    return tree


def tie(tree: object, found: Aliases) -> Any:
    """``tree`` with each aliased path holding the node at its first path (one
    object, as before the flatten); paths ``tree`` does not have are skipped."""
    for path, first in found:
        node = _at(tree, first)
        if node is not _MISSING and _at(tree, path) is not _MISSING:
            tree = _replaced(tree, path, node)
    return tree


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


#: Where an NNX node sits in an argument tree, as `write_back` walks it: the
#: index of the top-level node among the tree's nodes, then the NNX attribute
#: keys and container keys below it.
NodePath = tuple[Any, ...]

#: ``(now, before)``: the node ``fn`` left at ``now`` was the argument's node
#: at ``before`` (``m.a, m.b = m.b, m.a``; ``m.c = m.a``).
Moves = tuple[tuple[NodePath, NodePath], ...]


def _node_walk(nnx: Any, tree: object) -> list[tuple[NodePath, Any]]:
    """Every ``(path, node)`` of the NNX nodes (modules, Variables) of ``tree``,
    a node held at several paths once per path (its insides once), in the
    order and with the keys `_merge` meets them."""
    is_node = nnx.graph.is_graph_node
    found: list[tuple[NodePath, Any]] = []
    inside: set[int] = set()

    def visit(path: NodePath, x: object) -> None:
        if is_node(x):
            found.append((path, x))
            impl = nnx.graph.get_node_impl(x)
            if impl is None or isinstance(x, nnx.Variable) or id(x) in inside:
                return  # (a Variable, a jax.Ref, a node met before)
            inside.add(id(x))
            for key, value, _ in compat.nnx_node_items(nnx, impl, x):
                visit((*path, key), value)
            return
        flat, treedef = _one_level(x)
        if not jax.tree_util.treedef_is_leaf(treedef):
            for p, child in flat:
                visit((*path, p[0]), child)

    for i, node in enumerate(x for x in jax.tree.leaves(tree, is_leaf=is_node) if is_node(x)):
        visit((i,), node)
    return found


def _first_paths(
    nnx: Any, tree: object
) -> tuple[dict[int, NodePath], set[tuple[int, NodePath]], list[Any]]:
    """The first `NodePath` of each NNX node of ``tree`` by ``id``, every
    ``(id, path)`` of them (a shared node at each of its paths), and the nodes
    (kept alive, so that an id is not reused while it is looked up)."""
    first: dict[int, NodePath] = {}
    at: set[tuple[int, NodePath]] = set()
    nodes = []
    for path, node in _node_walk(nnx, tree):
        at.add((id(node), path))
        if id(node) not in first:
            first[id(node)] = path
            nodes.append(node)
    return first, at, nodes


def first_paths(tree: object) -> tuple[dict[int, NodePath], set[tuple[int, NodePath]], list[Any]]:
    """`_first_paths` of ``tree`` (none without Flax NNX): what
    ``mutation.Snapshot`` keeps of the argument nodes before ``fn`` ran."""
    nnx = _nnx()
    if nnx is None:
        return {}, set(), []
    return _first_paths(nnx, tree)


def moves(
    node_paths: dict[int, NodePath], node_at: set[tuple[int, NodePath]], tree: object
) -> Moves:
    """The argument nodes that ``fn`` left at a path of ``tree`` where they
    were not before it ran (``node_paths``, ``node_at``: `first_paths` of the
    tree before, ``mutation.Snapshot``): a swap, a node assigned to a second
    attribute; each with its first path before."""
    nnx = _nnx()
    if nnx is None or not node_paths:
        return ()
    return tuple(
        (path, node_paths[id(node)])
        for path, node in _node_walk(nnx, tree)
        if id(node) in node_paths and (id(node), path) not in node_at
    )


def refuses_flatten(x: object) -> bool:
    """Whether the pytree node ``x`` refuses to be flattened: a value ``fn``
    consumed (an Equinox ``State`` once a stateful layer has used it)."""
    try:
        jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    except Exception:  # (whatever the library raises)
        return True
    return False


def write_back(dest: object, src: object, moved: Moves = ()) -> None:
    """Makes the NNX objects of ``dest`` (the caller's arguments) hold what
    those of ``src`` (the same tree after ``fn``, a copy) hold, in place, as
    ``nnx.jit`` carries its function's writes out.

    A Variable keeps its identity and takes the value and metadata written; a
    module or ``nnx.Pytree`` keeps its identity and takes the attributes ``fn``
    set, added (``self.linear = nnx.Linear(...)`` in an ``__init__``, ``sow``)
    or deleted; a node ``fn`` created is carried as it is; a node ``fn`` moved
    (``moved``: ``m.a, m.b = m.b, m.a``) is the caller's node from its old
    place, as in plain Python. Objects that are not NNX nodes are left alone
    (``mutation.collect`` refuses a change to them).
    """
    nnx = _nnx()
    if nnx is None:
        return
    is_node = nnx.graph.is_graph_node
    dests = jax.tree.leaves(dest, is_leaf=is_node)
    srcs = jax.tree.leaves(src, is_leaf=is_node)
    if len(dests) != len(srcs):
        return  # (a container changed: mutation.collect refuses it)
    placed: dict[NodePath, Any] = {}
    if moved:  # (the caller's nodes by their old paths, before anything moves)
        old = dict(reversed(_node_walk(nnx, dest)))
        placed = {now: old[before] for now, before in moved if before in old}
    seen: set[int] = set()
    i = 0
    for d, s in zip(dests, srcs):
        if is_node(d) and is_node(s) and type(d) is type(s):
            _merge(nnx, d, s, seen, (i,), placed)
        i += is_node(d)


def _merge(
    nnx: Any, d: Any, s: Any, seen: set[int], path: NodePath, placed: dict[NodePath, Any]
) -> Any:
    """What the caller's ``d`` (at ``path``) becomes to hold ``s``: ``d``
    itself, updated in place where it is an NNX node of ``s``'s type, else
    ``s`` (or, for a plain container of nodes, ``d``'s container rebuilt with
    its children merged); where ``fn`` moved a node here, the caller's node
    from its old place (``placed``), updated."""
    d = placed.get(path, d)
    if d is s:
        return d
    if type(d) is not type(s):
        return s
    if isinstance(s, nnx.Variable):
        if id(d) not in seen:
            seen.add(id(d))
            if d.get_raw_value() is not s.get_raw_value() or d.get_metadata() != s.get_metadata():
                d.update_from_state(s)
        return d
    if nnx.graph.is_graph_node(s):
        if id(d) not in seen:
            seen.add(id(d))
            _sync(nnx, d, s, seen, path, placed)
        return d
    dflat, ddef = _one_level(d)
    sflat, sdef = _one_level(s)
    if jax.tree_util.treedef_is_leaf(sdef) or ddef != sdef:
        return s
    kids = [_merge(nnx, a, b, seen, (*path, p[0]), placed) for (p, a), (_, b) in zip(dflat, sflat)]
    if all(k is a for k, (_, a) in zip(kids, dflat)):
        return d
    return jax.tree.unflatten(ddef, kids)


def _sync(
    nnx: Any, d: Any, s: Any, seen: set[int], path: NodePath, placed: dict[NodePath, Any]
) -> None:
    """Sets, adds and deletes the attributes (entries) of the NNX node ``d`` (at
    ``path``) so that they are those of ``s``, merging the nodes it already
    holds or that ``fn`` moved there (``placed``)."""
    impl = nnx.graph.get_node_impl(d)
    had = dict(impl.node_dict(d))
    keys = set()
    for key, value, data in compat.nnx_node_items(nnx, impl, s):
        keys.add(key)
        old = had.get(key, _MISSING)
        here = (*path, key)
        mine = placed.get(here, old)  # (merged: becomes the caller's node moved here)
        new = value if mine is _MISSING else _merge(nnx, mine, value, seen, here, placed)
        if new is not old:
            compat.nnx_set_key(nnx, impl, d, key, old, nnx.data(new) if data else new)
    for key in had:
        if key not in keys:
            impl.pop_key(d, key)


def is_hijax(leaf: object) -> bool:
    """Whether an argument leaf is a Flax hijax ``Variable`` (``nnx.var_defaults(
    hijax=True)``): a pytree leaf (a plain Variable flattens to its value) whose
    value lives in JAX's own mutable state. amp traces it as it is, as
    ``jax.jit`` does: ``fn`` reads and writes the Variable itself."""
    nnx = _nnx()
    return nnx is not None and isinstance(leaf, nnx.Variable)


def needs_lojax(leaves: Sequence[Any]) -> bool:
    """Whether a leaf of the arguments is a hijax ``Variable`` that this Flax
    does not let a traced function write (Flax after 0.12.8): amp then runs
    ``fn`` on plain copies of them (`through_lojax`), as it ran eagerly."""
    nnx = _nnx()
    return (
        nnx is not None
        and any(isinstance(x, nnx.Variable) for x in leaves)
        and not compat.hijax_writable_under_jit(nnx)
    )


def through_lojax(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``run(*args, **kwargs)`` with the arguments' hijax Variables as plain
    (lojax) ones, which amp traces as pytrees, their writes then carried into
    the hijax Variables (``nnx.update``); a returned argument node is the
    caller's object. The conversion is Flax's own (``nnx.with_vars``)."""
    nnx = _nnx()
    lo = nnx.with_vars((args, kwargs), hijax=False, allow_duplicates=True)
    before = {id(x) for x in jax.tree.leaves(lo)}
    out = run(*lo[0], **lo[1])

    def written(_path: object, v: object) -> bool:
        return isinstance(v, nnx.Variable) and any(id(x) not in before for x in jax.tree.leaves(v))

    is_node = nnx.graph.is_graph_node
    for d, s in zip(
        jax.tree.leaves((args, kwargs), is_leaf=is_node), jax.tree.leaves(lo, is_leaf=is_node)
    ):
        # (only what fn wrote: newer Flax refuses any update of a hijax
        # Variable under jit unless it is a ref)
        if isinstance(s, nnx.Variable):
            if written(None, s):
                nnx.update(d, s)
        elif is_node(s) and jax.tree.leaves(state := nnx.state(s, written)):
            nnx.update(d, state)
    return tie(((args, kwargs), out), output_aliases(lo, out))[1]
