"""The mesh the caller is traced under (public ``jax.sharding`` API)."""

from __future__ import annotations

import jax


def partitioned_by_mesh() -> bool:
    """Whether the caller is traced for a mesh of several devices that jit
    partitions (``jax.set_mesh`` with an Auto or Explicit axis of size > 1;
    inside ``shard_map`` the axes are Manual and the arrays local)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    manual = jax.sharding.AxisType.Manual
    return any(
        mesh.shape[name] > 1 and kind != manual
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
    )
