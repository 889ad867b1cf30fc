"""The precision modes the demo compares, and one training run per mode.

Every mode trains the same model from the same float32 initialisation on the
same batches; only the precision recipe changes:

* ``f32``: float32 everything, AdamW.
* ``amp-bf16``: float32 parameters, ``amp(loss, policy="bfloat16")``, AdamW.
* ``amp-f16``: float32 parameters, ``amp(loss, policy="float16")``, AdamW
  inside [`amp_jax.optim.dynamic_loss_scale`][amp_jax.optim.dynamic_loss_scale].
* ``bf16-kahan``: pure bfloat16 parameters (no float32 copy),
  ``amp(loss, policy="bfloat16")`` for float32 softmax/norm statistics,
  AdamW with bfloat16 moments and Kahan-compensated updates.
* ``amp-fp8`` (opt-in, not in the default set): float32 parameters,
  ``amp(loss, policy="float8")`` -- the dense matmuls in float8 with dynamic
  per-tensor scales (emulated where the GPU has no fp8 matmuls, and on CPU),
  the rest as ``amp-bf16``; AdamW. Compare it with ``--modes amp-bf16,amp-fp8``.
* ``amp-bf16-stream`` (opt-in): float32 parameters cast to bfloat16 where the
  loss starts, as Flax's ``dtype=bfloat16`` does, under
  ``amp(loss, policy="bfloat16")``: the residual stream between blocks is
  bfloat16 where ``amp-bf16`` keeps it float32 (norms, softmax and the loss
  stay float32 in both); AdamW on the float32 parameters. Compare it with
  ``--modes amp-bf16,amp-bf16-stream``: faster where the stream's memory
  traffic counts, at a validation-loss cost to measure on your model.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax import amp, optim
from amp_jax.demo import _data, _model


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    description: str
    policy: str | None  # amp policy, None for plain float32
    param_dtype: Any
    make_tx: Callable[[optax.Schedule], optax.GradientTransformation]
    loss_scaled: bool = False
    #: the dtype the loss casts the parameters to where it starts (None: none)
    cast_params: Any = None


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode(
            "f32",
            "float32 params and compute, AdamW",
            None,
            jnp.float32,
            lambda lr: optim.adamw(lr, weight_decay=0.0),
        ),
        Mode(
            "amp-bf16",
            "float32 params, amp bfloat16, AdamW",
            "bfloat16",
            jnp.float32,
            lambda lr: optim.adamw(lr, weight_decay=0.0),
        ),
        Mode(
            "amp-f16",
            "float32 params, amp float16, AdamW + dynamic loss scale",
            "float16",
            jnp.float32,
            lambda lr: optim.dynamic_loss_scale(optim.adamw(lr, weight_decay=0.0)),
            loss_scaled=True,
        ),
        Mode(
            "bf16-kahan",
            "bfloat16 params, amp bfloat16, AdamW (bf16 moments) + Kahan",
            "bfloat16",
            jnp.bfloat16,
            lambda lr: optim.adamw(
                lr, weight_decay=0.0, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, kahan=True
            ),
        ),
        Mode(
            "amp-fp8",
            "float32 params, amp float8 (dense matmuls fp8, tensorwise scales), AdamW",
            "float8",
            jnp.float32,
            lambda lr: optim.adamw(lr, weight_decay=0.0),
        ),
        Mode(
            "amp-bf16-stream",
            "float32 params cast to bfloat16 at the start (bf16 residual stream), "
            "amp bfloat16, AdamW",
            "bfloat16",
            jnp.float32,
            lambda lr: optim.adamw(lr, weight_decay=0.0),
            cast_params=jnp.bfloat16,
        ),
    )
}

#: the modes a plain ``python -m amp_jax.demo`` runs (amp-fp8 is opt-in: it pays
#: only on GPUs with fp8 matmuls, and is emulated -- slower -- elsewhere)
DEFAULT_MODES: tuple[str, ...] = ("f32", "amp-bf16", "amp-f16", "bf16-kahan")


@dataclasses.dataclass
class RunResult:
    mode: str
    description: str
    train_steps: list[int]
    train_loss: list[float]
    val_steps: list[int]
    val_loss: list[float]
    step_times_s: list[float]
    compile_s: float
    step_memory_bytes: int | None
    opt_state_bytes: int
    param_bytes: int
    tokens_per_step: int
    extra: dict[str, Any]
    #: per step, for loss-scaled modes: the scale after the step (else empty)
    loss_scale: list[float] = dataclasses.field(default_factory=list)
    #: steps whose update was skipped (non-finite gradients)
    skipped_at: list[int] = dataclasses.field(default_factory=list)

    @property
    def median_step_s(self) -> float:
        times = self.step_times_s[1:] or self.step_times_s  # first step warms caches
        return float(np.median(times))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_step_s

    @property
    def final_train_loss(self) -> float:
        k = max(1, len(self.train_loss) // 10)
        return float(np.mean(self.train_loss[-k:]))

    @property
    def final_val_loss(self) -> float:
        return float(self.val_loss[-1])

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "median_step_ms": 1e3 * self.median_step_s,
            "compile_s": self.compile_s,
            "step_memory_bytes": self.step_memory_bytes,
            "opt_state_bytes": self.opt_state_bytes,
            "param_bytes": self.param_bytes,
            "final_train_loss": self.final_train_loss,
            "final_val_loss": self.final_val_loss,
        }


def schedule(lr: float, steps: int) -> optax.Schedule:
    warmup = max(1, steps // 10)
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)


def _memory_bytes(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend/version implements it
        return None
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes)


@dataclasses.dataclass
class BuiltStep:
    """One mode's compiled train step ``(params, opt_state, x, y) -> (params,
    opt_state, loss)`` (params and state donated), its loss and initial state."""

    compiled: Any
    loss: Callable[..., jax.Array]
    params: Any
    opt_state: Any


def mode_loss(mode: Mode, cfg: _model.Config) -> Callable[..., jax.Array]:
    """``loss(params, tokens, targets)`` as ``mode`` computes it."""
    loss: Callable[..., jax.Array] = functools.partial(_model.loss_fn, heads=cfg.heads)
    if mode.cast_params is not None:
        base = loss

        def loss(params: Any, *args: Any) -> jax.Array:
            return base(jax.tree.map(lambda p: p.astype(mode.cast_params), params), *args)

    return loss if mode.policy is None else amp(loss, policy=mode.policy)


def build_step(
    mode: Mode, cfg: _model.Config, *, steps: int, lr: float, seed: int, x: Any, y: Any
) -> BuiltStep:
    """The train step the demo runs for ``mode``, compiled for batches like ``x, y``."""
    loss = mode_loss(mode, cfg)
    params = jax.tree.map(
        lambda p: p.astype(mode.param_dtype), _model.init_params(jax.random.PRNGKey(seed), cfg)
    )
    tx = mode.make_tx(schedule(lr, steps))
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        if mode.loss_scaled:
            value, grads = optim.scaled_value_and_grad(loss, opt_state)(params, x, y)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x, y).compile()
    return BuiltStep(compiled, loss, params, opt_state)


def train(
    mode: Mode,
    cfg: _model.Config,
    corpus: _data.Corpus,
    *,
    steps: int,
    lr: float,
    seed: int,
    eval_every: int,
    val_batches: int,
    progress: Callable[..., Any] | None = None,
) -> RunResult:
    """Trains one mode and measures it. ``progress`` wraps the step range (e.g. tqdm)."""
    offsets = _data.batch_offsets(len(corpus.train), cfg.seq, cfg.batch, steps, seed + 1)
    val_offsets = _data.batch_offsets(len(corpus.val), cfg.seq, cfg.batch, val_batches, seed + 2)
    val = [_data.windows(corpus.val, o, cfg.seq) for o in val_offsets]
    x0, y0 = _data.windows(corpus.train, offsets[0], cfg.seq)

    t0 = time.perf_counter()
    built = build_step(mode, cfg, steps=steps, lr=lr, seed=seed, x=x0, y=y0)
    compile_s = time.perf_counter() - t0
    compiled, params, opt_state = built.compiled, built.params, built.opt_state
    eval_loss = jax.jit(built.loss)

    def evaluate(p):
        return float(np.mean([float(eval_loss(p, x, y)) for x, y in val]))

    result = RunResult(
        mode.name,
        mode.description,
        [],
        [],
        [],
        [],
        [],
        compile_s,
        _memory_bytes(compiled),
        optim.state_bytes(opt_state),
        optim.state_bytes(params),
        cfg.seq * cfg.batch,
        {},
    )
    it = range(1, steps + 1)
    it = progress(it) if progress is not None else it
    for i in it:
        x, y = _data.windows(corpus.train, offsets[i - 1], cfg.seq)
        t = time.perf_counter()
        params, opt_state, value = compiled(params, opt_state, x, y)
        value = float(value)  # blocks until the step is done
        result.step_times_s.append(time.perf_counter() - t)
        result.train_steps.append(i)
        result.train_loss.append(value)
        if mode.loss_scaled:
            stats = optim.loss_scale_stats(opt_state)
            result.loss_scale.append(float(stats["scale"]))
            if int(stats["last_skipped_step"]) == int(stats["steps"]):
                result.skipped_at.append(i)
        if i % eval_every == 0 or i == steps:
            result.val_steps.append(i)
            result.val_loss.append(evaluate(params))
        if hasattr(it, "set_postfix"):
            post = {"loss": f"{value:.3f}"}
            if result.val_loss:
                post["val"] = f"{result.val_loss[-1]:.3f}"
            it.set_postfix(post, refresh=False)
    if mode.loss_scaled:
        stats = optim.loss_scale_stats(opt_state)
        result.extra = {
            "final_loss_scale": float(stats["scale"]),
            "skipped_steps": int(stats["skipped_steps"]),
        }
    return result
