"""Benchmark models in plain JAX, each parameterised by a compute dtype.

Every model has ``init(key) -> params`` (float32), ``batch(key) -> inputs`` and
``loss(params, *inputs, dtype=jnp.float32)``. With ``dtype=jnp.float32`` the
loss is the plain float32 model that :func:`amp_jax.amp` is applied to; with
``dtype=jnp.bfloat16`` it is the *hand-written* bf16 version, with the casts
placed the way Flax (``dtype=bfloat16, param_dtype=float32``) or jmp users
place them: parameters and inputs are cast to bf16 at the start, matmuls and
convolutions run on bf16 operands with bf16 results (JAX's default
``preferred_element_type``), layer-norm statistics, softmax and the loss are
computed in float32. ``acc`` (``preferred_element_type``) can be set to
``jnp.float32`` to get the "expert" hand version that accumulates in float32.

Shapes are module constants so that the benchmark and the structural tests
(``tests/repository/test_performance_structure.py``, which uses ``small=True`` sizes) agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(F32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def _dense(x: jax.Array, w: jax.Array, acc: Any) -> jax.Array:
    """``x @ w`` over the last axis of x (any rank), as Flax Dense does it."""
    return lax.dot_general(
        x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=acc
    ).astype(x.dtype)


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Statistics in float32 (as Flax LayerNorm does for bf16 inputs)."""
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + 1e-5)
    return (y * scale.astype(F32) + bias.astype(F32)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmark model: its name, initialiser, batch maker and loss."""

    name: str
    description: str
    init: Callable[[jax.Array], Any]
    batch: Callable[[jax.Array], tuple[Any, ...]]
    loss: Callable[..., jax.Array]


# -- MLP ------------------------------------------------------------------------


def mlp(small: bool = False, batch: int = 512, width: int = 1024, depth: int = 4) -> Model:
    """``depth`` dense layers of ``width`` (gelu between), softmax cross-entropy."""
    if small:
        batch, width, depth = 16, 64, 3

    def init(key):
        keys = jax.random.split(key, depth)
        return [
            (jax.random.normal(k, (width, width), F32) / math.sqrt(width), jnp.zeros((width,), F32))
            for k in keys
        ]

    def make_batch(key):
        kx, ky = jax.random.split(key)
        return (
            jax.random.normal(kx, (batch, width), F32),
            jax.random.randint(ky, (batch,), 0, width),
        )

    def loss(params, x, labels, dtype=F32, acc=None):
        params, h = _cast(params, dtype), x.astype(dtype)
        for i, (w, b) in enumerate(params):
            h = _dense(h, w, acc) + b
            if i < len(params) - 1:
                h = jax.nn.gelu(h)
        return _xent(h, labels)

    return Model(
        "mlp", f"MLP {depth}x{width}, batch {batch}, gelu, softmax xent", init, make_batch, loss
    )


# -- GPT-style decoder ----------------------------------------------------------------


def gpt(
    small: bool = False,
    batch: int = 2,
    seq: int = 256,
    d: int = 512,
    layers: int = 4,
    heads: int = 8,
    vocab: int = 1024,
    unrolled: bool = False,
) -> Model:
    """Pre-LN decoder: causal attention + gelu MLP per layer, ``lax.scan`` over layers.

    ``unrolled``: the blocks are a list of parameter dicts and a Python loop
    runs them, so every block has its own equations (a program that grows with
    the depth: benchmarks/trace_cost.py).
    """
    if small:
        batch, seq, d, layers, heads, vocab = 2, 16, 32, 2, 4, 64
    init = functools.partial(
        _gpt_params, layers=layers, d=d, seq=seq, vocab=vocab, unrolled=unrolled
    )

    def make_batch(key):
        toks = jax.random.randint(key, (batch, seq + 1), 0, vocab)
        return toks[:, :-1], toks[:, 1:]

    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def loss(params, tokens, targets, dtype=F32, acc=None, attention=None):
        """``attention``: None writes it out (einsum, mask, softmax, einsum);
        "cudnn"/"xla" calls ``jax.nn.dot_product_attention`` with that implementation."""
        p = _cast(params, dtype)
        x = p["embed"][tokens] + p["pos"]
        block = functools.partial(
            _decoder_block, heads=heads, mask=mask, dtype=dtype, acc=acc, attention=attention
        )
        if unrolled:
            for w in p["blocks"]:
                x, _ = block(x, w)
        else:
            x, _ = lax.scan(block, x, p["blocks"])
        x = _layer_norm(x, p["lnf_s"], p["lnf_b"])
        logits = _dense(x, p["embed"].T, acc)
        return _xent(logits, targets)

    return Model(
        "gpt",
        f"GPT decoder, pre-LN, {layers} layers ({'unrolled' if unrolled else 'lax.scan'}), "
        f"d={d}, {heads} heads, "
        f"seq {seq}, batch {batch}, vocab {vocab}, tied embedding",
        init,
        make_batch,
        loss,
    )


def _gpt_params(key, *, layers: int, d: int, seq: int, vocab: int, unrolled: bool) -> dict:
    """The decoder's float32 parameters: blocks stacked along a layer axis, or a list."""
    k = jax.random.split(key, 6)
    s = 1 / math.sqrt(d)
    blocks = {
        "ln1_s": jnp.ones((layers, d), F32),
        "ln1_b": jnp.zeros((layers, d), F32),
        "wqkv": jax.random.normal(k[0], (layers, d, 3 * d), F32) * s,
        "wo": jax.random.normal(k[1], (layers, d, d), F32) * s,
        "ln2_s": jnp.ones((layers, d), F32),
        "ln2_b": jnp.zeros((layers, d), F32),
        "w1": jax.random.normal(k[2], (layers, d, 4 * d), F32) * s,
        "b1": jnp.zeros((layers, 4 * d), F32),
        "w2": jax.random.normal(k[3], (layers, 4 * d, d), F32) * (s / 2),
        "b2": jnp.zeros((layers, d), F32),
    }
    if unrolled:
        blocks = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(layers)]
    return {
        "embed": jax.random.normal(k[4], (vocab, d), F32) * 0.02,
        "pos": jax.random.normal(k[5], (seq, d), F32) * 0.02,
        "blocks": blocks,
        "lnf_s": jnp.ones((d,), F32),
        "lnf_b": jnp.zeros((d,), F32),
    }


def _decoder_block(x, w, *, heads, mask, dtype, acc, attention):
    """One pre-LN block (causal attention, then the gelu MLP): ``(x, None)``, a scan body."""
    batch, seq, d = x.shape
    hd = d // heads
    h = _layer_norm(x, w["ln1_s"], w["ln1_b"])
    qkv = _dense(h, w["wqkv"], acc).reshape(batch, seq, 3, heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if attention is None:
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(hd)
        logits = jnp.where(mask, logits, -1e9)
        probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
        att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, d)
    else:
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
        att = att.reshape(batch, seq, d)
    x = x + _dense(att, w["wo"], acc)
    h = _layer_norm(x, w["ln2_s"], w["ln2_b"])
    h = jax.nn.gelu(_dense(h, w["w1"], acc) + w["b1"])
    x = x + _dense(h, w["w2"], acc) + w["b2"]
    return x, None


# -- ResNet-style CNN -------------------------------------------------------------------


def _conv(x, w, stride, acc):
    return lax.conv_general_dilated(
        x,
        w,
        (stride, stride),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=acc,
    ).astype(x.dtype)


def _norm(x, scale, bias):
    """Per-sample channel-wise normalisation (group norm with one group), float32 stats."""
    xf = x.astype(F32)
    mean = jnp.mean(xf, axis=(1, 2, 3), keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=(1, 2, 3), keepdims=True)
    return ((xf - mean) * lax.rsqrt(var + 1e-5) * scale.astype(F32) + bias.astype(F32)).astype(
        x.dtype
    )


def conv_w(key, k, cin, cout):
    """He-initialised HWIO kernel."""
    return jax.random.normal(key, (k, k, cin, cout), F32) * math.sqrt(2.0 / (k * k * cin))


def _image_batch(key, *, batch, size, classes):
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (batch, size, size, 3), F32),
        jax.random.randint(ky, (batch,), 0, classes),
    )


def _residual_params(key, *, n_keys, stem, stages, classes, block) -> dict:
    """A residual CNN's parameters: a stem conv, stages of blocks, a dense head.

    ``stem`` is the stem's (kernel size, channels); ``stages`` holds per stage
    ``(number of blocks, *widths)``, the last width a block's output channels;
    ``block(keys, cin, *widths)`` makes one block's convolutions. A block that
    changes the channels or strides (the first of a later stage) gets a 1x1
    projection of its shortcut.
    """
    keys = iter(jax.random.split(key, n_keys))
    k, cin = stem
    params = {"stem": conv_w(next(keys), k, 3, cin), "stages": []}
    for s, (n, *widths) in enumerate(stages):
        stage = []
        for b in range(n):
            blk, cout = block(keys, cin, *widths), widths[-1]
            if cin != cout or (s > 0 and b == 0):
                blk["proj"] = conv_w(next(keys), 1, cin, cout)
            stage.append(blk)
            cin = cout
        params["stages"].append(stage)
    params["head"] = jax.random.normal(next(keys), (cin, classes), F32) / math.sqrt(cin)
    return params


def _basic_block_params(keys, cin: int, cout: int) -> dict:
    """Two 3x3 convolutions, each followed by a normalisation."""
    return {
        "w1": conv_w(next(keys), 3, cin, cout),
        "n1": (jnp.ones(cout), jnp.zeros(cout)),
        "w2": conv_w(next(keys), 3, cout, cout),
        "n2": (jnp.ones(cout), jnp.zeros(cout)),
    }


def _bottleneck_params(keys, cin: int, mid: int, cout: int) -> dict:
    """1x1 down to ``mid``, 3x3, 1x1 up to ``cout``, each followed by a normalisation."""
    return {
        "w1": conv_w(next(keys), 1, cin, mid),
        "n1": (jnp.ones(mid), jnp.zeros(mid)),
        "w2": conv_w(next(keys), 3, mid, mid),
        "n2": (jnp.ones(mid), jnp.zeros(mid)),
        "w3": conv_w(next(keys), 1, mid, cout),
        "n3": (jnp.ones(cout), jnp.zeros(cout)),
    }


def cnn(
    small: bool = False,
    batch: int = 16,
    size: int = 32,
    widths: tuple[int, ...] = (64, 128, 256),
    blocks_per_stage: int = 1,
    classes: int = 10,
) -> Model:
    """ResNet-style NHWC CNN: 3x3 stem, basic residual blocks, global pooling, dense head."""
    if small:
        batch, size, widths = 2, 8, (8, 16)

    init = functools.partial(
        _residual_params,
        n_keys=64,
        stem=(3, widths[0]),
        stages=[(blocks_per_stage, cout) for cout in widths],
        classes=classes,
        block=_basic_block_params,
    )

    make_batch = functools.partial(_image_batch, batch=batch, size=size, classes=classes)

    def loss(params, images, labels, dtype=F32, acc=None):
        p, x = _cast(params, dtype), images.astype(dtype)
        x = jax.nn.relu(_conv(x, p["stem"], 1, acc))
        for s, stage in enumerate(p["stages"]):
            for b, blk in enumerate(stage):
                stride = 2 if (s > 0 and b == 0) else 1
                h = jax.nn.relu(_norm(_conv(x, blk["w1"], stride, acc), *blk["n1"]))
                h = _norm(_conv(h, blk["w2"], 1, acc), *blk["n2"])
                sc = _conv(x, blk["proj"], stride, acc) if "proj" in blk else x
                x = jax.nn.relu(h + sc)
        pooled = jnp.mean(x.astype(F32), axis=(1, 2)).astype(dtype)
        return _xent(_dense(pooled, p["head"], acc), labels)

    return Model(
        "cnn",
        f"ResNet-style CNN NHWC, {batch}x{size}x{size}x3, widths {widths}, "
        f"{blocks_per_stage} basic block(s)/stage, group-norm",
        init,
        make_batch,
        loss,
    )


# -- ResNet-50-sized model (compile time only) ------------------------------------------------


def resnet50(batch: int = 1, size: int = 64, classes: int = 1000) -> Model:
    """ResNet-50 topology: 7x7 stem + bottleneck blocks [3, 4, 6, 3] (53 convs), for compile time."""
    stages = [(3, 64, 256), (4, 128, 512), (6, 256, 1024), (3, 512, 2048)]

    init = functools.partial(
        _residual_params,
        n_keys=128,
        stem=(7, 64),
        stages=stages,
        classes=classes,
        block=_bottleneck_params,
    )

    make_batch = functools.partial(_image_batch, batch=batch, size=size, classes=classes)

    def loss(params, images, labels, dtype=F32, acc=None):
        p, x = _cast(params, dtype), images.astype(dtype)
        x = jax.nn.relu(_conv(x, p["stem"], 2, acc))
        for s, stage in enumerate(p["stages"]):
            for b, blk in enumerate(stage):
                stride = 2 if (s > 0 and b == 0) else 1
                h = jax.nn.relu(_norm(_conv(x, blk["w1"], 1, acc), *blk["n1"]))
                h = jax.nn.relu(_norm(_conv(h, blk["w2"], stride, acc), *blk["n2"]))
                h = _norm(_conv(h, blk["w3"], 1, acc), *blk["n3"])
                sc = _conv(x, blk["proj"], stride, acc) if "proj" in blk else x
                x = jax.nn.relu(h + sc)
        pooled = jnp.mean(x.astype(F32), axis=(1, 2)).astype(dtype)
        return _xent(_dense(pooled, p["head"], acc), labels)

    return Model(
        "resnet50",
        f"ResNet-50 topology (bottlenecks [3,4,6,3], 53 convs), {batch}x{size}x{size}x3",
        init,
        make_batch,
        loss,
    )


def gpt_fp8(small: bool = False, **sizes: Any) -> Model:
    """The GPT decoder at a width where float8 matmuls pay (d_model >= 2048 on an H100).

    The same model as :func:`gpt`; its default (CPU) sizes are a smoke-test
    size, :data:`GPU_SIZES` has the H100 size (d=2048, 8 layers).
    """
    sizes = {**dict(batch=2, seq=128, d=256, layers=2, heads=4, vocab=1024), **sizes}
    m = gpt(small=small, **sizes)
    return dataclasses.replace(m, name="gpt_fp8")


MODELS: dict[str, Callable[..., Model]] = {"mlp": mlp, "gpt": gpt, "cnn": cnn, "gpt_fp8": gpt_fp8}

#: GPU-scale sizes (``python -m benchmarks.run --scale gpu``, the default on a GPU).
GPU_SIZES: dict[str, dict[str, Any]] = {
    "mlp": dict(batch=8192, width=4096, depth=7),
    "gpt": dict(batch=8, seq=1024, d=1024, layers=12, heads=16, vocab=8192),
    "cnn": dict(batch=64, size=56, widths=(256,), blocks_per_stage=6),
    # issue 17: amp fp8 vs amp bf16, side by side
    "gpt_fp8": dict(batch=8, seq=1024, d=2048, layers=8, heads=16, vocab=8192),
}


# -- residual block stack, in eager.scan_step's form -----------------------------------


def stack_embed(p, x):
    """The stack's embedding: ``x @ w``."""
    return x @ p["w"]


def stack_block(p, h):
    """One residual block: ``h + tanh(h @ w1 + b1) @ w2``."""
    return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def stack_head(p, h, x):
    """The head and its loss: mean squared error of ``h @ w`` against the input."""
    return jnp.mean((h @ p["w"] - x) ** 2)


def stack_params(key, width: int, layers: int, dtype: Any = F32) -> dict:
    """``{"embed", "blocks", "head"}`` parameters of the stack (normal / 3, zero
    biases), the blocks' stacked along a leading layer axis."""
    k = jax.random.split(key, 4)
    n = lambda key, *s: (jax.random.normal(key, s) / 3).astype(dtype)  # noqa: E731
    return {
        "embed": {"w": n(k[0], width, width)},
        "blocks": {
            "w1": n(k[1], layers, width, width),
            "b1": jnp.zeros((layers, width), dtype),
            "w2": n(k[2], layers, width, width),
        },
        "head": {"w": n(k[3], width, width)},
    }
