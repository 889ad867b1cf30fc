"""Where a train step spends its device time: amp beside hand-written bf16, kernel by kernel.

    python -m benchmarks.gpu_profile [--model gpt] [--variants amp,hand_cudnn,amp_bf16_stream]
                                     [--steps 3] [--out PROFILE_GPU.md] [--trace-dir DIR]
    python -m benchmarks.gpu_profile --smoke    # tiny GPT, amp and hand, on any backend

Each variant's compiled train step (the same programs as ``benchmarks.run``)
runs ``--steps`` times under ``jax.profiler`` with a Perfetto trace. The
kernels the device ran are summed per step, by kind (matmul, attention,
convert, reduction, copy, other fusion) and by name, and written as Markdown:
the kinds side by side, with each variant's difference from the first, and
each variant's heaviest kernels. On a CPU (where there is no device track) the
XLA:CPU thread's events stand in, which is only useful for checking the script.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterable

import jax

from benchmarks import _report
from benchmarks import run as R
from workloads import models as M

#: substrings of a kernel's name (lower case), first match wins
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("fmha", "sdpa", "flash", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cublas", "xmma", "cutlass", "matmul", "dot")),
    ("convert", ("convert",)),
    ("reduction", ("reduce", "reduction")),
    ("copy", ("memcpy", "memset", "copy", "transpose", "dynamic_update_slice", "dynamic-update")),
    ("other fusion", ("fusion",)),
)


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(key in low for key in keys):
            return k
    return "other"


def device_events(trace: dict) -> list[dict]:
    """The complete ('X') events of the device's streams (threads named ``Stream...``
    of the processes named ``/device:...``; all of a device's tracks where it has no
    stream track); without a device, those of the host's XLA threads (``tf_XLA...``)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    dev = [e for e in complete if procs.get(e["pid"], "").startswith("/device:")]
    streams = [e for e in dev if "stream" in threads.get((e["pid"], e.get("tid")), "").lower()]
    if dev:
        return streams or dev
    return [e for e in complete if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")]


def summarize(events: Iterable[dict], steps: int) -> dict:
    """Per step: milliseconds by kind and by kernel name, and each name's calls."""
    by_kind: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for e in events:
        ms = e["dur"] / 1e3 / steps  # trace times are microseconds
        by_kind[kind(e["name"])] += ms
        by_name[e["name"]] += ms
        calls[e["name"]] += 1
    return {
        "by_kind": dict(by_kind),
        "by_name": dict(by_name),
        "calls": {k: v / steps for k, v in calls.items()},
        "total_ms": sum(by_kind.values()),
    }


def tracks(trace: dict) -> list[str]:
    """'process / thread' of every track that has complete events (what the trace held)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"][
                "name"
            ]
    used = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "X"}
    return sorted(f"{names.get((p, None), p)} / {names.get((p, t), t)}" for p, t in used)


def _perfetto(log_dir: str, keep: str | None) -> dict:
    found = sorted(pathlib.Path(log_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    if keep:
        shutil.copyfile(found[-1], keep)
    with gzip.open(found[-1]) as fh:
        return json.load(fh)


def profile(compiled, args, steps: int, keep: str | None = None) -> tuple[dict, float]:
    """(summary of the device kernels per step, wall seconds per step); ``keep``: a
    path to copy the Perfetto trace to."""
    for _ in range(2):  # warm up outside the trace
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
            wall = (time.perf_counter() - t0) / steps
        trace = _perfetto(log_dir, keep)
    summary = summarize(device_events(trace), steps)
    summary["tracks"] = tracks(trace)
    return summary, wall


def table(results: dict[str, tuple[dict, float]], top: int) -> list[str]:
    names = list(results)
    first = names[0]
    kinds = [k for k, _ in KINDS] + ["other"]
    lines = [
        "| kind | "
        + " | ".join(f"{n} ms/step" for n in names)
        + " | "
        + " | ".join(f"{n} - {first}" for n in names[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(names) - 1),
    ]
    for k in [*kinds, "total (device)"]:
        vals = [
            r["total_ms"] if k == "total (device)" else r["by_kind"].get(k, 0.0)
            for r, _ in results.values()
        ]
        lines.append(
            f"| {k} | "
            + " | ".join(f"{v:.2f}" for v in vals)
            + " | "
            + " | ".join(f"{v - vals[0]:+.2f}" for v in vals[1:])
            + " |"
        )
    walls = [w * 1e3 for _, w in results.values()]
    lines.append(
        "| wall (host, traced) | "
        + " | ".join(f"{w:.2f}" for w in walls)
        + " | "
        + " | ".join(f"{w - walls[0]:+.2f}" for w in walls[1:])
        + " |"
    )
    for name, (r, _) in results.items():
        lines += [
            "",
            f"**{name}**: the {top} heaviest kernels",
            "",
            "| kernel | kind | calls/step | ms/step |",
            "|---|---|---:|---:|",
        ]
        heavy = sorted(r["by_name"].items(), key=lambda kv: -kv[1])[:top]
        for kname, ms in heavy:
            short = kname if len(kname) <= 90 else kname[:87] + "..."
            lines.append(f"| `{short}` | {kind(kname)} | {r['calls'][kname]:g} | {ms:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(M.MODELS))
    p.add_argument("--variants", default="amp,hand_cudnn,amp_bf16_stream")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, amp and hand, 2 steps (a check)"
    )
    p.add_argument("--out", default=None, help="write the Markdown here too")
    p.add_argument("--trace-dir", default=None, help="keep each variant's Perfetto trace here")
    args = p.parse_args(argv)
    if args.smoke:
        args.variants, args.steps = "amp,hand", 2
    gpu = jax.default_backend() == "gpu"
    sizes = {"small": True} if args.smoke else M.GPU_SIZES[args.model] if gpu else {}
    model = M.MODELS[args.model](**sizes)
    params = model.init(jax.random.PRNGKey(0))
    step_args = (params, *model.batch(jax.random.PRNGKey(1)))
    results = {}
    for name, loss in R.variants(model, tuple(args.variants.split(","))).items():
        compiled, _, _ = R.compile_step(R.train_step(loss), step_args)
        keep = None
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            keep = os.path.join(args.trace_dir, f"{args.model}_{name}.perfetto.json.gz")
        results[name] = profile(compiled, step_args, args.steps, keep)
        print(f"# {name}: {results[name][0]['total_ms']:.2f} ms/step on the device", flush=True)
    device = jax.devices()[0]
    lines = [
        f"# Device time per train step: {model.description}",
        "",
        f"`python -m benchmarks.gpu_profile` ({args.steps} traced steps after 2 untraced), "
        f"{device.platform} {device.device_kind}, JAX {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC.",
        "",
        *table(results, args.top),
        "",
        "Tracks in the trace (process / thread): "
        + "; ".join(results[next(iter(results))][0]["tracks"]),
    ]
    text = "\n".join(lines) + "\n"
    _report.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
