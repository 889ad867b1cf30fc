"""amp beside the JAX mixed-precision peers, on models nobody here wrote.

Usage (in an environment with the peers installed; see benchmarks/results/RESULTS.md)::

    python -m benchmarks.peers                      # all models, prints Markdown tables
    python -m benchmarks.peers --models eqx_relu,oi --rounds 5
    python -m benchmarks.peers --out /tmp/peers.md
    python -m benchmarks.peers --smoke              # eqx_relu, f32/amp/hand, 1 round (CI)

For each model the train step ``jax.jit(jax.value_and_grad(loss))`` (MPX: its
own ``filter_value_and_grad`` with dynamic loss scaling) is built for every
variant that applies and is installed:

* ``f32``       the float32 model as its library builds it;
* ``amp``       ``amp_jax.amp(loss)`` (bf16 policy, defaults);
* ``hand``      parameters and inputs cast to bf16 at the start, the loss in float32;
* ``jmp``       ``jmp.get_policy("params=float32,compute=bfloat16,output=float32")``;
* ``grampax``   ``grampax.autocast(loss)`` (quax: dots and convs in bf16);
* ``mpx``       MPX (``mixed-precision-for-jax``) ``filter_value_and_grad``, bf16;
* ``jaxamp``    ``jaxamp.amp(loss, compute_dtype=bfloat16)``;
* ``flax_bf16`` the Flax NNX model built with ``dtype=bfloat16`` (params float32);
* ``keras_mixed`` the Keras model built under ``mixed_bfloat16``.

Per variant: median step time (variants timed round-robin in one process),
lower+compile time, the loss after ``--steps`` SGD steps from the same start,
and the dots of the optimized HLO whose operands are both bf16 (of all dots).
A peer that is not installed or that raises is reported with its error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax import amp

BF16, F32 = jnp.bfloat16, jnp.float32


# -- HLO structure -------------------------------------------------------------------

_HEAD = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r"([\w.\-]+): (\w+)\[")
_INSTR = re.compile(r"^(?:ROOT )?%(\S+) = (\w+)\[[^\]]*\]\S* ([\w\-]+)\(")
_DOT_OPS = re.compile(r"dot\(%(\S+), %(\S+)\)")


def count_dots(hlo_text: str) -> tuple[int, int]:
    """(dots whose operands are both bf16, all dots) in an optimized HLO module.
    XLA:CPU wraps dots in fusions: operand types are looked up per computation."""
    bf16 = total = 0
    types: dict[str, str] = {}
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head:
            types = {m.group(1): m.group(2) for m in _PARAM.finditer(head.group(2))}
            continue
        m = _INSTR.match(line.strip())
        if not m:
            continue
        types[m.group(1)] = m.group(2)
        if m.group(3) == "dot":
            ops = _DOT_OPS.search(line)
            total += 1
            if ops and types.get(ops.group(1)) == types.get(ops.group(2)) == "bf16":
                bf16 += 1
    return bf16, total


# -- variants ------------------------------------------------------------------------


def _cast(tree: Any, dtype: Any) -> Any:
    def one(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(one, tree)


def hand(loss: Callable) -> Callable:
    def f(params, *batch):
        return loss(_cast(params, BF16), *_cast(batch, BF16)).astype(F32)

    return f


def jmp_variant(loss: Callable) -> Callable:
    import jmp

    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def f(params, *batch):
        params, batch = policy.cast_to_compute((params, batch))
        return policy.cast_to_output(loss(params, *batch))

    return f


def grampax_variant(loss: Callable) -> Callable:
    import grampax

    return grampax.autocast(loss, dtype=BF16)


def jaxamp_variant(loss: Callable) -> Callable:
    import jaxamp

    return jaxamp.amp(loss, compute_dtype=BF16)


def mpx_step(loss: Callable) -> Callable:
    """MPX's own step: half-precision casts of the arguments and dynamic loss
    scaling; returns (loss, grads) like ``value_and_grad``."""
    import mpx

    mpx.set_half_precision_datatype(BF16)
    scaling = mpx.DynamicLossScaling(
        loss_scaling=jnp.array(2.0**15, F32), min_loss_scaling=jnp.array(1.0, F32)
    )

    def step(params, *batch):
        value, _, _, grads = mpx.filter_value_and_grad(loss, scaling)(params, *batch)
        return value.astype(F32), _cast(grads, F32)

    return jax.jit(step)


WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    "amp": amp,
    "hand": hand,
    "jmp": jmp_variant,
    "grampax": grampax_variant,
    "jaxamp": jaxamp_variant,
}


# -- models ----------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
    name: str
    description: str
    loss: Callable  # loss(params, *batch) -> scalar, float32
    params: Any
    batch: tuple
    lr: float
    #: variants the model brings itself: name -> (loss, params)
    own: dict[str, tuple[Callable, Any]] = dataclasses.field(default_factory=dict)
    #: generic variants that do not apply (with the reason)
    skip: dict[str, str] = dataclasses.field(default_factory=dict)


def _mse(y, t):
    return jnp.mean((y.astype(F32) - t) ** 2)


def eqx_mlp(activation: str) -> Model:
    import equinox as eqx

    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[activation]
    mlp = eqx.nn.MLP(256, 256, 1024, 4, activation=act, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (512, 256), F32)
    t = jax.random.normal(kt, (512, 256), F32)

    def loss(p, x, t):
        return _mse(jax.vmap(eqx.combine(p, static))(x), t)

    return Model(
        f"eqx_{activation}",
        f"`eqx.nn.MLP` 256->1024x4->256, {activation}"
        f"{' (default)' if activation == 'relu' else ''}, vmapped over a batch of 512",
        loss,
        params,
        (x, t),
        lr=0.05,
    )


def _plain_mlp(layout: str) -> Model:
    layers, d, b = 5, 1024, 512
    keys = jax.random.split(jax.random.key(0), layers)
    ws = [jax.random.normal(k, (d, d), F32) / np.sqrt(d) for k in keys]
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (b, d), F32)
    t = jax.random.normal(kt, (b, d), F32)

    def forward(ws, x):
        for w in ws:
            if layout == "io":
                x = jax.nn.relu(x @ w)
            elif layout == "oi":
                x = jax.nn.relu(x @ w.T)
            elif layout == "vmap":
                x = jax.vmap(lambda v, w=w: jax.nn.relu(w @ v))(x)
            elif layout == "einsum":
                x = jax.nn.relu(jnp.einsum("oi,bi->bo", w, x))
            else:  # activations stored (features, batch)
                x = jax.nn.relu(jnp.einsum("io,ib->ob", w, x))
        return x if layout != "einsum_fb" else x.T

    def loss(ws, x, t):
        return _mse(forward(ws, x), t)

    desc = {
        "io": "5x1024 MLP, (in, out) weights, `x @ W`",
        "oi": "5x1024 MLP, (out, in) weights, `x @ W.T` (PyTorch layout)",
        "vmap": "5x1024 MLP, per-example `vmap(lambda v: W @ v)`",
        "einsum": '5x1024 MLP, `einsum("oi,bi->bo", W, x)`',
        "einsum_fb": '5x1024 MLP, `einsum("io,ib->ob", W, x)` (activations feature-major)',
    }[layout]
    if layout == "einsum_fb":
        x = x.T
    return Model(f"mlp_{layout}", desc + ", batch 512, relu", loss, ws, (x, t), lr=0.5)


def nnx_lm() -> Model:
    from flax import nnx

    vocab, d, heads, layers, seq, b = 1024, 256, 4, 2, 128, 4

    class Block(nnx.Module):
        def __init__(self, dtype, rngs):
            kw = dict(dtype=dtype, param_dtype=F32, rngs=rngs)
            self.ln1 = nnx.LayerNorm(d, **kw)
            self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, **kw)
            self.ln2 = nnx.LayerNorm(d, **kw)
            self.up = nnx.Linear(d, 4 * d, **kw)
            self.down = nnx.Linear(4 * d, d, **kw)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, dtype, rngs):
            self.embed = nnx.Embed(vocab, d, dtype=dtype, param_dtype=F32, rngs=rngs)
            self.blocks = nnx.List([Block(dtype, rngs) for _ in range(layers)])
            self.ln = nnx.LayerNorm(d, dtype=dtype, param_dtype=F32, rngs=rngs)
            self.head = nnx.Linear(d, vocab, dtype=dtype, param_dtype=F32, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            mask = nnx.make_causal_mask(tokens)
            for blk in self.blocks:
                x = blk(x, mask)
            return self.head(self.ln(x))

    def build(dtype):
        graph, state = nnx.split(LM(dtype, nnx.Rngs(0)))

        def loss(state, tokens, targets):
            logits = nnx.merge(graph, state)(tokens).astype(F32)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

        return loss, state

    loss, state = build(F32)
    tokens = jax.random.randint(jax.random.key(1), (b, seq + 1), 0, vocab)
    bf_loss, bf_state = build(BF16)
    return Model(
        "nnx_lm",
        f"Flax NNX causal LM from `nnx.MultiHeadAttention`: {layers} layers, d={d}, "
        f"{heads} heads, seq {seq}, batch {b}, vocab {vocab}",
        loss,
        state,
        (tokens[:, :-1], tokens[:, 1:]),
        lr=0.1,
        own={"flax_bf16": (bf_loss, bf_state)},
    )


def keras_gpt2() -> Model:
    import keras
    import keras_hub

    vocab, d, heads, layers, seq, b = 1024, 256, 4, 2, 128, 4

    def build(policy):
        keras.config.set_dtype_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=vocab,
                num_layers=layers,
                num_heads=heads,
                hidden_dim=d,
                intermediate_dim=4 * d,
                max_sequence_length=seq,
                dropout=0.0,
            )
            lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        finally:
            keras.config.set_dtype_policy("float32")
        non_trainable = [v.value for v in lm.non_trainable_variables]

        def loss(trainable, tokens, targets):
            inputs = {"token_ids": tokens, "padding_mask": jnp.ones_like(tokens, bool)}
            logits, _ = lm.stateless_call(trainable, non_trainable, inputs)
            logp = jax.nn.log_softmax(logits.astype(F32))
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

        return lm, loss, [v.value for v in lm.trainable_variables]

    lm32, loss, params = build("float32")
    lm16, loss16, _ = build("mixed_bfloat16")
    lm16.set_weights(lm32.get_weights())
    params16 = [v.value for v in lm16.trainable_variables]
    tokens = jax.random.randint(jax.random.key(1), (b, seq + 1), 0, vocab)
    return Model(
        "keras_gpt2",
        f"keras_hub `GPT2CausalLM` through `stateless_call`: {layers} layers, d={d}, "
        f"{heads} heads, seq {seq}, batch {b}, vocab {vocab}",
        loss,
        params,
        (tokens[:, :-1], tokens[:, 1:]),
        lr=0.1,
        own={"keras_mixed": (loss16, params16)},
    )


MODELS: dict[str, Callable[[], Model]] = {
    "eqx_relu": functools.partial(eqx_mlp, "relu"),
    "eqx_gelu": functools.partial(eqx_mlp, "gelu"),
    "mlp_io": functools.partial(_plain_mlp, "io"),
    "mlp_oi": functools.partial(_plain_mlp, "oi"),
    "mlp_vmap": functools.partial(_plain_mlp, "vmap"),
    "mlp_einsum": functools.partial(_plain_mlp, "einsum"),
    "mlp_einsum_fb": functools.partial(_plain_mlp, "einsum_fb"),
    "nnx_lm": nnx_lm,
    "keras_gpt2": keras_gpt2,
}
VARIANTS = ("f32", "amp", "hand", "jmp", "grampax", "mpx", "jaxamp", "flax_bf16", "keras_mixed")


# -- measuring -------------------------------------------------------------------------


def _error(e: BaseException) -> str:
    msg = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {msg}"[:200].replace("|", "/")


def _sgd(params, grads, lr):
    return jax.tree.map(lambda p, g: p - lr * g.astype(p.dtype), params, grads)


def bench(model: Model, which: tuple[str, ...], rounds: int, steps: int) -> dict[str, dict]:
    res: dict[str, dict] = {}
    compiled: dict[str, tuple[Any, Any]] = {}
    for v in which:
        if v in model.skip:
            res[v] = {"error": f"n/a: {model.skip[v]}"}
            continue
        try:
            if v in model.own:
                loss, params = model.own[v]
                step = jax.jit(jax.value_and_grad(loss))
            elif v in ("flax_bf16", "keras_mixed"):
                continue
            elif v == "f32":
                loss, params = model.loss, model.params
                step = jax.jit(jax.value_and_grad(loss))
            elif v == "mpx":
                params = model.params
                step = mpx_step(model.loss)
            else:
                params = model.params
                step = jax.jit(jax.value_and_grad(WRAPPERS[v](model.loss)))
            t0 = time.perf_counter()
            c = step.lower(params, *model.batch).compile()
            ct = time.perf_counter() - t0
            bf, tot = count_dots(c.as_text())
            p = params
            upd = jax.jit(functools.partial(_sgd, lr=model.lr))
            for _ in range(steps):
                val, g = c(p, *model.batch)
                p = upd(p, g)
            val, _ = c(p, *model.batch)
            res[v] = {"compile_s": ct, "loss": float(val), "dots": f"{bf}/{tot}"}
            compiled[v] = (c, params)
        except Exception as e:  # a peer that crashes is reported, not fatal
            res[v] = {"error": _error(e)}
            print(f"# {model.name}/{v}: {res[v]['error']}", flush=True)
    times: dict[str, list[float]] = {v: [] for v in compiled}
    for _ in range(2):
        for c, p in compiled.values():
            jax.block_until_ready(c(p, *model.batch))
    for _ in range(rounds):
        for v, (c, p) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(p, *model.batch))
            times[v].append(time.perf_counter() - t0)
    for v in compiled:
        res[v]["step_s"] = statistics.median(times[v])
    return res


# -- reporting -------------------------------------------------------------------------


def _versions() -> str:
    import importlib.metadata as md

    names = ["jax", "jaxlib", "flax", "equinox", "keras", "keras-hub", "jmp", "grampax"]
    names += ["quax", "mixed-precision-for-jax", "jaxamp", "optax"]
    out = []
    for n in names:
        try:
            out.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            out.append(f"{n} not installed")
    return ", ".join(out)


def machine() -> list[str]:
    """benchmarks/run.py's machine lines (cpu, its flags and amp's bf16 decision, load),
    with the peers' versions."""
    from benchmarks import run

    m = run.machine()
    return [
        f"- cpu: {m['cpu']}, {m['cores (os.cpu_count)']} cores; cpu flags: {m['cpu flags']}; "
        f"amp bf16 dots: {m['amp bf16 dots on this cpu']}",
        f"- backend: {m['backend']}; python {m['python']}",
        f"- versions: {_versions()}",
        f"- date: {m['date']}; load average at the end (1/5/15 min): "
        f"{m['load average (1/5/15 min)']}",
    ]


def table(res: dict[str, dict]) -> list[str]:
    f32 = res.get("f32", {})
    lines = [
        "| variant | step ms | step vs f32 | compile s | compile vs f32 | loss after N | "
        "bf16 dots after XLA |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | {r['error']} | | | | | |")
            continue
        sv = f"{r['step_s'] / f32['step_s']:.2f}" if "step_s" in f32 else "-"
        cv = f"{r['compile_s'] / f32['compile_s']:.2f}" if "compile_s" in f32 else "-"
        lines.append(
            f"| {v} | {r['step_s'] * 1e3:.1f} | {sv} | {r['compile_s']:.2f} | {cv} | "
            f"{r['loss']:.4f} | {r['dots']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written to ``--out`` if given)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10, help="SGD steps before the loss column")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    p.add_argument("--smoke", action="store_true", help="eqx_relu, 3 variants, 1 round (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.variants, args.rounds, args.steps = "eqx_relu", "f32,amp,hand", 1, 1
    which = tuple(args.variants.split(","))
    out = ["## Machine", ""] + machine() + [""]
    for name in args.models.split(","):
        t0 = time.perf_counter()
        try:
            model = MODELS[name]()
        except Exception as e:
            out += [f"### {name}", "", f"could not build: {_error(e)}", ""]
            continue
        res = bench(model, which, args.rounds, args.steps)
        lines = [f"### {name}: {model.description}", ""] + table(res) + [""]
        print("\n".join(lines), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        out += lines
    out[: len(machine()) + 3] = ["## Machine", ""] + machine() + [""]
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
