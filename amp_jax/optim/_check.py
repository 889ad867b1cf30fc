"""Up-front argument checks for the public factories: every error names the
function, the argument, the value it got and what is allowed."""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax._src.optstate import transformation as transformation


def real(value: Any, caller: str, argname: str, example: str) -> float:
    """``value`` as a Python float; it must be a real number (not a string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.integer, np.floating)
    ):
        if not (
            isinstance(value, (jax.Array, np.ndarray))
            and np.ndim(value) == 0
            and jnp.issubdtype(value.dtype, jnp.number)
        ):
            raise TypeError(
                f"{caller}: `{argname}` must be a real number, got "
                f"{type(value).__name__}: {value!r}; use e.g. {argname}={example}."
            )
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError(
            f"{caller}: `{argname}` must be a concrete number, got a traced value "
            f"{value!r}; pass a Python number."
        ) from e


def integer(value: Any, caller: str, argname: str, minimum: int, example: str) -> int:
    """``value`` as a Python int >= ``minimum`` (NumPy integers accepted)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(
            f"{caller}: `{argname}` must be an int >= {minimum}, got "
            f"{type(value).__name__}: {value!r}; use e.g. {argname}={example}."
        )
    value = int(value)
    if value < minimum:
        raise ValueError(
            f"{caller}: `{argname}` must be an int >= {minimum}, got {value!r}; "
            f"use e.g. {argname}={example}."
        )
    return value


def boolean(value: Any, caller: str, argname: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{caller}: `{argname}` must be a bool, got {type(value).__name__}: {value!r}."
        )
    return bool(value)


def hyperparameter(
    value: Any, caller: str, argname: str, example: str, schedule: bool = False
) -> Any:
    """A number (or array; a schedule when ``schedule``) left as it is: only
    values that can never work (strings, None, bools) are refused."""
    ok = isinstance(value, (numbers.Real, np.number, jax.Array, np.ndarray)) or (
        schedule and callable(value)
    )
    if isinstance(value, (bool, np.bool_)) or not ok:
        what = "a number or a schedule" if schedule else "a number"
        raise TypeError(
            f"{caller}: `{argname}` must be {what}, got {type(value).__name__}: "
            f"{value!r}; use e.g. {argname}={example}."
        )
    return value


def single_key(key: object, caller: str) -> jax.Array:
    """A single PRNG key (typed, raw uint32 data) or an int seed, as an array."""
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(
            f"{caller}: `key` must be a PRNG key or an int seed, got "
            f"{key!r}; use e.g. jax.random.key(0)."
        )
    if isinstance(key, (numbers.Integral, np.integer)):
        return jax.random.key(int(key))
    if not isinstance(key, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{caller}: `key` must be a PRNG key or an int seed, got "
            f"{type(key).__name__}: {key!r}; use e.g. "
            f"jax.random.key(0)."
        )
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.ndim != 0:
            raise ValueError(
                f"{caller}: `key` must be a single PRNG key, got a batch of keys of "
                f"shape {key.shape}; pass one key, e.g. keys[0] or "
                f"jax.random.key(0)."
            )
    elif key.dtype != jnp.uint32 or key.ndim != 1:
        raise ValueError(
            f"{caller}: `key` must be a single PRNG key (a typed key, or raw "
            f"uint32 key data of shape (2,)), got {key.dtype}{list(key.shape)}; "
            f"pass one key, e.g. jax.random.key(0)."
        )
    return key


def warn_if_redundant(params: Any, at_least: Any, what: str) -> None:
    """A UserWarning when every floating leaf of ``params`` is already ``at_least`` wide."""
    floats = [p for p in jax.tree.leaves(params) if jnp.issubdtype(p.dtype, jnp.floating)]
    if floats and all(np.dtype(p.dtype).itemsize >= np.dtype(at_least).itemsize for p in floats):
        warnings.warn(
            f"{what} over parameters that are all {floats[0].dtype} or wider does nothing "
            "useful and costs memory: drop it (use the inner optimizer directly; adamw: "
            "kahan=False), or store the parameters in bfloat16 or float16, where it helps.",
            UserWarning,
            stacklevel=3,
        )


def adam_hyperparameters(caller: str, b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
    """Checks Adam's ``b1``, ``b2``, ``eps`` and ``eps_root`` for ``caller``."""
    for name, value, example in (
        ("b1", b1, "0.9"),
        ("b2", b2, "0.999"),
        ("eps", eps, "1e-8"),
        ("eps_root", eps_root, "0.0"),
    ):
        hyperparameter(value, caller, name, example)


class RoundedAwayWarning(UserWarning):
    """bfloat16 or float16 parameters are updated with rounding to nearest.

    [`adamw`][amp_jax.optim.adamw] warns with it, once, when its ``init`` sees
    16-bit parameters and no wrapper lands the updates: ``optax.apply_updates``
    rounds ``p + u`` to the parameter's dtype, and an update below half an ulp
    is lost without an error. Wrap the optimizer in
    [`master_weights`][amp_jax.optim.master_weights],
    [`kahan_summation`][amp_jax.optim.kahan_summation] (``adamw(kahan=True)``)
    or [`stochastic_rounding`][amp_jax.optim.stochastic_rounding]; where
    rounding to nearest is what you want, filter it:
    ``warnings.filterwarnings("ignore", category=RoundedAwayWarning)``.

    Attributes:
      args: the message, a one-element tuple (as every ``Warning``).
    """


#: set while a wrapper that lands updates exactly (Kahan, stochastic rounding)
#: initialises its inner transformation
_LANDED: contextvars.ContextVar[bool] = contextvars.ContextVar("amp_jax_landed", default=False)


@contextlib.contextmanager
def landing_handled() -> Iterator[None]:
    """Marks the inner ``init`` of a wrapper that keeps small updates (Kahan
    summation, stochastic rounding): its parameters may be 16-bit."""
    token = _LANDED.set(True)
    try:
        yield
    finally:
        _LANDED.reset(token)


def warn_if_rounded_away(params: Any, caller: str) -> bool:
    """A `RoundedAwayWarning` when a floating leaf of ``params`` is 16-bit and
    no wrapper lands the updates; returns whether it warned.

    ``optax.apply_updates`` rounds ``p + u`` to the parameter's dtype, so an
    update below half a 16-bit ulp (1e-5 on a weight of 0.1 in float16, 4e-4
    in bfloat16) leaves the parameter where it was: training stalls without an
    error.
    """
    if _LANDED.get():
        return False
    low = sorted(
        {
            str(p.dtype)
            for p in jax.tree.leaves(params)
            if hasattr(p, "dtype")
            and jnp.issubdtype(p.dtype, jnp.floating)
            and np.dtype(p.dtype).itemsize == 2
        }
    )
    if not low:
        return False
    warnings.warn(
        f"{caller}: the parameters hold {' and '.join(low)} leaves, and their updates are "
        "rounded to nearest when applied: an update below half an ulp is lost (with "
        "float16 weights near 0.1 and a learning rate of 1e-5, about half the parameters "
        "do not move). Wrap the optimizer in amp_jax.optim.master_weights(...) (float32 "
        "master copy), amp_jax.optim.kahan_summation(...) (adamw: kahan=True) or "
        "amp_jax.optim.stochastic_rounding(..., key), or keep the parameters in float32.",
        RoundedAwayWarning,
        stacklevel=3,
    )
    return True
