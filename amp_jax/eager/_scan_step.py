"""``scan_step``: a training step that applies the optimizer inside the backward scan."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from jax import lax

from amp_jax._src import compat, mesh
from amp_jax._src.optstate import find_states, salt_keys, transformation
from amp_jax.eager import _deps
from amp_jax.optim import (
    DynamicLossScale,
    DynamicLossScaleState,
    LossScaleRule,
    ScaledGradients,
    StaticLossScaleState,
    loss_scale,
)

_PARTS = ("embed", "blocks", "head")
#: what `compat.vjp_residuals` finds: the residual arrays and their treedef
_Residuals = tuple[list[Any], compat.PyTreeDef]


class ScanStepState(NamedTuple):
    """Optimizer state of a [`scan_step`][amp_jax.eager.scan_step] (what ``step.init`` returns).

    The optimizer is initialised separately on each part of the parameters, as
    if the model were unrolled: every layer of the block stack has its own state,
    stacked along a leading layer axis.

    Attributes:
      embed: ``optimizer.init(params["embed"])``.
      blocks: ``jax.vmap(optimizer.init)(params["blocks"])``: one state per layer,
        every leaf with a leading axis of size ``num_layers`` (scalars such as
        adam's ``count`` become shape ``(num_layers,)``, each incremented once
        per step).
      head: ``optimizer.init(params["head"])``.
    """

    embed: optax.OptState
    blocks: optax.OptState
    head: optax.OptState


def _leaf_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_params(params: Any) -> int:
    """Validate the ``{"embed", "blocks", "head"}`` structure; return num_layers."""
    if not isinstance(params, dict) or set(params) != set(_PARTS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"scan_step: `params` must be a dict with exactly the keys 'embed', "
            f"'blocks' and 'head', got {got}. Put the embedding parameters under "
            f"'embed', the block parameters stacked along a leading layer axis "
            f"under 'blocks' (e.g. jax.vmap(init_block)(keys)) and the head/loss "
            f"parameters under 'head'; use {{}} for a part without parameters."
        )
    leaves = _leaf_paths(params["blocks"])
    if not leaves:
        raise ValueError(
            "scan_step: `params['blocks']` has no array leaves; the "
            "block stack needs at least one parameter per layer."
        )
    sizes: dict[int, list[str]] = {}
    for path, x in leaves:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"scan_step: `params['blocks']{path}` is {x!r}, not an array with a "
                f"leading layer axis. Stack each block parameter over the layers "
                f"(shape (num_layers, ...))."
            )
        sizes.setdefault(int(shape[0]), []).append(path)
    if len(sizes) > 1:
        detail = "; ".join(f"{n}: {', '.join(ps[:3])}" for n, ps in sorted(sizes.items()))
        raise ValueError(
            f"scan_step: the leaves of `params['blocks']` disagree on the leading "
            f"(layer) axis size ({detail}). Every block parameter must be stacked "
            f"over the same number of layers; a parameter shared by all layers "
            f"belongs in 'embed' or 'head' (see the docs on shared parameters)."
        )
    (num_layers,) = sizes
    if num_layers < 1:
        raise ValueError(
            "scan_step: `params['blocks']` has a layer axis of size 0; "
            "the block stack needs at least one layer."
        )
    return num_layers


_UINT = {1: jnp.uint8, 2: jnp.uint16}


def _as_bits(x: Any) -> Any:
    """A floating array narrower than 32 bits as the unsigned ints of its
    width (a bitcast); anything else as it is.

    The forward loop stacks its residuals so: XLA:CPU has no dynamic-update-slice
    of a bfloat16, float16 or float8 array; it widens the whole stack to float32
    and back around every row write, so a loop over ``L`` layers converts the
    stack ``L`` times. On integers the write is in place, and the backward loop
    bitcasts each row back (free on every backend).
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _UINT:
        return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return x


def _as_float(x: Any, dtype: Any) -> Any:
    """Inverse of `_as_bits` for an array that was ``dtype``."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _layer(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _set_layer(tree: Any, new: Any, i: Any) -> Any:
    return jax.tree.map(
        lambda a, x: lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0), tree, new
    )


def _after(i: Any, stacks: list[Any]) -> Any:
    """``i``, made data-dependent on row ``i`` of every stack in ``stacks``.

    The value is always ``i`` (``min(i, i + k)`` with ``k`` a count of NaNs,
    ``k >= 0``), but XLA cannot prove it: a read or write of another stack at
    the returned index is ordered after the writes that produced ``stacks``.
    """
    dep = jnp.zeros((), i.dtype)
    for x in stacks:
        if _orders(x):
            first = lax.dynamic_index_in_dim(x, i, keepdims=False)[(0,) * (x.ndim - 1)]
            dep = dep + jnp.isnan(first).astype(i.dtype)
    return jnp.minimum(i, i + dep)


def _orders(x: Any) -> bool:
    """Whether ``_after`` can take a dependence on ``x`` (a non-empty float stack;
    ``isnan`` of an integer or key is a constant XLA folds away)."""
    return bool(jnp.issubdtype(x.dtype, jnp.inexact) and x.size)


def _update_rows(stacks: Any, update: Callable[[Any], Any], i: Any, after: list[Any]) -> Any:
    """Replace row ``i`` of every leaf of ``stacks`` by ``update(rows)``, leaf by leaf.

    Each leaf's row is read and written at an index that depends on the
    previous write (the first on ``after``), so XLA updates one stack at a
    time, in place, without materialising the rows of all stacks at once: the
    optimizer state slice of a layer is never a buffer of its own. ``update``
    is called once per leaf; only that leaf of its result is used (XLA drops
    the rest), and every call reads the rows of the stacks as they were before
    this function wrote any of them.
    """
    leaves, treedef = jax.tree.flatten(stacks)
    out = list(leaves)
    for k, x in enumerate(leaves):
        j = _after(i, after)
        rows = jax.tree.unflatten(
            treedef, [lax.dynamic_index_in_dim(y, j, keepdims=False) for y in leaves]
        )
        new = jax.tree.leaves(update(rows))[k]
        out[k] = lax.dynamic_update_index_in_dim(x, new.astype(x.dtype), j, 0)
        after = [out[k]] if _orders(out[k]) else [*after, out[k]]
    return jax.tree.unflatten(treedef, out)


def _carries_state() -> bool:
    """Whether the layer loop carries the optimizer state slice: under jit on a
    mesh (``jax.set_mesh``), where ordering the state writes would cost a
    collective per state leaf and layer (see `_backward`)."""
    return mesh.partitioned_by_mesh()


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


class _Forward(NamedTuple):
    """What the forward pass leaves for the backward steps of `ScanStep.update`."""

    loss: jax.Array
    g_head: Any  # the head's parameter gradient
    ct: Any  # the cotangent of the last block's output
    stored: Any  # what each layer saved for its backward (as `_as_bits`), stacked
    embed_vjp: Callable  # cotangent of h0 -> (embed gradient,)
    layer_vjp: Callable  # (layer params, its stored values) -> the layer's pullback


def _check_loss(loss: Any) -> None:
    if (
        not hasattr(loss, "shape")
        or loss.shape != ()
        or not jnp.issubdtype(loss.dtype, jnp.floating)
    ):
        raise ValueError(
            f"scan_step: `head_loss_fn` must return a floating scalar loss, got "
            f"{_abstract(loss) if hasattr(loss, 'dtype') else loss!r}. Reduce "
            f"the loss (e.g. jnp.mean) inside head_loss_fn."
        )


class ScanStep:
    """A training step with eager (in-backward) optimizer updates; see [`scan_step`][amp_jax.eager.scan_step].

    Attributes:
      embed_fn: ``embed_fn(params["embed"], batch) -> h``.
      block_fn: ``block_fn(layer_params, h) -> h``, scanned over the layers.
      head_loss_fn: ``head_loss_fn(params["head"], h, batch) -> loss``.
      optimizer: the optax transformation applied to every part and layer.
      remat: whether the backward loop recomputes each block's forward pass.
      loss_scale: the [`LossScaleRule`][amp_jax.optim.LossScaleRule] of dynamic
        loss scaling, or None.
    """

    def __init__(self, embed_fn, block_fn, head_loss_fn, optimizer, remat, loss_scale=None):
        self.embed_fn = embed_fn
        self.block_fn = block_fn
        self.head_loss_fn = head_loss_fn
        self.optimizer = optimizer
        self.remat = remat
        # with a loss scale rule the step decides the skip itself (a finite
        # check before the eager pass) and runs `optimizer` per part and layer.
        self.loss_scale = loss_scale
        self._rule = loss_scale
        self._inner = optimizer
        self._tx = optax.with_extra_args_support(optimizer)
        self._checked: set[Any] = set()
        self._jitted = jax.jit(self.update, donate_argnums=(0, 1))

    def __repr__(self) -> str:
        return (
            f"ScanStep(block_fn={getattr(self.block_fn, '__name__', self.block_fn)!r}, "
            f"remat={self.remat})"
        )

    # ------------------------------------------------------------- checks ---

    def _check_optimizer(self, params: Any) -> None:
        """Refuse optimizers that need all gradients at once (once per signature)."""
        key = (
            jax.tree.structure(params),
            tuple((jnp.shape(x), jnp.dtype(x.dtype)) for x in jax.tree.leaves(params)),
        )
        if key in self._checked:
            return
        layer = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), params["blocks"]
        )
        head_state = jax.eval_shape(self._tx.init, _abstract(params["head"]))
        if find_states(head_state, DynamicLossScaleState):
            raise ValueError(
                "scan_step: `optimizer` contains amp_jax.optim.dynamic_loss_scale "
                "nested inside another transformation. scan_step supports dynamic "
                "loss scaling only as the outermost wrapper (it decides the skip "
                "with a finite check before any layer is written): pass "
                "dynamic_loss_scale(optax.chain(...)) instead of "
                "optax.chain(..., dynamic_loss_scale(...), ...)."
            )
        _deps.refuse_by_state(head_state)
        probe = {
            "embed": _abstract(params["embed"]),
            "blocks": [layer, layer],
            "head": _abstract(params["head"]),
        }
        _deps.refuse_cross_parameter(self._inner, probe)
        self._checked.add(key)

    # ---------------------------------------------------------------- API ---

    def init(self, params: dict[str, Any]) -> Any:
        """Initialise the optimizer state for ``params``.

        Args:
          params: ``{"embed": ..., "blocks": ..., "head": ...}``, the block
            parameters stacked along a leading layer axis.

        Returns:
          A [`ScanStepState`][amp_jax.eager.ScanStepState]; for ``optimizer = dynamic_loss_scale(inner)``
          a [`DynamicLossScaleState`][amp_jax.optim.DynamicLossScaleState] whose ``inner_state``
          is the [`ScanStepState`][amp_jax.eager.ScanStepState] of ``inner`` (so
          [`amp_jax.optim.loss_scale_stats`][amp_jax.optim.loss_scale_stats] works on it).

        Raises:
          ValueError: if ``params`` does not have that structure, or the optimizer
            is refused (global-norm clipping, ``optax.MultiSteps``, dynamic loss
            scaling nested inside another transformation; the message says why
            and what to use instead).
        """
        num_layers = check_params(params)
        self._check_optimizer(params)
        embed = _init_part(self._tx.init, params["embed"], "params['embed']")
        blocks = _init_part(
            jax.vmap(self._tx.init),
            params["blocks"],
            "one layer of params['blocks'] (under jax.vmap)",
        )
        head = _init_part(self._tx.init, params["head"], "params['head']")
        # vmap(init) copies one key to every layer: give every part and layer its
        # own (typed PRNG keys, and raw key data of states that declare
        # `raw_key_fields`, such as stochastic rounding's).
        blocks = salt_keys(blocks, jnp.arange(num_layers) + 1)
        embed = salt_keys(embed, num_layers + 1)
        head = salt_keys(head, num_layers + 2)
        state = ScanStepState(embed, blocks, head)
        if self._rule is not None:
            return self._rule.init(state)  # as dynamic_loss_scale.init makes it
        return state

    def loss(self, params: dict[str, Any], batch: Any) -> jax.Array:
        """The loss of ``params`` on ``batch`` (forward pass only, no update).

        ``head_loss_fn(p_head, scan(block_fn)(embed_fn(p_embed, batch)), batch)``;
        ``jax.value_and_grad`` of this function is the standard (non-eager) step.

        Args:
          params: the parameters (structure as for `init`).
          batch: any pytree, passed to ``embed_fn`` and ``head_loss_fn``.

        Returns:
          The scalar loss.
        """
        check_params(params)
        h = self.embed_fn(params["embed"], batch)
        h, _ = lax.scan(lambda c, p: (self.block_fn(p, c), None), h, params["blocks"])
        return self.head_loss_fn(params["head"], h, batch)

    def _apply(self, grads, state, params, *, scale=None, scaled=False, finite=None):
        """Update one part/layer. With dynamic loss scaling (``scale`` given)
        unscale the gradients first and keep params and state when not
        ``finite``; with a static loss scaler in the optimizer (``scaled``) pass
        them as the ``ScaledGradients`` they are (the backward pass was seeded
        with its scale)."""
        if scale is not None:
            grads = LossScaleRule.unscale(grads, scale)
        if scaled:
            grads = ScaledGradients(grads)
        updates, new_state = self._tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        new_params = jax.tree.map(lambda n, o: n.astype(o.dtype), new_params, params)
        new_state = optax.tree_utils.tree_cast_like(new_state, state)
        if finite is not None:
            keep = lambda n, o: jnp.where(finite, n, o)
            new_params = jax.tree.map(keep, new_params, params)
            new_state = jax.tree.map(keep, new_state, state)
        return new_params, new_state

    def update(
        self, params: dict[str, Any], opt_state: ScanStepState, batch: Any
    ) -> tuple[dict[str, Any], ScanStepState, jax.Array]:
        """One training step, not jitted: ``(params, opt_state, loss)``.

        The pure function behind ``step(...)``; use it to jit with your own
        options (sharding, other donations) or inside ``shard_map``. Donate
        ``params`` and ``opt_state`` (``jax.jit(step.update, donate_argnums=(0,
        1))``), otherwise the inputs stay alive next to the outputs.

        Args:
          params: the parameters (structure as for `init`).
          opt_state: the state from `init` or a previous step (a
            [`ScanStepState`][amp_jax.eager.ScanStepState], or with ``dynamic_loss_scale`` a
            ``DynamicLossScaleState`` wrapping one).
          batch: any pytree, passed to ``embed_fn`` and ``head_loss_fn``.

        Returns:
          ``(new_params, new_opt_state, loss)``; the loss is the one of the
          parameters before the update.

        Raises:
          ValueError: on malformed ``params`` or ``opt_state``, or when a
            function returns the wrong shape (the message names the function).
        """
        num_layers = check_params(params)
        dyn, opt_state = _unwrap(self._rule, opt_state)
        self._check_optimizer(params)
        _deps.refuse_by_state(opt_state)
        scale = _seed_scale(opt_state, dyn)
        fw = self._forward(params, batch, scale)
        finite = None if dyn is None else self._all_finite(fw, params, scale)
        if dyn is not None:
            apply = functools.partial(self._apply, scale=scale)
        else:
            apply = functools.partial(self._apply, scaled=scale is not None)
        new_head, head_state = apply(fw.g_head, opt_state.head, params["head"], finite=finite)
        ct0, new_blocks, blocks_state = _backward(
            fw, params["blocks"], opt_state.blocks, apply, finite, num_layers
        )
        (g_embed,) = fw.embed_vjp(ct0)
        new_embed, embed_state = apply(g_embed, opt_state.embed, params["embed"], finite=finite)
        new_params = {"embed": new_embed, "blocks": new_blocks, "head": new_head}
        new_state = ScanStepState(embed_state, blocks_state, head_state)
        if dyn is not None:
            new_state = self._rule.advance(dyn, finite, new_state)
        return new_params, new_state, fw.loss

    # -------------------------------------------------------- the steps ---

    def _forward(self, params: dict[str, Any], batch: Any, scale: Any) -> _Forward:
        """The forward pass and the head's backward: everything the layer loop reads.

        The forward scan stores, per layer, the block's input (``remat``) or
        its activation-dependent residuals, as `_as_bits`; ``layer_vjp``
        reads them back in the dtypes of ``h0`` or of the re-traced residuals.
        """
        p_blocks = params["blocks"]
        h0, embed_vjp = jax.vjp(lambda p: self.embed_fn(p, batch), params["embed"])
        layer_aval, h_aval = _check_block_fn(self.block_fn, p_blocks, h0)
        mask = None
        if not self.remat:
            mask = _deps.residual_depends_on_input(self.block_fn, layer_aval, h_aval)
        if mask is None:  # remat (or opaque pullbacks): store only the block inputs

            def fwd(h, p):
                return self.block_fn(p, h), jax.tree.map(_as_bits, h)
        else:  # store the residuals that depend on the activations

            def fwd(h, p):
                h_next, vjp_fn = jax.vjp(self.block_fn, p, h)
                # (mask is set only where vjp_residuals found the residuals)
                leaves, _ = cast(_Residuals, compat.vjp_residuals(vjp_fn))
                return h_next, [_as_bits(x) for x, m in zip(leaves, mask) if m]

        h_last, stored = lax.scan(fwd, h0, p_blocks)
        loss, head_vjp = jax.vjp(
            lambda p, h: self.head_loss_fn(p, h, batch), params["head"], h_last
        )
        _check_loss(loss)
        seed = jnp.ones((), loss.dtype)
        if scale is not None:
            seed = (seed.astype(jnp.float32) * scale).astype(loss.dtype)
        g_head, ct = head_vjp(seed)
        zeros_h = jax.tree.map(jnp.zeros_like, h0)
        layer_vjp = functools.partial(self._layer_vjp, mask=mask, zeros_h=zeros_h)
        return _Forward(loss, g_head, ct, stored, embed_vjp, layer_vjp)

    def _layer_vjp(self, p_i: Any, saved: Any, *, mask: Any, zeros_h: Any) -> Callable:
        """The pullback of one block, from its parameters and its stored values."""
        if mask is None:  # (block_fn keeps h's dtypes: checked before the forward pass)
            saved = jax.tree.map(lambda x, z: _as_float(x, z.dtype), saved, zeros_h)
            _, vjp_fn = jax.vjp(self.block_fn, p_i, saved)
            return vjp_fn
        # Re-trace the block's vjp on a stub input: the residuals that depend
        # only on the parameters (weights, their casts) are recomputed from
        # p_i, the activation-dependent ones come from the forward pass; the
        # unused stub computations are dead code.
        _, stub = jax.vjp(self.block_fn, p_i, zeros_h)
        leaves, treedef = cast(_Residuals, compat.vjp_residuals(stub))
        it = iter(saved)
        leaves = [_as_float(next(it), x.dtype) if m else x for x, m in zip(leaves, mask)]
        return jax.tree.unflatten(treedef, leaves)

    def _all_finite(self, fw: _Forward, params: dict[str, Any], scale: Any) -> jax.Array:
        """Whether every unscaled gradient is finite (dynamic loss scaling).

        A backward pass that only reduces ``isfinite`` over the gradients,
        layer by layer; nothing is stored or updated. The eager pass then
        writes each layer only if all are finite.
        """

        def check(carry, xs):
            ct, ok = carry
            p_i, saved = xs
            g_i, ct_prev = fw.layer_vjp(p_i, saved)(ct)
            ok = ok & rule.all_finite(rule.unscale(g_i, scale))
            return (ct_prev, ok), None

        rule = self._rule
        ok = rule.all_finite(rule.unscale(fw.g_head, scale))
        carry, xs = (fw.ct, ok), (params["blocks"], fw.stored)
        (ct_first, ok), _ = lax.scan(check, carry, xs, reverse=True)
        (g_embed,) = fw.embed_vjp(ct_first)
        return rule.agree(ok & rule.all_finite(rule.unscale(g_embed, scale)))

    def __call__(
        self, params: dict[str, Any], opt_state: ScanStepState, batch: Any
    ) -> tuple[dict[str, Any], ScanStepState, jax.Array]:
        """``jax.jit(self.update, donate_argnums=(0, 1))(params, opt_state, batch)``.

        ``params`` and ``opt_state`` are donated: do not use the arrays passed in
        after the call.
        """
        return self._jitted(params, opt_state, batch)


def _init_part(fn: Callable, part: Any, what: str) -> Any:
    """``fn(part)``, an optimizer init failure explained per part."""
    try:
        return fn(part)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"scan_step: `optimizer.init` failed on {what}: {e}. The optimizer "
            f"is initialised separately on params['embed'], on one layer of "
            f"params['blocks'] and on params['head'], so pytree-valued masks or "
            f"labels (optax.adamw(mask=...), optax.masked, optax.multi_transform) "
            f"must be callables of the parameters they receive."
        ) from e


def _unwrap(rule: Any, opt_state: Any) -> tuple[Any, ScanStepState]:
    """``(the DynamicLossScaleState or None, the ScanStepState)``, checked."""
    if rule is None:
        if not isinstance(opt_state, ScanStepState):
            raise ValueError(
                f"scan_step: `opt_state` must be the ScanStepState returned by "
                f"step.init(params) (or a previous step), got "
                f"{type(opt_state).__name__}."
            )
        return None, opt_state
    if not isinstance(opt_state, DynamicLossScaleState) or not isinstance(
        opt_state.inner_state, ScanStepState
    ):
        raise ValueError(
            f"scan_step: with optimizer=dynamic_loss_scale(...), `opt_state` "
            f"must be the DynamicLossScaleState(inner_state=ScanStepState(...)) "
            f"returned by step.init(params) (or a previous step), got "
            f"{type(opt_state).__name__}."
        )
    return opt_state, opt_state.inner_state


def _seed_scale(opt_state: ScanStepState, dyn: Any) -> Any:
    """The loss scale the backward pass is seeded with (None: unscaled)."""
    static = find_states(opt_state.head, StaticLossScaleState)
    scale = loss_scale(opt_state.head) if static else None
    if dyn is not None:
        scale = dyn.scale
    return scale


def _check_block_fn(block_fn: Callable, p_blocks: Any, h0: Any) -> tuple[Any, Any]:
    """``(one layer's parameter avals, h's avals)``; refuses a ``block_fn``
    that changes h's structure, shapes or dtypes."""
    layer_aval = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), p_blocks)
    h_aval = _abstract(h0)
    out_aval = jax.eval_shape(block_fn, layer_aval, h_aval)
    # (jaxlib's PyTreeDef has no stub: mypy sees an unknown type)
    if jax.tree.structure(out_aval) != jax.tree.structure(h_aval) or any(  # type: ignore[operator]
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(out_aval), jax.tree.leaves(h_aval))
    ):
        raise ValueError(
            f"scan_step: `block_fn` must return h with the structure, shape and "
            f"dtype of its input h ({h_aval}), got {out_aval}. Cast or reshape "
            f"inside block_fn so that blocks can be scanned."
        )
    return layer_aval, h_aval


def _backward(
    fw: _Forward,
    p_blocks: Any,
    s_blocks: Any,
    apply: Callable,
    finite: Any,
    num_layers: int,
) -> tuple[Any, Any, Any]:
    """The eager layer loop: ``(cotangent of h0, new block params, new block state)``.

    A reverse loop over the layers; each layer's gradient is used for its
    update at once and written back into the carried stacks, in place. The
    order of reads and writes decides whether XLA can do that without
    copying a stack (reading and writing every stack in the same
    iteration, unordered, makes copy insertion copy every stack on every
    iteration: the update arithmetic fused into one stack's write reads
    the other stacks):

    - Parameters are software-pipelined: the carry holds layer i's slice,
      read from the stacks in the previous iteration *after* that
      iteration's write (the slice is needed anyway, by the layer's vjp).
    - Optimizer state, on one device or inside shard_map: not carried
      (that would hold one layer's state besides the stacks). The
      parameter update reads the state rows from the stacks, and the state
      writes are ordered after the parameter writes and after each other
      through data-dependent indices (`_update_rows`), so the fused
      read-modify-writes run one stack at a time.
    - Optimizer state under jit on a mesh (``jax.set_mesh``): pipelined
      like the parameters. There the ordering index would read an element
      of a sharded row, a scalar all-reduce per state leaf and layer;
      carrying the state slice costs one layer of state per device instead
      (docs/eager.md).
    """
    carry_state = _carries_state()
    # the state update of the in-place order: traced once, called once per
    # state leaf (XLA keeps that leaf's part)
    update_state: Any = (
        None if carry_state else jax.jit(lambda g, s, p, f: apply(g, s, p, finite=f)[1])
    )

    def bwd(carry, xs):
        ct, blocks, states, p_i, s_i = carry
        i, saved = xs
        g_i, ct_prev = fw.layer_vjp(p_i, saved)(ct)
        nxt = jnp.maximum(i - 1, 0)
        if carry_state:
            new_p, new_s = apply(g_i, s_i, p_i, finite=finite)
            blocks = _set_layer(blocks, new_p, i)
            states = _set_layer(states, new_s, i)
            s_i = _layer(states, nxt)
        else:
            new_p, _ = apply(g_i, _layer(states, i), p_i, finite=finite)
            blocks = _set_layer(blocks, new_p, i)
            states = _update_rows(
                states,
                lambda s: update_state(g_i, s, p_i, finite),
                i,
                jax.tree.leaves(blocks),
            )
        return (ct_prev, blocks, states, _layer(blocks, nxt), s_i), None

    last = num_layers - 1
    s_last = _layer(s_blocks, last) if carry_state else ()
    (ct0, new_blocks, new_states, _, _), _ = lax.scan(
        bwd,
        (fw.ct, p_blocks, s_blocks, _layer(p_blocks, last), s_last),
        (jnp.arange(num_layers), fw.stored),
        reverse=True,
    )
    return ct0, new_blocks, new_states


def scan_step(
    embed_fn: Callable[[Any, Any], Any],
    block_fn: Callable[[Any, Any], Any],
    head_loss_fn: Callable[[Any, Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    *,
    remat: bool = False,
    loss_scale: LossScaleRule | None = None,
) -> ScanStep:
    """A training step that applies ``optimizer`` inside the backward pass.

    For a model ``embed -> stack of identical blocks (lax.scan) -> head + loss``
    the step walks the layers in reverse after the forward pass and applies each
    layer's gradient to that layer's slice of the parameters and optimizer state
    at once, in place, so a gradient of the whole block stack never exists: peak
    memory is weights + optimizer state + one layer's gradient + activations.
    The optimizer sees one layer at a time, as if the model were unrolled; for
    element-wise optimizers (sgd, momentum, adam, adamw, lion, ...) the result is
    the arithmetic of the standard ``value_and_grad`` + ``update`` step.
    Optimizers that read all gradients at once (``optax.clip_by_global_norm``,
    ``optax.apply_if_finite``, ``optax.MultiSteps``) are refused at ``init``;
    ``amp_jax.optim.static_loss_scale`` works, and dynamic loss scaling through
    ``loss_scale`` (or ``dynamic_loss_scale`` as the outermost wrapper).
    docs/eager.md has the details, limits and memory.

    Args:
      embed_fn: ``embed_fn(params["embed"], batch) -> h``; ``h`` is an array or
        pytree of arrays.
      block_fn: ``block_fn(layer_params, h) -> h`` with ``h`` keeping its
        structure, shapes and dtypes; wrap it in ``amp_jax.amp`` for mixed
        precision.
      head_loss_fn: ``head_loss_fn(params["head"], h, batch) -> loss``, a
        floating scalar.
      optimizer: an optax ``GradientTransformation`` whose update is per
        parameter; it is called with ``params``, so ``amp_jax.optim`` wrappers
        (``kahan_summation``, ``master_weights``, ``stochastic_rounding``) work.
      remat: if true, the forward pass stores only each block's input and the
        backward loop recomputes the block; if false (default) it stores the
        block's activation-dependent residuals.
      loss_scale: dynamic loss scaling: the
        [`LossScaleRule`][amp_jax.optim.LossScaleRule] the step applies around
        ``optimizer`` (it checks every unscaled gradient before it writes any
        layer, skips a non-finite step and advances the scale as
        [`dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale] does). With
        ``tx = dynamic_loss_scale(inner, ...)``, ``scan_step(..., tx.inner,
        loss_scale=tx.rule)``; passing ``tx`` itself as ``optimizer`` is the
        same step.

    Returns:
      A [`ScanStep`][amp_jax.eager.ScanStep]: ``opt_state = step.init(params)`` and
      ``params, opt_state, loss = step(params, opt_state, batch)`` (jitted,
      ``params`` and ``opt_state`` donated); ``step.update`` is the un-jitted
      pure function and ``step.loss`` the forward loss.

    Raises:
      TypeError: if a function argument is not callable, ``optimizer`` has no
        ``init``/``update``, or ``loss_scale`` is not a ``LossScaleRule`` (or is
        given beside a ``dynamic_loss_scale`` optimizer).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import amp_jax
      >>> embed = lambda p, x: x @ p["w"]
      >>> block = lambda p, h: h + jnp.tanh(h @ p["w"])
      >>> head = lambda p, h, x: jnp.mean((h @ p["w"] - x) ** 2)
      >>> params = {"embed": {"w": jnp.eye(4)},
      ...           "blocks": {"w": jnp.zeros((3, 4, 4))},  # 3 layers
      ...           "head": {"w": jnp.eye(4)}}
      >>> step = amp_jax.eager.scan_step(embed, block, head, optax.adam(1e-2))
      >>> opt_state = step.init(params)
      >>> params, opt_state, loss = step(params, opt_state, jnp.ones((2, 4)))
      >>> opt_state.blocks[0].count  # one count per layer
      Array([1, 1, 1], dtype=int32)

    References:
      Lv et al., "Full Parameter Fine-tuning for Large Language Models with
      Limited Resources" (LOMO), 2023, https://arxiv.org/abs/2306.09782.
      PyTorch tutorial "How to save memory by fusing the optimizer step into the
      backward pass", 2023,
      https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html.
    """
    for name, fn in (
        ("embed_fn", embed_fn),
        ("block_fn", block_fn),
        ("head_loss_fn", head_loss_fn),
    ):
        if not callable(fn):
            raise TypeError(
                f"scan_step: `{name}` must be callable, got {type(fn).__name__}: {fn!r}."
            )
    # (an optax factory passed uncalled, e.g. optax.adam, gets the fix)
    optimizer = transformation(optimizer, "scan_step", "optimizer")
    if not isinstance(remat, bool):
        raise TypeError(f"scan_step: `remat` must be a bool, got {remat!r}.")
    if loss_scale is not None and not isinstance(loss_scale, LossScaleRule):
        raise TypeError(
            f"scan_step: `loss_scale` must be an amp_jax.optim.LossScaleRule (the "
            f"`.rule` of a dynamic_loss_scale(...)), got {type(loss_scale).__name__}."
        )
    if isinstance(optimizer, DynamicLossScale):
        if loss_scale is not None:
            raise TypeError(
                "scan_step: `optimizer` is a dynamic_loss_scale(...) and `loss_scale` is "
                "given too; pass scan_step(..., tx.inner, loss_scale=tx.rule) or just tx."
            )
        optimizer, loss_scale = optimizer.inner, optimizer.rule
    return ScanStep(embed_fn, block_fn, head_loss_fn, optimizer, remat, loss_scale)
