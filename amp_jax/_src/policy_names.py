"""The names a policy is given by: presets, their aliases, Keras' policy names and
jmp's policy strings (``"p=f32,c=bf16,o=f32"``), each read as `Policy` fields."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

PRESETS: dict[str, Any] = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
}
ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8",
    "f8": "float8",
    "fp8_rowwise": "float8_rowwise",
    "f8_rowwise": "float8_rowwise",
}
_VALID_COMPUTE = (jnp.bfloat16, jnp.float16, jnp.float32)
#: presets that set more than the compute dtype: {name: Policy fields}
_POLICY_PRESETS: dict[str, dict[str, Any]] = {
    "float8": {"compute_dtype": jnp.bfloat16, "float8": "tensorwise"},
    "float8_rowwise": {"compute_dtype": jnp.bfloat16, "float8": "rowwise"},
}

#: Keras' mixed-precision policy names -> the amp preset that means the same
_KERAS_NAMES = {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
_JMP_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute"}
_JMP_KEYS |= {"o": "output", "output": "output"}


def named_fields(name: str, argname: str) -> dict[str, Any]:
    """The Policy fields a policy name means (a preset, an alias, a Keras name or
    a jmp string): what ``get_policy(name)`` and ``Policy(name)`` build."""
    key = ALIASES.get(name.lower(), name.lower())
    key = _jmp_or_keras_preset(name) or key
    if key in _POLICY_PRESETS:
        return dict(_POLICY_PRESETS[key])
    if key not in PRESETS:
        valid = ", ".join(repr(n) for n in [*PRESETS, *_POLICY_PRESETS, *ALIASES])
        raise ValueError(
            f"{argname}={name!r} is not a known policy. Valid names: {valid}; Keras' "
            f"{', '.join(map(repr, _KERAS_NAMES))}; a jmp string such as 'p=f32,c=bf16,o=f32'; "
            "or pass an amp_jax.Policy."
        )
    return {"compute_dtype": PRESETS[key]}


def _jmp_or_keras_preset(name: str) -> str | None:
    """The preset a jmp policy string ("p=f32,c=bf16,o=f32") or Keras name means.

    None when ``name`` is neither; ValueError when it has no amp equivalent.
    """
    if name.lower() in _KERAS_NAMES:
        return _KERAS_NAMES[name.lower()]
    if "=" not in name:
        return None
    parts = {}
    for part in name.replace(" ", "").lower().split(","):
        key, _, value = part.partition("=")
        if key not in _JMP_KEYS:
            raise ValueError(
                f"policy={name!r}: unknown key {key!r} in a jmp-style policy string; "
                "use params=/compute=/output= (or p=/c=/o=), e.g. 'p=f32,c=bf16,o=f32'."
            )
        dtype = ALIASES.get(value, {"full": "float32", "single": "float32"}.get(value, value))
        if dtype not in PRESETS:
            raise ValueError(f"policy={name!r}: {value!r} is not a dtype amp computes in.")
        parts[_JMP_KEYS[key]] = dtype
    compute = parts.get("compute", "float32")
    if parts.get("params", "float32") != "float32":
        raise ValueError(
            f"policy={name!r}: amp leaves parameters in the dtype you store them in. Keep "
            f"them {parts['params']} yourself (see the pure-bf16 optimizers) and pass "
            f"policy={compute!r}."
        )
    if parts.get("output", "float32") != "float32":
        raise ValueError(
            f"policy={name!r}: amp returns the dtypes your function returns (float32 for a "
            f"float32 model). Cast the output yourself, or write o=f32: policy={compute!r}."
        )
    return compute


def as_dtype(value: DTypeLike, argname: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not any(dtype == np.dtype(d) for d in _VALID_COMPUTE):
        valid = ", ".join(repr(n) for n in PRESETS)
        raise ValueError(
            f"{argname}={value!r} is not a floating compute dtype amp supports. "
            f"Use one of {valid} (or jnp.bfloat16 / jnp.float16 / jnp.float32)."
        )
    return dtype
