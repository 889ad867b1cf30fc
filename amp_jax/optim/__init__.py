"""Optax gradient transformations for low-precision training.

Loss scaling, float32 master weights, Kahan-compensated and stochastically
rounded parameter updates, and an any-precision AdamW (moments in any
float dtype, or block-wise quantized to 8 or 4 bits or float8) built from parts that
store any optimizer's moments (`MomentStorage`, `scale_by_adam`, `scale_by_lion`,
`ema`); every factory returns an
``optax.GradientTransformationExtraArgs`` with NamedTuple state.
"""

from amp_jax.optim._adamw import adamw as adamw
from amp_jax.optim._adamw import scale_by_any_precision_adam as scale_by_any_precision_adam
from amp_jax.optim._check import RoundedAwayWarning as RoundedAwayWarning
from amp_jax.optim._kahan import KahanSummationState as KahanSummationState
from amp_jax.optim._kahan import kahan_summation as kahan_summation
from amp_jax.optim._loss_scale import DynamicLossScale as DynamicLossScale
from amp_jax.optim._loss_scale import DynamicLossScaleState as DynamicLossScaleState
from amp_jax.optim._loss_scale import LossScaleRule as LossScaleRule
from amp_jax.optim._loss_scale import ScaledGradients as ScaledGradients
from amp_jax.optim._loss_scale import StaticLossScaleState as StaticLossScaleState
from amp_jax.optim._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from amp_jax.optim._loss_scale import loss_scale as loss_scale
from amp_jax.optim._loss_scale import loss_scale_stats as loss_scale_stats
from amp_jax.optim._loss_scale import scaled_value_and_grad as scaled_value_and_grad
from amp_jax.optim._loss_scale import static_loss_scale as static_loss_scale
from amp_jax.optim._master import MasterWeightsState as MasterWeightsState
from amp_jax.optim._master import master_params as master_params
from amp_jax.optim._master import master_weights as master_weights
from amp_jax.optim._moments import ema as ema
from amp_jax.optim._moments import scale_by_adam as scale_by_adam
from amp_jax.optim._moments import scale_by_lion as scale_by_lion
from amp_jax.optim._quantized import QuantizedArray as QuantizedArray
from amp_jax.optim._quantized import ScaleByQuantizedAdamState as ScaleByQuantizedAdamState
from amp_jax.optim._quantized import scale_by_quantized_adam as scale_by_quantized_adam
from amp_jax.optim._stochastic import StochasticRoundingState as StochasticRoundingState
from amp_jax.optim._stochastic import stochastic_rounding as stochastic_rounding
from amp_jax.optim._storage import MomentStorage as MomentStorage
from amp_jax.optim._tree import state_bytes as state_bytes

__all__ = [
    "DynamicLossScale",
    "DynamicLossScaleState",
    "KahanSummationState",
    "LossScaleRule",
    "MasterWeightsState",
    "MomentStorage",
    "RoundedAwayWarning",
    "QuantizedArray",
    "ScaleByQuantizedAdamState",
    "ScaledGradients",
    "StaticLossScaleState",
    "StochasticRoundingState",
    "adamw",
    "dynamic_loss_scale",
    "ema",
    "kahan_summation",
    "loss_scale",
    "loss_scale_stats",
    "master_params",
    "master_weights",
    "scale_by_adam",
    "scale_by_any_precision_adam",
    "scale_by_lion",
    "scale_by_quantized_adam",
    "scaled_value_and_grad",
    "state_bytes",
    "static_loss_scale",
    "stochastic_rounding",
]
