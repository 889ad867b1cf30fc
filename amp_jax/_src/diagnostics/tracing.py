"""How a diagnostic takes its program: the function, its policy, ``grad`` and ``has_aux``.

[`explain`][amp_jax.explain], [`dtype_report`][amp_jax.dtype_report] and the
debug tools take the same options: a float32 function with ``policy=`` or an
amp function, ``grad=True`` (or argnums) for ``jax.value_and_grad``,
``has_aux=True`` for a function returning ``(loss, aux)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.calling import apply, is_dynamic, is_tree
from amp_jax._src.policy import Policy, get_policy
from amp_jax._src.transform import AmpFunction


def check_grad(grad: object) -> int | tuple[int, ...] | None:
    """``grad`` as argnums (an int or a tuple of ints), or None for no gradient."""
    if grad is False or grad is None:
        return None
    if grad is True:
        return 0
    if isinstance(grad, int) or (isinstance(grad, tuple) and all(isinstance(g, int) for g in grad)):
        return grad
    raise TypeError(
        f"grad must be a bool, an int or a tuple of ints (argnums), got {grad!r}; "
        "e.g. grad=True differentiates the first argument."
    )


def split_fn(
    fn: Callable[..., Any], policy: Policy | str | DTypeLike | None, default: str = "bfloat16"
) -> tuple[Callable[..., Any], Policy]:
    """``(the float32 function, the policy)``: an amp function's own unless
    ``policy`` is given; for a plain function ``policy``, else ``default``."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}.")
    if isinstance(fn, AmpFunction):
        return fn.fn, (fn.policy if policy is None else get_policy(policy))
    return fn, get_policy(default if policy is None else policy)


def model_as_argument(
    fn: Callable[..., Any], args: tuple[Any, ...], grad: int | tuple[int, ...] | None
) -> tuple[Callable[..., Any], tuple[Any, ...], int | tuple[int, ...] | None]:
    """``(fn, args, grad)`` with a model given as the function (a Flax NNX or
    Equinox module, a pytree) moved to the first argument of `apply`, as
    ``amp(model)`` traces it; ``grad`` still names the same arguments.

    Its arrays are then arguments of the traced program, so what the model
    writes while it runs (BatchNorm statistics, RNG counts) lands in the
    trace's copy of it: a diagnostic leaves the caller's model as it was,
    rather than write tracers into it (Flax refuses that: TraceContextError).
    """
    if not is_tree(fn):
        return fn, args, grad
    if grad is not None:
        grad = grad + 1 if isinstance(grad, int) else tuple(g + 1 for g in grad)
    return apply, (fn, *args), grad


def loss_of(fn: Callable[..., Any], has_aux: object, caller: str, grad: bool) -> Callable[..., Any]:
    """``fn`` itself, or with ``has_aux=True`` the function returning only the
    first element of ``fn``'s ``(loss, aux)`` output (aux is not analysed);
    differentiating a pair without ``has_aux`` raises an error naming it."""
    if not isinstance(has_aux, bool):
        raise TypeError(f"{caller}: `has_aux` must be a bool, got {has_aux!r}.")
    if not has_aux and not grad:
        return fn

    @functools.wraps(fn)
    def loss_only(*args: object, **kwargs: object) -> Any:
        out = fn(*args, **kwargs)
        pair = isinstance(out, (tuple, list))
        if has_aux and not (pair and len(out) == 2):
            raise TypeError(
                f"{caller}(has_aux=True): the function must return a pair (loss, aux), "
                f"got {type(out).__name__}; pass has_aux=False for a function that "
                "returns the loss alone."
            )
        if not has_aux and pair:
            raise TypeError(
                f"{caller}(grad=...): the function returned a {type(out).__name__} of "
                f"{len(out)}, not a loss; if it returns (loss, aux) as for "
                f"jax.value_and_grad(..., has_aux=True), pass has_aux=True to {caller}."
            )
        return out[0] if has_aux else out

    return loss_only


def flat_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grad: int | tuple[int, ...] | None,
) -> tuple[Callable[..., Any], list[Any]]:
    """``(flat function of the dynamic leaves, those leaves)``; with ``grad``, the
    function returns the gradient w.r.t. the floating leaves of ``args[grad...]``."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_mask = [is_dynamic(x) for x in leaves]
    static = [x for x, d in zip(leaves, dyn_mask) if not d]
    dyn = [x for x, d in zip(leaves, dyn_mask) if d]

    def call(*dyn_vals: Any) -> Any:
        it_dyn, it_static = iter(dyn_vals), iter(static)
        full = [next(it_dyn) if d else next(it_static) for d in dyn_mask]
        a, k = jax.tree.unflatten(treedef, full)
        return fn(*a, **k)

    if grad is None:
        return call, dyn
    argnums = (grad,) if isinstance(grad, int) else tuple(grad)
    wrt = _differentiated(args, leaves, dyn_mask, dyn, argnums)
    if not wrt:
        raise ValueError(
            f"grad={grad!r}: positional argument(s) {argnums} hold no floating "
            "array to differentiate; pass grad=None or the index of the parameters."
        )

    def grad_call(*dyn_vals: Any) -> tuple[jax.Array, list[Any]]:
        def of(diff: list[Any]) -> jax.Array:
            vals = list(dyn_vals)
            for j, v in zip(wrt, diff):
                vals[j] = v
            out = jax.numpy.asarray(call(*vals))
            return out.astype(jax.numpy.float32) if out.ndim == 0 else jax.numpy.sum(out)

        return jax.value_and_grad(of)([dyn_vals[j] for j in wrt])

    return grad_call, dyn


def _differentiated(
    args: tuple[Any, ...],
    leaves: list[Any],
    dyn_mask: list[bool],
    dyn: list[Any],
    argnums: tuple[int, ...],
) -> list[int]:
    """The indices (among the dynamic leaves) of the floating leaves of ``args[argnums]``."""
    owner = []
    for i, a in enumerate(args):
        owner += [i] * len(jax.tree.leaves(a))
    owner += [-1] * (len(leaves) - len(owner))
    dyn_owner = [o for o, d in zip(owner, dyn_mask) if d]
    return [
        j
        for j, (o, x) in enumerate(zip(dyn_owner, dyn))
        if o in argnums and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    ]


def program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grad: int | tuple[int, ...] | None,
) -> tuple[compat.ClosedJaxpr, list[Any]]:
    """``(closed jaxpr, its inputs)`` of ``fn(*args, **kwargs)`` (with ``grad``:
    its ``value_and_grad``): of the original function, or of its
    `AmpFunction` for the program amp runs (whose trace it then keeps, for
    the caller to read its plan)."""
    run, dyn = flat_call(fn, args, kwargs, grad)
    return jax.make_jaxpr(run)(*dyn), dyn
