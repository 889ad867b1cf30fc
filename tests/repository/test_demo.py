"""``python -m amp_jax.demo`` end to end with tiny sizes, and its flag errors."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    "--steps",
    "4",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq",
    "32",
    "--batch",
    "4",
    "--val-batches",
    "1",
    "--no-progress",
]


def _run(*args, timeout=600):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)  # conftest's 8 forced host devices are not needed here
    return subprocess.run(
        [sys.executable, "-m", "amp_jax.demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_tiny_run(tmp_path):
    out = tmp_path / "demo"
    proc = _run(*TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out.resolve())
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert list(results["modes"]) == ["f32", "amp-bf16", "amp-f16", "bf16-kahan"]
    for name, r in results["modes"].items():
        assert name in proc.stdout  # the summary table
        for key in (
            "tokens_per_s",
            "median_step_ms",
            "compile_s",
            "final_train_loss",
            "final_val_loss",
        ):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["opt_state_bytes"] > 0 and r["param_bytes"] > 0
        assert r["step_memory_bytes"] is None or r["step_memory_bytes"] > 0
        assert len(r["train_loss"]) == 4 and all(math.isfinite(v) for v in r["train_loss"])
        assert r["val_steps"] and all(math.isfinite(v) for v in r["val_loss"])
    modes = results["modes"]
    # bf16 parameters and bf16 moments + bf16 Kahan buffer: 6 bytes/param of state vs 8
    # (the step counters are a few bytes on top of the 3/4 ratio)
    assert (
        abs(modes["bf16-kahan"]["opt_state_bytes"] / modes["f32"]["opt_state_bytes"] - 0.75) < 1e-3
    )
    assert modes["bf16-kahan"]["param_bytes"] * 2 == modes["f32"]["param_bytes"]
    # The amp modes really ran in low precision (same data and init: a no-op
    # amp would reproduce float32's losses exactly), and stay close to it.
    for name in ("amp-bf16", "amp-f16"):
        assert modes[name]["train_loss"] != modes["f32"]["train_loss"], name
        assert abs(modes[name]["final_train_loss"] - modes["f32"]["final_train_loss"]) < 0.1, name
    assert (
        0 < modes["amp-f16"]["final_loss_scale"] <= 2.0**15
    )  # starts at 2**15, shrinks on overflow


def test_demo_unknown_mode_exits_nonzero():
    proc = _run("--modes", "f32,fp8", timeout=120)
    assert proc.returncode == 2
    assert "unknown mode(s) 'fp8'" in proc.stderr
    assert "valid modes: f32, amp-bf16, amp-f16, bf16-kahan" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", ","], "valid modes:"),
        (["--modes", "f32,f32"], "lists a mode twice"),
        (["--steps", "0"], "--steps must be a positive integer"),
        (["--d-model", "abc"], "--d-model must be a positive integer"),
        (["--d-model", "30", "--heads", "4"], "must be a multiple of --heads"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_demo_bad_flags(args, message, capsys):
    from amp_jax.demo.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err, err


def _stream_adds(mode_name: str) -> list[str]:
    """The dtypes of the demo model's adds of [batch, seq, d_model] (the residual
    stream's) in the rewritten jaxpr of ``mode_name``'s loss."""
    import jax
    import jax.numpy as jnp
    from jax.extend import core as jex_core

    from amp_jax.demo import _model, _modes

    cfg = _model.Config(d_model=32, layers=2, heads=2, seq=16, batch=2)
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    loss = _modes.mode_loss(_modes.MODES[mode_name], cfg)
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "add" and e.outvars[0].aval.shape == (2, 16, 32):
                found.append(str(e.outvars[0].aval.dtype))
            for sub in jex_core.jaxprs_in_params(e.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(loss)(params, tokens, tokens).jaxpr)
    return found


def test_demo_bf16_stream_mode_carries_the_residual_stream_in_bf16():
    # amp keeps a float32 model's residual stream float32; the opt-in mode casts
    # the parameters where the loss starts (Flax's dtype=bfloat16), so it is bf16
    assert set(_stream_adds("amp-bf16")) == {"float32"}
    assert set(_stream_adds("amp-bf16-stream")) == {"bfloat16"}


def test_demo_concludes_only_what_its_step_times_support():
    from amp_jax.demo.__main__ import conclusions

    steady = lambda ms: [1.0] + [ms / 1e3 * (1 + 0.01 * (i % 3)) for i in range(20)]  # noqa: E731
    # float16 faster than bfloat16 in its own table: never "amp-f16 was slower"
    said = conclusions({"f32": steady(600), "amp-bf16": steady(330), "amp-f16": steady(300)}, "cpu")
    assert not any("slower" in line for line in said), said
    assert "amp-f16 was faster than amp-bf16 here." in said
    assert any(line.startswith("amp-bf16's step was 1.8") for line in said), said
    # slower: said, with the CPU's reason
    said = conclusions({"amp-bf16": steady(300), "amp-f16": steady(400)}, "cpu")
    assert any(line.startswith("amp-f16 was slower than amp-bf16 here") for line in said)
    # within the spread (328.4 vs 329.4 ms): no order claimed
    said = conclusions({"amp-bf16": steady(329.4), "amp-f16": steady(328.4)}, "cpu")
    assert said == ["amp-f16 and amp-bf16: the same step time within the spread of the times."]
    # a busy machine: times that swing say so, and rank nothing
    swing = [1.0] + [0.3, 0.6, 0.35, 0.9, 0.32, 0.7, 0.4, 0.8] * 3
    said = conclusions({"amp-bf16": swing, "amp-f16": steady(300)}, "cpu")
    assert len(said) == 1 and "too busy to tell" in said[0], said


def test_demo_conclusions_say_why_from_the_cpus_bf16_support():
    from amp_jax import CpuBf16Support
    from amp_jax.demo.__main__ import conclusions, cpu_line

    steady = lambda ms: [1.0] + [ms / 1e3 * (1 + 0.01 * (i % 3)) for i in range(20)]  # noqa: E731
    times = {"f32": steady(600), "amp-bf16": steady(600), "amp-f16": steady(800)}
    no = CpuBf16Support(False, "flags", "cpu flags: no avx512_bf16 or amx_bf16", ("avx2",))
    yes = CpuBf16Support(True, "flags", "cpu flags: avx512_bf16", ("avx512_bf16",))
    said = conclusions(times, "cpu", no)
    assert said[0] == (
        "amp-bf16 and f32: the same step time within the spread of the times (this CPU has "
        "no bfloat16 dot instructions, so amp kept the matmuls in float32)."
    ), said
    # every "slower" comes with its reason
    slower = [line for line in said if "slower" in line]
    assert slower and all(
        "float16 matmul" in line or "float16 matmul operands" in line for line in slower
    ), said
    assert "amp-bf16 ran float32's matmuls" in said[-1], said
    said = conclusions({"f32": steady(600), "amp-bf16": steady(330)}, "cpu", yes)
    assert said == [
        "amp-bf16's step was 1.82x f32's speed (faster: this CPU runs bfloat16 matmuls with its "
        "bfloat16 dot instructions)."
    ], said
    # the printed decision names the evidence and what amp did
    assert cpu_line(no).startswith("CPU bfloat16 dots: no (cpu flags: no avx512_bf16 or amx_bf16)")
    assert "keeps the matmuls in float32" in cpu_line(no)
    assert "AMP_JAX_CPU_BF16" in cpu_line(no)
    assert cpu_line(yes).startswith("CPU bfloat16 dots: yes (cpu flags: avx512_bf16)")


def test_demo_prints_the_cpus_bf16_decision(capsys, monkeypatch, tmp_path):
    import amp_jax
    from amp_jax.demo import __main__ as demo

    monkeypatch.setattr(demo, "_train_mode", lambda *a: pytest.skip("not reached"))
    amp_jax.cpu_bf16_support.cache_clear()
    monkeypatch.setenv("AMP_JAX_CPU_BF16", "no")
    try:
        with pytest.raises(pytest.skip.Exception):
            demo.main([*TINY, "--out", str(tmp_path)])
    finally:
        amp_jax.cpu_bf16_support.cache_clear()
    out = capsys.readouterr().out
    assert "CPU bfloat16 dots: no (AMP_JAX_CPU_BF16=no): amp keeps the matmuls in float32" in out


def test_demo_smoothed_loss_is_bias_corrected():
    from amp_jax.demo.__main__ import smoothed

    # a loss that falls at once: by step 10 the curve reads near the loss, not near
    # the first value (an EMA started at the first value read 4.49 here)
    curve = smoothed([10.0] + [1.0] * 9)
    assert curve[0] == 10.0
    assert abs(curve[-1] - (1 + 9 * 0.1 * 0.9**9 / (1 - 0.9**10))) < 1e-9
    assert curve[-1] < 1.6
    assert smoothed([3.0] * 50) == pytest.approx([3.0] * 50)


def test_demo_validation_panel_has_its_own_range():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from amp_jax.demo.__main__ import figure
    from amp_jax.demo._modes import RunResult

    def run(name, shift):
        train = [5.5 * 0.97**i + shift for i in range(40)]
        val = [3.1 + shift, 2.9 + shift, 2.8 + shift]
        return RunResult(name, "", list(range(1, 41)), train, [10, 20, 40], val, [0.1] * 40,
                         1.0, None, 1, 1, 1, {})  # fmt: skip

    fig = figure([run("f32", 0.0), run("amp-bf16", 0.01)], "t")
    try:
        ax_t, ax_v = fig.axes[:2]
        lo, hi = ax_v.get_ylim()
        assert 2.7 < lo < 2.8 and 3.11 < hi < 3.2, (lo, hi)
        assert ax_t.get_ylim()[1] > 5, ax_t.get_ylim()
    finally:
        plt.close(fig)
