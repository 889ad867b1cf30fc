"""GPUs: which cuDNN attention and fp8 matmul kernels the devices have.

Read from public device attributes (``Device.compute_capability``,
``Device.device_kind``); a process without a GPU may still plan for one
(``amp(fn, backend="gpu")``), and then assumes the kernels are there, leaving
cuDNN's own checks to trace time on the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax

#: a fused attention's implementation (``jax.nn.dot_product_attention``'s)
AttentionImpl = Literal["xla", "cudnn"]

#: devices whose cuDNN flash attention takes head dims up to 256 (backward
#: included); older ones (Ampere) stop at 128
_WIDE_HEADS = ("H100", "H200", "H800", "GH200", "B200", "B100")


@functools.cache
def native_float8_matmul() -> bool:
    """Whether this process's GPUs take fp8 matmul operands (XLA then emits an fp8 GEMM).

    True for CUDA GPUs of compute capability 8.9 (Ada) and up, read from the
    public ``Device.compute_capability`` (a ``"9.0"``-style string on CUDA
    devices; absent elsewhere). False without a GPU, on older GPUs and on ROCm
    (whose fp8 formats are the ``fnuz`` variants).
    """
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no such backend in this process
        return False
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    return compute_capability_has_float8(cc)


def compute_capability_has_float8(cc: str | None) -> bool:
    """Whether a CUDA compute capability (``"9.0"``) has fp8 matmul units (8.9 and up)."""
    if not cc:
        return False
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (8, 9)


def have_cudnn() -> bool:
    """Whether this process has a GPU (and with it cuDNN's attention)."""
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001
        return False


def cudnn_head_dim_limit(device_kind: str | None = None) -> int:
    """The largest head dim cuDNN's flash attention takes on ``device_kind``
    (default: this process's first device): 256 on Hopper and Blackwell, else
    128 (Ampere's backward; also when the device is unknown)."""
    if device_kind is None:
        try:
            device_kind = jax.devices()[0].device_kind
        except Exception:  # noqa: BLE001 -- no device info: the conservative bound
            return 128
    return 256 if any(s in device_kind for s in _WIDE_HEADS) else 128


def cudnn_attention(
    backend: str,
    planned_for_gpu: bool,
    head_dim: int,
    tq: int,
    tk: int,
    needs_even: bool,
    probe: Callable[[], object],
) -> tuple[AttentionImpl | None, str]:
    """``(implementation or None, reason)``: whether cuDNN's flash attention
    takes an attention of head dim ``head_dim`` (the larger of the query/key
    and value dims; the smaller is zero-padded) and lengths ``tq``/``tk``
    (``needs_even``: it has a mask or bias, and cuDNN's backward then needs
    even lengths) on ``backend``. ``planned_for_gpu``: the backend fuses
    attention (`Backend.fused_attention`), so a process without a GPU plans
    it unchecked. ``probe()`` traces the fused call and its gradient; any
    exception is cuDNN's refusal (layout, lengths, versions)."""
    limit = cudnn_head_dim_limit()
    if head_dim % 8 or head_dim > limit:
        return None, f"head dim {head_dim}: cuDNN needs a multiple of 8 and at most {limit}"
    if needs_even and (tq % 2 or tk % 2):
        return None, (
            f"odd length (Tq={tq}, Tk={tk}) with a mask or bias: cuDNN's backward needs even ones"
        )
    if not have_cudnn():
        if planned_for_gpu:  # planned for a GPU on a machine without one
            return "cudnn", "cuDNN flash attention (planned without a GPU: cuDNN checks not run)"
        return None, f"no cuDNN on {backend}: left as written"
    try:  # cuDNN's own checks (layout, lengths, versions) run at trace time, some only
        # when differentiated (a mask turned into a bias needs even lengths then)
        probe()
    except Exception as e:  # noqa: BLE001 -- any refusal means: leave it as written
        return None, f"cuDNN refused it: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "cudnn", "cuDNN flash attention"
