"""[`underflow_report`][amp_jax.debug.underflow_report]: how much of a loss's float32 gradient a
low-precision dtype (float16) flushes to zero or keeps only as a subnormal, per leaf,
under a given loss scale, and what the amp program's own gradient lost."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from amp_jax._src import compat
from amp_jax._src.diagnostics.probe import is_float_array
from amp_jax._src.diagnostics.tracing import (
    split_fn,
)
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction


@dataclasses.dataclass(frozen=True)
class UnderflowRow:
    """Underflow of one gradient leaf (see [`underflow_report`][amp_jax.debug.underflow_report]).

    Attributes:
      path: the leaf's path in the parameters (``jax.tree_util.keystr``).
      nonzero: how many of its float32 gradient values are nonzero.
      flushed: share of those that become 0 when the scaled float32 gradient
        is stored in the low dtype.
      subnormal: share that land in the low dtype's subnormal range (fewer
        significant bits).
      lost_in_amp: share that are 0 in the gradient the amp program computed
        (scaled, then unscaled in float32) where float32 has a nonzero value.
      max_abs: the largest float32 gradient magnitude (unscaled).
    """

    path: str
    nonzero: int
    flushed: float
    subnormal: float
    lost_in_amp: float
    max_abs: float


@dataclasses.dataclass(frozen=True)
class UnderflowReport:
    """What [`underflow_report`][amp_jax.debug.underflow_report] returns.

    Attributes:
      dtype: the low-precision dtype.
      loss_scale: the loss scale that was applied.
      rows: one [`UnderflowRow`][amp_jax.debug.UnderflowRow] per floating gradient leaf.
      flushed: share of all nonzero float32 gradient values that flush to 0.
      lost_in_amp: share of them that are 0 in the amp program's gradient.
      suggested_scale: a power of two that puts the largest gradient a factor
        of 2 below the dtype's maximum (a starting point: activation
        gradients inside the backward pass can be larger).
    """

    dtype: str
    loss_scale: float
    rows: list[UnderflowRow]
    flushed: float
    lost_in_amp: float
    suggested_scale: float

    def __str__(self) -> str:
        width = max([len(r.path) for r in self.rows] + [9])
        lines = [
            f"{'parameter':<{width}}  {'nonzero':>9}  {'flushed':>8}  {'subnorm':>8}  "
            f"{'lost amp':>8}  {'max |g|':>9}"
        ]
        for r in self.rows:
            lines.append(
                f"{r.path:<{width}}  {r.nonzero:>9}  {100 * r.flushed:>7.2f}%  "
                f"{100 * r.subnormal:>7.2f}%  {100 * r.lost_in_amp:>7.2f}%  {r.max_abs:>9.3g}"
            )
        lines.append(
            f"{self.dtype}, loss scale {self.loss_scale:g}: {100 * self.flushed:.2f}% of nonzero "
            f"float32 gradient values flush to 0 in {self.dtype}; {100 * self.lost_in_amp:.2f}% are "
            f"0 in the amp gradient; suggested loss scale {self.suggested_scale:g}"
        )
        return "\n".join(lines)


class _LeafCounts(NamedTuple):
    """Counts of one gradient leaf's values (what an `UnderflowRow` reports as shares)."""

    path: str
    nonzero: int
    flushed: int
    subnormal: int
    lost: int
    max_abs: float

    def row(self) -> UnderflowRow:
        n = self.nonzero
        share = lambda k: k / n if n else 0.0  # noqa: E731
        return UnderflowRow(
            self.path, n, share(self.flushed), share(self.subnormal), share(self.lost), self.max_abs
        )


def _leaf_counts(
    path: compat.KeyPath, a: ArrayLike, b: ArrayLike, scale: float, low: DTypeLike, tiny: float
) -> _LeafCounts:
    """Counts of float32 gradient ``a`` against its ``low`` storage (scaled by
    ``scale``) and against the amp program's gradient ``b``."""
    a32 = jnp.asarray(a, jnp.float32)
    nz = a32 != 0
    scaled = a32 * scale
    stored = scaled.astype(low)
    return _LeafCounts(
        jax.tree_util.keystr(path) or "(params)",
        int(jnp.sum(nz)),
        int(jnp.sum(nz & (stored == 0))),
        int(jnp.sum(nz & (stored != 0) & (jnp.abs(scaled) < tiny))),
        int(jnp.sum(nz & (jnp.asarray(b, jnp.float32) == 0))),
        float(jnp.max(jnp.abs(a32))) if a32.size else 0.0,
    )


def underflow_report(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    policy: Policy | str | DTypeLike = "float16",
    loss_scale: float = 1.0,
    **kwargs: Any,
) -> UnderflowReport:
    """How much of a loss's gradient the low-precision dtype flushes to zero.

    Computes the float32 gradient of ``loss_fn`` with respect to ``params``
    and, per leaf, the share of its nonzero values that become 0 (or
    subnormal) when multiplied by ``loss_scale`` and stored in the policy's
    dtype -- what a float16 gradient without enough loss scale loses -- and
    the share that is 0 in the gradient the amp program computes with the
    same scale (unscaled in float32 afterwards).

    Args:
      loss_fn: the float32 loss (or an [`amp`][amp_jax.amp]-wrapped one), returning
        a scalar; ``params`` is its first argument.
      params: the parameters (a pytree of float32 arrays).
      *args: the other positional arguments of ``loss_fn``.
      policy: the policy of the amp program (default ``"float16"``).
      loss_scale: the loss scale to evaluate (> 0), e.g. the value
        [`amp_jax.optim.loss_scale`][amp_jax.optim.loss_scale] returns.
      **kwargs: keyword arguments of ``loss_fn``.

    Returns:
      An [`UnderflowReport`][amp_jax.debug.UnderflowReport] (print it for a table).

    Raises:
      ValueError: ``loss_scale`` is not a finite positive number.

    Examples:
      >>> import jax.numpy as jnp
      >>> from amp_jax import debug
      >>> loss = lambda w, x: 1e-7 * jnp.sum(x @ w)
      >>> w, x = jnp.ones((4, 2)), jnp.full((3, 4), 1e-2)
      >>> debug.underflow_report(loss, w, x).flushed
      1.0
      >>> debug.underflow_report(loss, w, x, loss_scale=2.0**12).flushed
      0.0
    """
    scale = float(loss_scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"loss_scale must be a finite number > 0, got {loss_scale!r}; e.g. 2.0**12."
        )
    base, pol = split_fn(loss_fn, policy)
    low = pol.compute_dtype
    g32 = jax.grad(lambda p: jnp.asarray(base(p, *args, **kwargs), jnp.float32))(params)
    amp_loss = AmpFunction(base, pol)
    gamp = jax.grad(lambda p: jnp.asarray(amp_loss(p, *args, **kwargs), jnp.float32) * scale)(
        params
    )
    info = jnp.finfo(low)
    counts = [
        _leaf_counts(path, a, b, scale, low, float(info.tiny))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g32), jax.tree.leaves(gamp))
        if is_float_array(a)
    ]
    rows = [c.row() for c in counts]
    tot_nz = sum(c.nonzero for c in counts)
    tot_flushed = sum(c.flushed for c in counts)
    tot_lost = sum(c.lost for c in counts)
    max_all = max([0.0, *(c.max_abs for c in counts)])
    if max_all > 0:
        suggested = float(2.0 ** np.clip(np.floor(np.log2(float(info.max) / max_all)) - 1, 0, 24))
    else:
        suggested = 1.0
    return UnderflowReport(
        str(np.dtype(low)),
        scale,
        rows,
        tot_flushed / tot_nz if tot_nz else 0.0,
        tot_lost / tot_nz if tot_nz else 0.0,
        suggested,
    )
