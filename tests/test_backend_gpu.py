"""GPUs (``amp_jax._src.backends.gpu``): the cuDNN attention and fp8 matmul
gating, checked on any machine with fake device facts."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from amp_jax._src import attention
from amp_jax._src.backends import backend_for, gpu


@pytest.mark.parametrize(
    "kind, limit",
    [
        ("NVIDIA H100 80GB HBM3", 256),
        ("NVIDIA H200", 256),
        ("NVIDIA GH200 480GB", 256),
        ("NVIDIA B200", 256),
        ("NVIDIA A100-SXM4-80GB", 128),
        ("Tesla V100", 128),
        ("cpu", 128),
    ],
)
def test_cudnn_head_dim_limit_by_device_kind(kind, limit):
    assert gpu.cudnn_head_dim_limit(kind) == limit


def test_cudnn_head_dim_limit_reads_this_process_device(monkeypatch):
    fake = [types.SimpleNamespace(device_kind="NVIDIA H100 PCIe", platform="gpu")]
    monkeypatch.setattr(jax, "devices", lambda *a: fake)
    assert gpu.cudnn_head_dim_limit() == 256
    assert gpu.have_cudnn()

    def no_devices(*a):
        raise RuntimeError("no backend")

    monkeypatch.setattr(jax, "devices", no_devices)
    assert gpu.cudnn_head_dim_limit() == 128  # unknown device: the conservative bound
    assert not gpu.have_cudnn()


@pytest.mark.parametrize(
    "cc, native",
    [("9.0", True), ("8.9", True), ("10.0", True), ("8.6", False), ("8.0", False)]
    + [(None, False), ("", False), ("gfx942", False)],
)
def test_float8_matmuls_from_compute_capability(cc, native):
    assert gpu.compute_capability_has_float8(cc) is native


def test_native_float8_matmul_reads_the_gpus(monkeypatch):
    gpu.native_float8_matmul.cache_clear()
    try:
        fake = [types.SimpleNamespace(compute_capability="9.0", platform="gpu")]
        monkeypatch.setattr(jax, "devices", lambda *a: fake)
        assert backend_for("gpu").native_float8_matmul()
        assert not backend_for("cpu").native_float8_matmul()  # the record says: none
    finally:
        gpu.native_float8_matmul.cache_clear()


def _sdpa(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _decisions(backend, head_dim=16):
    from amp_jax._src import compat
    from amp_jax._src.context import inline_jits

    x = jnp.ones((2, 8, 2, head_dim))
    closed = inline_jits(jax.make_jaxpr(_sdpa)(x, x, x))
    jaxpr = compat.jaxpr_of(closed)
    consts = dict(zip(jaxpr.constvars, compat.consts_of(closed)))
    target = backend_for(backend)
    out = attention.plan_attention(
        jaxpr, consts, mode="auto", backend=target, compute_dtype=jnp.bfloat16
    )
    return [(impl, reason) for _, impl, reason in out.log]


def test_fused_attention_only_where_the_backend_has_it(monkeypatch):
    """attention='auto' asks the backend record: fused on "gpu" (planned without
    a GPU, cuDNN's own checks wait for it), left as written on cpu and tpu."""
    monkeypatch.setattr(gpu, "have_cudnn", lambda: False)
    (gpu_plan,) = _decisions("gpu")
    assert gpu_plan[0] == "cudnn" and "planned without a GPU" in gpu_plan[1]
    for name in ("cpu", "tpu"):
        ((impl, reason),) = _decisions(name)
        assert impl is None and f"no fused attention kernel on {name}" in reason


def test_cudnn_head_dim_limit_gates_the_plan(monkeypatch):
    monkeypatch.setattr(gpu, "have_cudnn", lambda: False)
    monkeypatch.setattr(gpu, "cudnn_head_dim_limit", lambda kind=None: 128)
    ((impl, reason),) = _decisions("gpu", head_dim=192)
    assert impl is None and "at most 128" in reason
    monkeypatch.setattr(gpu, "cudnn_head_dim_limit", lambda kind=None: 256)
    ((impl, _),) = _decisions("gpu", head_dim=192)
    assert impl == "cudnn"
