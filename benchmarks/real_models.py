"""amp on the real models of issue 57: float32 vs amp vs hand bf16, step and compile.

Usage (in an environment with the model libraries installed; see
benchmarks/results/REAL_MODELS.md for the one these results came from)::

    python -m benchmarks.real_models --out /tmp/real.md
    AMP_JAX_CPU_BF16=no python -m benchmarks.real_models --models gemma,penzai --rounds 15
    python -m benchmarks.real_models --smoke          # tiny configs, 1 round, no file (CI)
    python -m benchmarks.real_models --small --models recurrentgemma  # tiny configs, timed

The models are built by their own libraries, at a small but realistic size
(a few layers: one compile takes seconds, not minutes):

* ``gemma``       gemma's linen ``gm.nn.Transformer`` (Gemma 3 layer: qk-norm, GQA,
  local sliding + global attention, post norms);
* ``penzai``      penzai's llama-like transformer (``llamalike_common``);
* ``recurrentgemma`` recurrentgemma's Griffin (RG-LRU recurrent blocks + local attention);
* ``keras_llama`` keras_hub ``LlamaBackbone`` + a logits head, through ``stateless_call``;
* ``keras_vit``   keras_hub ``ViTImageClassifier``, through ``stateless_call``;
* ``e3nn``        e3nn-jax ``MessagePassingConvolutionFlax`` layers with gates (energy fit);
* ``jax_md``      jax-md ``EnergyGraphNet`` (``energy.graph_network``, dense graph; energy fit).

For each, the train step ``jax.jit(jax.value_and_grad(loss))`` of the variants

* ``f32``   the float32 model as its library builds it;
* ``amp``   ``amp_jax.amp(loss)`` (bf16 policy, defaults; what amp plans depends on
  this CPU's decision, ``AMP_JAX_CPU_BF16`` overrides it);
* ``hand``  parameters and float inputs cast to bf16 at the start (what the
  libraries' own ``dtype=bfloat16`` gives; Keras: the model built under
  ``mixed_bfloat16``), the loss in float32.

Per variant: step time (the variants timed round-robin in one process; median of
wall clock and of process CPU time), lower+compile time (a fresh function each
time, so nothing is cached; the median of ``--compile-reps``, wall and process
CPU time), all as ratios to float32, and the optimized HLO's bf16 dots (of all
dots), converts and distinct loop-fusion kernels. A model whose library is not
installed is reported as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np

import amp_jax
from benchmarks import _report, compile_time, peers, run

F32 = jnp.float32
VARIANTS = ("f32", "amp", "hand")
#: issue 57's targets, amp against float32 in one process
STEP_TARGET_NO_BF16 = 1.02  # where bf16 dots do not pay: float32's program
COMPILE_TARGET = run.TARGET_COMPILE_VS_F32


@dataclasses.dataclass
class Built:
    """A model as its library builds it: the float32 loss and its arguments."""

    description: str
    loss: Callable[..., Any]  # loss(params, *batch) -> float32 scalar
    params: Any
    batch: tuple[Any, ...]
    #: the hand bf16 variant where the library brings its own: (loss, params)
    hand: tuple[Callable[..., Any], Any] | None = None


def _xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def _tokens(b: int, seq: int, vocab: int) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (b, seq + 1), 0, vocab)


# -- models ---------------------------------------------------------------------------


def gemma(small: bool) -> Built:
    from gemma import gm
    from gemma.gm.nn import _modules  # gm.nn's attention kinds (not its checkpoints)

    layers, d, vocab, seq, b = (2, 64, 512, 32, 2) if small else (4, 256, 4096, 128, 4)
    local, glob = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
    cfg = gm.nn.config.TransformerConfig(
        num_embed=vocab,
        embed_dim=d,
        hidden_dim=4 * d,
        num_heads=4,
        head_dim=d // 4,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(local,) * (layers - 1) + (glob,),
        sliding_window_size=seq // 2,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    )
    model = gm.nn.Transformer(config=cfg, dtype=F32)
    tokens = _tokens(b, seq, vocab)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])

    def loss(params, x, y):
        return _xent(model.apply(params, x).logits, y)

    desc = (
        f"gemma `gm.nn.Transformer` (Gemma 3 layers: GQA 4q/1kv, qk-norm, post norms, "
        f"{layers - 1} local sliding + 1 global): {layers} layers, d={d}, seq {seq}, "
        f"batch {b}, vocab {vocab}"
    )
    return Built(desc, loss, params, (tokens[:, :-1], tokens[:, 1:]))


def penzai(small: bool) -> Built:
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as lc

    layers, d, vocab, seq, b = (2, 64, 512, 32, 2) if small else (4, 256, 4096, 128, 4)
    cfg = lc.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=d,
        projection_dim=d // 4,
        mlp_hidden_dim=4 * d,
        num_decoder_blocks=layers,
        vocab_size=vocab,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    model = lc.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
    unbound, params = pz.unbind_params(model, freeze=True)
    tokens = _tokens(b, seq, vocab)

    def loss(params, x, y):
        m = pz.bind_variables(unbound, params)
        logits = m(pz.nx.wrap(x).tag("batch", "seq"))
        return _xent(logits.untag("batch", "seq", "vocabulary").unwrap(), y)

    desc = (
        f"penzai llama-like transformer (`llamalike_common`, swiglu, GQA 4q/2kv): "
        f"{layers} layers, d={d}, seq {seq}, batch {b}, vocab {vocab}"
    )
    return Built(desc, loss, params, (tokens[:, :-1], tokens[:, 1:]))


def recurrentgemma(small: bool) -> Built:
    from recurrentgemma import common
    from recurrentgemma import jax as rg

    layers, d, vocab, seq, b = (3, 64, 512, 32, 2) if small else (3, 256, 4096, 128, 4)
    rec, att = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
    cfg = common.GriffinConfig(
        vocab_size=vocab,
        width=d,
        mlp_expanded_width=3 * d,
        num_heads=4,
        block_types=(rec, rec, att) * (layers // 3),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=seq // 2,
        logits_soft_cap=30.0,
    )
    model = rg.Griffin(cfg, gradient_checkpointing=False)
    tokens = _tokens(b, seq, vocab)
    pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1], pos)

    def loss(params, x, pos, y):
        logits, _ = model.apply(params, x, pos, return_cache=False)
        return _xent(logits, y)

    desc = (
        f"recurrentgemma `Griffin` (2 RG-LRU recurrent blocks : 1 local attention): "
        f"{layers} layers, d={d}, seq {seq}, batch {b}, vocab {vocab}"
    )
    return Built(desc, loss, params, (tokens[:, :-1], pos, tokens[:, 1:]))


def _keras(build: Callable[[], Any], inputs: Callable[..., Any]) -> tuple[Any, ...]:
    """The float32 model's loss and trainables, and its ``mixed_bfloat16`` twin's."""
    import keras

    def one(policy: str) -> tuple[Callable[..., Any], list[Any]]:
        keras.config.set_dtype_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            model = build()
        finally:
            keras.config.set_dtype_policy("float32")
        frozen = [v.value for v in model.non_trainable_variables]

        def loss(trainable, x, y):
            out, _ = model.stateless_call(trainable, frozen, inputs(x))
            return _xent(out, y)

        return loss, [v.value for v in model.trainable_variables]

    loss, params = one("float32")
    loss16, params16 = one("mixed_bfloat16")
    # the same start: mixed_bfloat16 keeps its variables float32
    assert [p.shape for p in params] == [p.shape for p in params16]
    return loss, params, (loss16, params)


def keras_llama(small: bool) -> Built:
    import keras
    import keras_hub

    layers, d, vocab, seq, b = (2, 64, 512, 32, 2) if small else (4, 256, 4096, 128, 4)

    def build():
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocab,
            num_layers=layers,
            num_query_heads=4,
            hidden_dim=d,
            intermediate_dim=4 * d,
            num_key_value_heads=2,
        )
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    def inputs(x):
        return {"token_ids": x, "padding_mask": jnp.ones_like(x, bool)}

    del keras
    loss, params, hand = _keras(build, inputs)
    tokens = _tokens(b, seq, vocab)
    desc = (
        f"keras_hub `LlamaCausalLM` through `stateless_call` (GQA 4q/2kv): {layers} layers, "
        f"d={d}, seq {seq}, batch {b}, vocab {vocab}; hand = the model under `mixed_bfloat16`"
    )
    return Built(desc, loss, params, (tokens[:, :-1], tokens[:, 1:]), hand)


def keras_vit(small: bool) -> Built:
    import keras_hub

    layers, d, img, patch, b = (2, 64, 32, 8, 2) if small else (4, 256, 64, 8, 8)

    def build():
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(img, img, 3),
            patch_size=patch,
            num_layers=layers,
            num_heads=4,
            hidden_dim=d,
            mlp_dim=4 * d,
        )
        return keras_hub.models.ViTImageClassifier(
            backbone=backbone, num_classes=10, preprocessor=None
        )

    loss, params, hand = _keras(build, lambda x: x)
    k1, k2 = jax.random.split(jax.random.key(1))
    images = jax.random.normal(k1, (b, img, img, 3), F32)
    labels = jax.random.randint(k2, (b,), 0, 10)
    desc = (
        f"keras_hub `ViTImageClassifier` through `stateless_call`: {layers} layers, d={d}, "
        f"{img}x{img} images, patch {patch}, batch {b}, 10 classes; "
        "hand = the model under `mixed_bfloat16`"
    )
    return Built(desc, loss, params, (images, labels), hand)


def _graph(n: int, cutoff: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random points in a box and the (sender, receiver) pairs closer than ``cutoff``."""
    pos = np.random.default_rng(seed).uniform(0, (n / 0.3) ** (1 / 3), (n, 3)).astype(np.float32)
    dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    send, recv = np.nonzero((dist < cutoff) & ~np.eye(n, dtype=bool))
    return pos, send.astype(np.int32), recv.astype(np.int32)


def e3nn(small: bool) -> Built:
    import e3nn_jax as e3
    import flax.linen as nn
    from e3nn_jax.experimental.point_convolution import (
        MessagePassingConvolutionFlax,
        radial_basis,
    )

    n, layers, mul = (16, 1, 8) if small else (128, 3, 32)
    cutoff = 2.0
    pos, send, recv = _graph(n, cutoff, 0)
    avg = len(send) / n

    class Net(nn.Module):
        @nn.compact
        def __call__(self, pos, species, send, recv):
            x = e3.IrrepsArray("4x0e", species)
            p = e3.IrrepsArray("1o", pos)
            for _ in range(layers):
                x = MessagePassingConvolutionFlax(
                    e3.Irreps(f"{2 * mul}x0e + {mul // 2}x1o + {mul // 4}x2e"),
                    lambda r: radial_basis(r, cutoff, 8),
                    avg_num_neighbors=avg,
                    sh_lmax=2,
                )(p, x, send, recv)
                x = e3.gate(x)
            return jnp.sum(x.filter(keep="0e").array, axis=-1)  # per-node energy

    species = jax.nn.one_hot(jnp.arange(n) % 4, 4)
    net = Net()
    params = jax.jit(net.init)(jax.random.key(0), pos, species, send, recv)
    target = jnp.asarray(np.random.default_rng(1).normal(size=n), F32)

    def loss(params, pos, species, send, recv, target):
        e = net.apply(params, pos, species, send, recv)
        return jnp.mean((e.astype(F32) - target) ** 2)

    desc = (
        f"e3nn-jax `MessagePassingConvolutionFlax` x{layers} with gates "
        f"(irreps {2 * mul}x0e+{mul // 2}x1o+{mul // 4}x2e, sh lmax 2): {n} atoms, "
        f"{len(send)} edges, per-atom energy fit"
    )
    return Built(desc, loss, params, (jnp.asarray(pos), species, send, recv, target))


def jax_md(small: bool) -> Built:
    from flax import nnx
    from jax_md import energy, space

    n, b, sizes = (16, 2, (16, 16)) if small else (64, 8, (64, 64))
    box = float((n / 0.3) ** (1 / 3))
    displacement, _ = space.periodic(box)
    energy_fn = energy.graph_network(
        displacement, 2.0, key=jax.random.key(0), n_recurrences=2, mlp_sizes=sizes
    )
    graphdef, params = nnx.split(energy_fn.model)
    rng = np.random.default_rng(0)
    positions = jnp.asarray(rng.uniform(0, box, (b, n, 3)), F32)
    target = jnp.asarray(rng.normal(size=b), F32)

    def loss(params, positions, target):
        model = nnx.merge(graphdef, params)
        e = jax.vmap(lambda r: model(r))(positions)
        return jnp.mean((e.astype(F32) - target) ** 2)

    desc = (
        f"jax-md `EnergyGraphNet` (`energy.graph_network`, dense graph, 2 recurrences, "
        f"MLPs {sizes}): {n} particles, batch {b} configurations, energy fit"
    )
    return Built(desc, loss, params, (positions, target))


MODELS: dict[str, Callable[[bool], Built]] = {
    "gemma": gemma,
    "penzai": penzai,
    "recurrentgemma": recurrentgemma,
    "keras_llama": keras_llama,
    "keras_vit": keras_vit,
    "e3nn": e3nn,
    "jax_md": jax_md,
}
#: the distributions whose versions the report names
PACKAGES = ("jax", "jaxlib", "flax", "gemma", "kauldron", "penzai", "recurrentgemma")
PACKAGES += ("keras", "keras-hub", "e3nn-jax", "jax-md")


# -- measuring -------------------------------------------------------------------------


def _variants(built: Built) -> dict[str, tuple[Callable[[], Callable[..., Any]], Any]]:
    """variant -> (a maker of a fresh loss function, its parameters)."""
    loss = built.loss
    hand = built.hand or (peers.hand(loss), built.params)
    return {
        "f32": (lambda: lambda *a: loss(*a), built.params),
        "amp": (lambda: amp_jax.amp(loss), built.params),
        "hand": (lambda: hand[0], hand[1]),
    }


def _compile(make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]) -> tuple[Any, dict]:
    """Lower + compile a fresh ``jit(value_and_grad(loss))``: (compiled, times)."""
    step = jax.jit(jax.value_and_grad(make()))
    c0, t0 = time.process_time(), time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, {
        "compile_s": time.perf_counter() - t0,
        "compile_cpu_s": time.process_time() - c0,
    }


def _structure(hlo: str) -> dict[str, Any]:
    bf16, dots = peers.count_dots(hlo)
    s = compile_time.hlo_structure(hlo)
    return {"dots": f"{bf16}/{dots}", "converts": s["converts"], "kernels": s["distinct_kernels"]}


def bench(built: Built, rounds: int, compile_reps: int) -> dict[str, dict[str, Any]]:
    """Compile (``compile_reps`` times, interleaved) and time each variant round-robin."""
    variants = _variants(built)
    res: dict[str, dict[str, Any]] = {v: {} for v in variants}
    compiled: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    ctimes: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(compile_reps):
        for v, (make, params) in list(variants.items()):
            args = (params, *built.batch)
            try:
                c, t = _compile(make, args)
            except Exception as e:  # a variant that cannot build is reported, not fatal
                res[v] = {"error": peers._error(e)}
                variants.pop(v)
                continue
            ctimes[v].append(t)
            if v not in compiled:
                compiled[v] = (c, args)
                res[v].update(_structure(c.as_text()))
    for v, ts in ctimes.items():
        if v in variants:
            res[v].update({k: statistics.median(t[k] for t in ts) for k in ts[0]})
    for _ in range(2):  # warm-up
        for c, args in compiled.values():
            jax.block_until_ready(c(*args))
    wall: dict[str, list[float]] = {v: [] for v in compiled}
    cpu: dict[str, list[float]] = {v: [] for v in compiled}
    for _ in range(rounds):
        for v, (c, args) in compiled.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(c(*args))
            wall[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
    for v in compiled:
        res[v]["step_s"] = statistics.median(wall[v])
        res[v]["step_cpu_s"] = statistics.median(cpu[v])
        res[v]["loss"] = float(compiled[v][0](*compiled[v][1])[0])
    return res


# -- reporting -------------------------------------------------------------------------


def _versions() -> str:
    import importlib.metadata as md

    out = []
    for n in PACKAGES:
        try:
            out.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            out.append(f"{n} not installed")
    return ", ".join(out)


def machine(load_start: str) -> list[str]:
    """peers.machine()'s lines (cpu, flags, amp's decision, load at the end), the
    model libraries' versions, the decision's override and the load at the start."""
    lines = [ln for ln in peers.machine() if not ln.startswith("- versions:")]
    env = os.environ.get("AMP_JAX_CPU_BF16", "unset")
    return lines + [
        f"- AMP_JAX_CPU_BF16={env}; load average at the start (1/5/15 min): {load_start}",
        f"- versions: {_versions()}",
    ]


def _ratio(r: dict, f32: dict, key: str) -> str:
    return f"{r[key] / f32[key]:.2f}" if key in r and key in f32 else "-"


def table(res: dict[str, dict[str, Any]]) -> list[str]:
    f32 = res.get("f32", {})
    lines = [
        "| variant | step ms | step vs f32 | step CPU vs f32 | compile s | compile vs f32 | "
        "compile CPU vs f32 | bf16 dots / all | converts | distinct kernels | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | {r['error']} |" + " |" * 9)
            continue
        lines.append(
            f"| {v} | {r['step_s'] * 1e3:.1f} | {_ratio(r, f32, 'step_s')} | "
            f"{_ratio(r, f32, 'step_cpu_s')} | {r['compile_s']:.2f} | "
            f"{_ratio(r, f32, 'compile_s')} | {_ratio(r, f32, 'compile_cpu_s')} | "
            f"{r['dots']} | {r['converts']} | {r['kernels']} | {r['loss']:.4f} |"
        )
    return lines


def targets(all_res: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """amp against float32 per model, judged by the targets of this CPU's plan."""
    pays = amp_jax.cpu_bf16_support().pays
    step_goal = "< 1.00" if pays else f"<= {STEP_TARGET_NO_BF16:.2f}"
    lines = [
        f"amp's plan here: bf16 dots {'on' if pays else 'off'}; targets: amp/f32 step "
        f"{step_goal}, compile <= {COMPILE_TARGET:.1f}",
        "",
        "| model | amp/f32 step | amp/f32 step CPU | amp/f32 compile | amp/f32 compile CPU "
        "| step | compile |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, res in all_res.items():
        a, f = res.get("amp", {}), res.get("f32", {})
        if "step_s" not in a or "step_s" not in f:
            lines.append(f"| {name} | - | - | - | - | - | - |")
            continue
        s, c = a["step_s"] / f["step_s"], a["compile_s"] / f["compile_s"]
        ok_s = s < 1.0 if pays else s <= STEP_TARGET_NO_BF16
        lines.append(
            f"| {name} | {s:.2f} | {_ratio(a, f, 'step_cpu_s')} | {c:.2f} | "
            f"{_ratio(a, f, 'compile_cpu_s')} | {'holds' if ok_s else 'misses'} | "
            f"{'holds' if c <= COMPILE_TARGET else 'misses'} |"
        )
    return lines


def _one(name: str, small: bool, rounds: int, reps: int) -> tuple[list[str], dict | None]:
    t0 = time.perf_counter()
    try:
        built = MODELS[name](small)
    except ImportError as e:
        return [f"### {name}", "", f"not installed: {peers._error(e)}", ""], None
    except Exception as e:
        return [f"### {name}", "", f"could not build: {peers._error(e)}", ""], None
    res = bench(built, rounds, reps)
    lines = [f"### {name}: {built.description}", ""] + table(res) + [""]
    print("\n".join(lines), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return lines, res


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written to ``--out`` if given)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=15, help="timed steps per variant")
    p.add_argument("--compile-reps", type=int, default=2, help="compiles per variant")
    p.add_argument("--out", default=None, help="also write the Markdown here")
    p.add_argument("--small", action="store_true", help="the smoke configs, timed as asked")
    p.add_argument("--smoke", action="store_true", help="tiny configs, 1 round (CI)")
    args = p.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.smoke:
        args.rounds, args.compile_reps, args.out = 1, 1, None
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    body: list[str] = []
    all_res: dict[str, dict] = {}
    for name in names:
        lines, res = _one(name, args.smoke or args.small, args.rounds, args.compile_reps)
        body += lines
        if res is not None:
            all_res[name] = res
    head = ["## Machine", "", *machine(load_start), "", "## amp against float32", ""]
    text = "\n".join(head + targets(all_res) + ["", "## Per model", ""] + body)
    return _report.emit(text + "\n", args.out)


if __name__ == "__main__":
    main()
