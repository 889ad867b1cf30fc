"""Optax gradient transformations for low-precision training.

Loss scaling, float32 master weights, Kahan-compensated and stochastically
rounded parameter updates, and an any-precision AdamW; every factory returns an
``optax.GradientTransformationExtraArgs`` with NamedTuple state.
"""

from amp_jax.optim._loss_scale import DynamicLossScaleState as DynamicLossScaleState
from amp_jax.optim._loss_scale import StaticLossScaleState as StaticLossScaleState
from amp_jax.optim._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from amp_jax.optim._loss_scale import loss_scale as loss_scale
from amp_jax.optim._loss_scale import scaled_value_and_grad as scaled_value_and_grad
from amp_jax.optim._loss_scale import static_loss_scale as static_loss_scale
from amp_jax.optim._tree import state_bytes as state_bytes

__all__ = [
    "DynamicLossScaleState",
    "StaticLossScaleState",
    "dynamic_loss_scale",
    "loss_scale",
    "scaled_value_and_grad",
    "state_bytes",
    "static_loss_scale",
]
