"""``amp`` and ``full_precision``: the transformations a user calls, with their options,
their decorator forms (``@amp(policy=...)``) and the errors that show the right call.

``amp`` checks its options and returns an `AmpFunction` (transform.py), which traces,
plans and evaluates the function it wraps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, cast, overload

import jax
from jax.typing import DTypeLike

from amp_jax._src.policy import FULL_PRECISION_SCOPE, Policy, get_policy
from amp_jax._src.transform import AmpFunction

F = TypeVar("F", bound=Callable[..., Any])


def _brief(value: object, limit: int = 80) -> str:
    """A short description of ``value`` for an error message (never a whole pytree)."""
    if isinstance(value, Mapping):
        keys = [repr(k) for k in list(value)[:4]]
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} with keys [{', '.join(keys)}{more}]"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({type(value).__name__}, {len(text)} characters)"


class _Decorator:
    """What ``amp(policy=...)`` and ``full_precision()`` return: a decorator.

    Used as a context manager (``with amp():``, the ``torch.autocast`` habit),
    it raises a ``TypeError`` that shows the function form.
    """

    def __init__(
        self, apply: Callable[[Callable[..., Any]], Any], name: str, options: str = ""
    ) -> None:
        self._apply, self._name, self._options = apply, name, options

    def __call__(self, fn: Callable[..., Any]) -> Any:
        return self._apply(fn)

    def __repr__(self) -> str:
        return f"<decorator {self._name}({self._options})>"

    def __enter__(self) -> None:
        at = f"@{self._name}({self._options})" if self._options else f"@{self._name}"
        raise TypeError(
            f"{self._name}() is not a context manager: {self._name} transforms a function, "
            f"as jax.jit does. Decorate the function instead:\n\n    {at}\n"
            f"    def loss(params, batch): ...\n\nor wrap it: {self._name}(loss"
            + (f", {self._options})." if self._options else ").")
        )

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


def _options_by_keyword(fn: F) -> F:
    """amp(f, "float16") names the keyword rather than Python's positional-count error."""

    @functools.wraps(fn)
    def checked(*args: object, **kwargs: object) -> Any:
        if len(args) > 1:
            raise TypeError(
                f"amp() takes its options by keyword: write amp(fn, policy={_brief(args[1])}) "
                f"(got {len(args)} positional arguments: fn and {_brief(args[1])})."
            )
        return fn(*args, **kwargs)

    return cast(F, checked)  # same signature: it only refuses a second positional


@overload
def amp(
    fn: F,
    /,
    *,
    policy: Policy | str | DTypeLike = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> F: ...
@overload
def amp(
    fn: None = None,
    /,
    *,
    policy: Policy | str | DTypeLike = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> Callable[[F], F]: ...
@_options_by_keyword
def amp(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    policy: Policy | str | DTypeLike = "bfloat16",
    strict: bool | None = None,
    cache_size: int = 64,
) -> Any:
    """Automatic mixed precision: runs ``fn`` with its primitives recast by ``policy``.

    ``amp`` traces ``fn`` to a jaxpr once per input signature, decides for
    every primitive whether it runs in the compute dtype (matmuls,
    convolutions and the elementwise ops between them), in float32
    (exp/log/pow, accumulating reductions, normalisation statistics, losses)
    or in its original dtypes, and evaluates the result under the caller's
    trace -- so ``jit``, ``grad``, ``vmap`` and friends compose with it. The
    policy applies inside every higher-order primitive (``jit``, ``cond``,
    ``while``, ``scan``, ``checkpoint``, ``custom_jvp``/``custom_vjp``,
    ``shard_map``). Outputs keep the dtypes ``fn`` returns; under ``jax.grad``
    gradients come back in the parameters' dtypes, and the backward matmuls
    and convolutions also run with compute-dtype operands.

    Args:
      fn: the function to transform. Array leaves of its arguments (any
        pytree, positional or keyword) are traced; other leaves (strings,
        callables, ``None``, Python scalars) are passed through as static
        values, as they would be without ``amp``, and are part of the trace
        cache key (plain objects by identity and attributes). A plain object
        (not a pytree) that holds arrays is refused with a ``TypeError``, as
        ``jax.jit`` refuses it: amp would bake the arrays into its cached
        trace. ``fn`` may itself be a pytree (an Equinox or Flax NNX module):
        the result is then a pytree over it, and its arrays are traced. The
        arrays bound in a ``functools.partial`` are constants of its trace,
        as under ``jax.jit`` (its arguments cannot be rebound). Two ``amp(fn)`` of an equal ``fn`` and options are equal and share
        their traces. Output leaves that are not arrays (a string, a
        model's activation function, a Python ``int``/``float``/``bool``/
        ``complex``: a constant of the trace) are returned as they are, as
        ``fn`` and ``eqx.filter_jit`` return them; NumPy arrays and scalars
        come back as jax Arrays, as from ``jax.jit``. Under ``jax.disable_jit()`` amp, as
        ``jax.jit``, calls ``fn`` as Python: no trace and no cast.
      policy: a [`Policy`][amp_jax.Policy], a preset name (``"bfloat16"``,
        ``"float16"``, ``"float32"``) or a dtype. ``"float32"`` is the
        identity: amp calls ``fn``, so results, gradients and state writes
        are bitwise its own, eagerly and under ``jit``.
      strict: if true, a primitive that is in no class of the policy raises
        ``NotImplementedError`` naming it (default: treat it as ``follow``).
        Overrides ``policy.strict`` when given.
      cache_size: how many input signatures keep their trace (an LRU,
        default 64); a program that cycles through more shapes retraces.

    Returns:
      A function with the signature and output structure of ``fn``. It can
      be used as ``@amp``, ``@amp(policy=...)`` or ``amp(fn, policy=...)``.

    Raises:
      TypeError: ``fn`` is not callable, or the policy was passed by position
        (``amp(f, "float16")``: write ``amp(f, policy="float16")``).
      ValueError: ``policy`` is not a known preset, Policy or float dtype,
        or ``cache_size`` is not an int >= 1.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from amp_jax import amp
      >>> @amp
      ... def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> jax.grad(loss)(w, x).dtype
      dtype('float32')
    """
    pol = get_policy(policy)
    if strict is not None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {strict!r}.")
        pol = pol.replace(strict=strict)
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise ValueError(f"amp(cache_size={cache_size!r}) must be an int >= 1 (default 64).")
    if fn is None:
        return _Decorator(
            functools.partial(amp, policy=pol, cache_size=cache_size),
            "amp",
            "" if isinstance(policy, str) and policy == "bfloat16" else f"policy={_brief(policy)}",
        )
    if not callable(fn):
        raise TypeError(
            f"amp(fn) needs a callable, got {type(fn).__name__}: {_brief(fn)}. Use @amp or "
            "amp(fn, policy=...) on a function, then call it with the arrays: amp(loss)(params, x)."
        )
    return AmpFunction(fn, pol, cache_size)


@overload
def full_precision(fn: F) -> F: ...


@overload
def full_precision(fn: None = None) -> Callable[[F], F]: ...


def full_precision(fn: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Marks ``fn`` to run in its original precision under [`amp`][amp_jax.amp].

    The equivalent of ``torch.autocast(enabled=False)``: every primitive traced
    while ``fn`` runs (including its backward, and anything nested in ``jit``,
    ``scan`` etc.) keeps its original dtypes. It works through a
    ``jax.named_scope`` called ``"amp_full_precision"``; outside ``amp`` it
    changes nothing. Also usable as a decorator.

    Args:
      fn: the function to keep in full precision.

    Returns:
      The wrapped function.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import amp, full_precision
      >>> @full_precision
      ... def sensitive(a, b):
      ...     return a @ b
      >>> amp(lambda a, b: sensitive(a, b) + (a @ b))(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype
      dtype('float32')
    """
    if fn is None:
        return _Decorator(full_precision, "full_precision")
    if not callable(fn):
        raise TypeError(
            f"full_precision(fn) needs a callable, got {type(fn).__name__}: {_brief(fn)}."
        )

    @functools.wraps(fn)
    def wrapped(*args: object, **kwargs: object) -> Any:
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return fn(*args, **kwargs)

    return wrapped
