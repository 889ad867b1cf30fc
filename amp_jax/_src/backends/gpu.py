"""GPUs: which cuDNN attention and fp8 matmul kernels the devices have.

Read from public device attributes (``Device.compute_capability``,
``Device.device_kind``); a process without a GPU may still plan for one
(``amp(fn, backend="gpu")``), and then assumes the kernels are there, leaving
cuDNN's own checks to trace time on the GPU.
"""

from __future__ import annotations

import functools

import jax

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
