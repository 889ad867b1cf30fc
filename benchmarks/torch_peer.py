"""The GPT of ``models.gpt`` in PyTorch, for a side-by-side step time on a GPU.

Same architecture, sizes and initial scales as ``workloads/models.py::gpt``:
pre-LN decoder, fused qkv projection, causal attention, gelu MLP, tied
embedding, float32 parameters. The train step is forward + ``backward()``
under ``torch.autocast(dtype=torch.bfloat16)`` -- what a PyTorch user writes
for mixed precision -- with attention either hand-written (einsum, mask,
softmax, einsum: the same program ``amp`` sees) or
``F.scaled_dot_product_attention`` (flash attention), eagerly and under
``torch.compile`` (the loss compiled, the default mode).

Only imported by ``benchmarks/run.py`` when ``torch`` with CUDA is available.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F


def available() -> bool:
    return torch.cuda.is_available()


def _params(batch, seq, d, layers, heads, vocab, device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(device).requires_grad_()

    s = 1 / math.sqrt(d)
    blocks = []
    for _ in range(layers):
        blocks.append(
            {
                "ln1_s": torch.ones(d, device=device, requires_grad=True),
                "ln1_b": torch.zeros(d, device=device, requires_grad=True),
                "wqkv": normal(d, 3 * d, std=s),
                "wo": normal(d, d, std=s),
                "ln2_s": torch.ones(d, device=device, requires_grad=True),
                "ln2_b": torch.zeros(d, device=device, requires_grad=True),
                "w1": normal(d, 4 * d, std=s),
                "b1": torch.zeros(4 * d, device=device, requires_grad=True),
                "w2": normal(4 * d, d, std=s / 2),
                "b2": torch.zeros(d, device=device, requires_grad=True),
            }
        )
    return {
        "embed": normal(vocab, d, std=0.02),
        "pos": normal(seq, d, std=0.02),
        "blocks": blocks,
        "lnf_s": torch.ones(d, device=device, requires_grad=True),
        "lnf_b": torch.zeros(d, device=device, requires_grad=True),
    }


def _loss(p, tokens, targets, heads, sdpa, mask):
    b, s = tokens.shape
    d = p["embed"].shape[1]
    hd = d // heads
    x = p["embed"][tokens] + p["pos"]
    for w in p["blocks"]:
        h = F.layer_norm(x, (d,), w["ln1_s"], w["ln1_b"], 1e-5)
        q, k, v = (h @ w["wqkv"]).view(b, s, 3, heads, hd).unbind(2)
        if sdpa:
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        else:
            logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            logits = logits.masked_fill(~mask, -1e9)
            probs = torch.softmax(logits.float(), dim=-1).to(v.dtype)
            att = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        x = x + att.reshape(b, s, d) @ w["wo"]
        h = F.layer_norm(x, (d,), w["ln2_s"], w["ln2_b"], 1e-5)
        h = F.gelu(h @ w["w1"] + w["b1"], approximate="tanh")
        x = x + h @ w["w2"] + w["b2"]
    x = F.layer_norm(x, (d,), p["lnf_s"], p["lnf_b"], 1e-5)
    logits = x @ p["embed"].T
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def bench_gpt(
    *, batch, seq, d, layers, heads, vocab, rounds=10, warmup=3
) -> dict[str, dict[str, float]]:
    """Median fwd+bwd step ms of autocast-bf16 GPT with einsum attention and with SDPA."""
    dev = "cuda"
    p = _params(batch, seq, d, layers, heads, vocab, dev)
    leaves = [t for blk in p["blocks"] for t in blk.values()] + [
        p[k] for k in ("embed", "pos", "lnf_s", "lnf_b")
    ]
    g = torch.Generator(device="cpu").manual_seed(1)
    toks = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev)
    tokens, targets = toks[:, :-1], toks[:, 1:]
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=dev))
    out = {}
    compiled_loss = torch.compile(_loss)
    for name, sdpa, loss_fn in (
        ("torch_autocast", False, _loss),
        ("torch_autocast_sdpa", True, _loss),
        ("torch_compile_sdpa", True, compiled_loss),
    ):

        def step(loss_fn=loss_fn, sdpa=sdpa):
            for t in leaves:
                t.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(p, tokens, targets, heads, sdpa, mask)
            loss.backward()
            return loss

        try:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
        except Exception as e:  # torch.compile needs a working Triton; report, don't die
            print(f"# {name} failed: {type(e).__name__}: {e}"[:500], flush=True)
            continue
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        times = []
        loss = None
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        out[name] = {
            "step_s": statistics.median(times),
            "loss": float(loss.detach()),
            "peak_bytes": float(torch.cuda.max_memory_allocated()),
            "first_step_s": compile_s,
        }
    p.clear()  # drop the tensors before empty_cache
    leaves.clear()
    torch.cuda.empty_cache()
    return out
