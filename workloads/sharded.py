"""A small pre-LN transformer block in plain JAX, its sharding layouts, and an
HLO collective counter: shared by benchmarks/collectives.py (the table on
docs/scaling.md), tests/behaviour/test_sharding.py and the multi-process worker
(tests/behaviour/_multiprocess_worker.py)."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D, H, F, S = 64, 4, 128, 16  # model width, heads, MLP width, sequence length
K = D // H

# name -> mesh shape and axis names
MESHES = {"dp": ((8,), ("data",)), "fsdp": ((8,), ("data",)), "tp": ((2, 4), ("data", "model"))}

# name -> parameter PartitionSpecs
SPECS = {
    # data parallel: every parameter replicated
    "dp": {n: P() for n in ("ln1", "ln2", "wq", "wk", "wv", "wo", "w1", "w2")},
    # FSDP: every parameter split over the data axis (gathered for use)
    "fsdp": {
        "ln1": P("data"),
        "ln2": P("data"),
        "wq": P("data"),
        "wk": P("data"),
        "wv": P("data"),
        "wo": P(None, None, "data"),
        "w1": P("data"),
        "w2": P("data"),
    },
    # Megatron tensor parallel: column-parallel QKV / w1 (heads, hidden
    # units over "model"), row-parallel wo / w2; batch over "data"
    "tp": {
        "ln1": P(),
        "ln2": P(),
        "wq": P(None, "model"),
        "wk": P(None, "model"),
        "wv": P(None, "model"),
        "wo": P("model"),
        "w1": P(None, "model"),
        "w2": P("model"),
    },
}


def init(key, dtype=jnp.float32):
    ks = jax.random.split(key, 6)
    n = lambda k, s: (jax.random.normal(k, s) * 0.1).astype(dtype)
    return {
        "ln1": jnp.ones(D, dtype),
        "ln2": jnp.ones(D, dtype),
        "wq": n(ks[0], (D, H, K)),
        "wk": n(ks[1], (D, H, K)),
        "wv": n(ks[2], (D, H, K)),
        "wo": n(ks[3], (H, K, D)),
        "w1": n(ks[4], (D, F)),
        "w2": n(ks[5], (F, D)),
    }


def _ln(x, g):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def block(p, x, layout="dp", explicit=False):
    """Pre-LN attention + MLP block. In explicit mode the program says what
    plain JAX needs said: FSDP gathers each parameter before use
    (``jax.sharding.reshard`` to replicated), Megatron's row-parallel dots name
    their output sharding (their contracting dim is sharded)."""
    out = P("data") if explicit and layout == "tp" else None
    if explicit and layout == "fsdp":
        p = {k: jax.sharding.reshard(v, P()) for k, v in p.items()}
    h = _ln(x, p["ln1"])
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", h, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
    a = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / K**0.5, -1)
    o = jnp.einsum("bhqs,bshk->bqhk", a, v)
    x = x + jnp.einsum("bshk,hkd->bsd", o, p["wo"], out_sharding=out)
    h = _ln(x, p["ln2"])
    m = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, p["w1"]))
    return x + jnp.einsum("bsf,fd->bsd", m, p["w2"], out_sharding=out)


def loss(p, batch, layout="dp", explicit=False):
    x, y = batch
    out = block(p, x, layout, explicit)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def mesh(layout, axis_type=None, devices=None):
    shape, names = MESHES[layout]
    types = None if axis_type is None else (axis_type,) * len(names)
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def place(params, layout, m):
    return {k: jax.device_put(v, NamedSharding(m, SPECS[layout][k])) for k, v in params.items()}


def batch(key, n, m):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (n, S, D))
    y = jax.random.normal(ky, (n, S, D))
    s = NamedSharding(m, P("data"))
    return jax.device_put(x, s), jax.device_put(y, s)


_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|reduce-scatter|"
    r"collective-permute|all-to-all)(?:-start)?\("
)
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def collectives(hlo_text):
    """{(kind, dtype): [count, bytes]} of the collectives in compiled HLO text
    (bytes: the size of each collective's result)."""
    out = collections.defaultdict(lambda: [0, 0])
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        types, kind = m.groups()
        shapes = _SHAPE.findall(types)
        for dt, dims in shapes:
            n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            item = np.dtype(
                jnp.bfloat16
                if dt == "bf16"
                else {"f16": "float16", "f32": "float32", "f64": "float64", "pred": "bool"}.get(
                    dt, dt
                )
            ).itemsize
            out[(kind, dt)][1] += n * item
        # count the op once, under the dtype of its first result
        out[(kind, shapes[0][0] if shapes else "?")][0] += 1
    return dict(out)


def totals(colls):
    """{kind: [count, bytes]} summed over dtypes."""
    out = collections.defaultdict(lambda: [0, 0])
    for (kind, _), (c, b) in colls.items():
        out[kind][0] += c
        out[kind][1] += b
    return dict(out)
