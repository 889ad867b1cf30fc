"""Every maintained benchmark runs at its ``--smoke`` size and prints its tables.

Not timings: each benchmark's ``main(argv)`` runs in this process at a tiny
size (no results file written) and its Markdown report must hold the table
it exists for, with the expected columns and a row per model and variant.
Marked ``heavy``: only the newest-JAX leg runs them (noxfile.py). The one-off
studies (benchmarks/studies/) only have to import.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = jax.default_backend() == "cpu"


def tables(text: str) -> list[list[list[str]]]:
    """The Markdown tables of ``text``: rows of cells, header first, rule dropped."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-:") for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def table_with(text: str, *columns: str) -> list[list[str]]:
    """The first table whose header starts with ``columns``."""
    for t in tables(text):
        if tuple(t[0][: len(columns)]) == columns:
            return t
    raise AssertionError(f"no table with columns {columns} in:\n{text}")


def run(name: str, *argv: str) -> str:
    text = importlib.import_module(f"benchmarks.{name}").main(["--smoke", *argv])
    assert isinstance(text, str) and text.strip(), name
    return text


def first_column(table: list[list[str]]) -> list[str]:
    return [row[0] for row in table[1:]]


def run_plain(name: str) -> str:
    return importlib.import_module(f"benchmarks.{name}").main([])


heavy = pytest.mark.heavy


@heavy
def test_run():
    text = run("run")
    speed = [t for t in tables(text) if t[0][:3] == ["variant", "step ms", "vs f32"]]
    assert len(speed) == 3  # mlp, gpt, cnn
    assert all(first_column(t) == ["f32", "amp"] for t in speed)
    assert {"### mlp", "### gpt", "### cnn"} <= {ln.split(":")[0] for ln in text.splitlines()}
    assert table_with(text, "target", "measured", "met")


@heavy
def test_jax_suite():
    # the plugin on our sample test files (benchmarks/jax_suite_sample), one
    # per suite: every test wraps its functions in amp, and passes, in both modes
    t = table_with(run("jax_suite"), "file", "mode", "tests run", "wrapped")
    files = ["sample_test.py", "equinox_test.py", "flax_nnx_test.py"]
    assert [row[:2] for row in t[1:-1]] == [[f, m] for m in ("float32", "bfloat16") for f in files]
    tests = {"sample_test.py": "5", "equinox_test.py": "4", "flax_nnx_test.py": "4"}
    assert all(row[2] == row[3] == row[4] == tests[row[0]] and row[5] == "0" for row in t[1:-1]), t


@heavy
def test_trace_cost():
    t = table_with(run("trace_cost"), "depth", "f32 eqns", "f32 s", "amp s", "amp / f32")
    assert first_column(t) == ["1", "2"]
    assert t[0][-2:] == ["explain s", "explain / amp"]
    assert int(t[2][1]) > int(t[1][1]) > 0  # the program grows with the depth


@heavy
def test_compile_time():
    text = run("compile_time")
    t = table_with(text, "variant", "trace s", "lower s", "compile s (CPU s)")
    assert first_column(t) == ["f32", "amp"]
    assert first_column(table_with(text, "depth", "f32 eqns", "amp eqns")) == ["2"]


@heavy
def test_peers():
    pytest.importorskip("equinox")
    t = table_with(run("peers"), "variant", "step ms", "step vs f32")
    assert first_column(t) == ["f32", "amp", "hand"]
    assert all(row[1][0].isdigit() for row in t[1:]), t  # no variant raised


#: the module each real model's library is imported as (benchmarks/real_models.py)
REAL_MODEL_LIBRARIES = {
    "gemma": "gemma.gm",
    "penzai": "penzai",
    "recurrentgemma": "recurrentgemma.jax",
    "keras_llama": "keras_hub",
    "keras_vit": "keras_hub",
    "e3nn": "e3nn_jax",
    "jax_md": "jax_md",
}


@heavy
@pytest.mark.parametrize("name", list(REAL_MODEL_LIBRARIES))
def test_real_models(name):
    """Each real model that is installed runs f32, amp and hand bf16 at its smoke size
    (the model libraries are in no CI environment: there, each skips)."""
    from benchmarks import real_models

    assert set(REAL_MODEL_LIBRARIES) == set(real_models.MODELS)
    pytest.importorskip(REAL_MODEL_LIBRARIES[name])
    text = run("real_models", "--models", name)
    t = table_with(text, "variant", "step ms", "step vs f32", "step CPU vs f32")
    assert first_column(t) == ["f32", "amp", "hand"]
    assert all(row[1][0].isdigit() for row in t[1:]), t  # no variant raised
    assert t[1][2] == t[1][3] == "1.00", t  # f32 against itself
    bf16, dots = map(int, t[1][7].split("/"))
    assert bf16 == 0 and dots > 0, t  # float32 dots counted
    amp_row = table_with(text, "model", "amp/f32 step")[1]
    assert amp_row[0] == name and amp_row[-2] in ("holds", "misses"), amp_row


def test_real_models_report_a_missing_library_and_judge_by_the_cpus_plan(monkeypatch):
    """A model whose library is absent is reported, not crashed on; amp's row is
    judged by the targets of the plan this CPU gets (issue 57)."""
    import types

    from benchmarks import real_models

    def absent(small):
        raise ModuleNotFoundError("No module named 'gemma'")

    monkeypatch.setitem(real_models.MODELS, "gemma", absent)
    text = real_models.main(["--smoke", "--models", "gemma"])
    assert "### gemma\n\nnot installed: ModuleNotFoundError: No module named 'gemma'" in text
    assert "AMP_JAX_CPU_BF16=" in text and "load average at the start" in text
    res = {
        "f32": {"step_s": 1.0, "compile_s": 1.0},
        "amp": {"step_s": 1.01, "compile_s": 1.31},
    }
    for pays, step in ((False, "holds"), (True, "misses")):
        support = types.SimpleNamespace(pays=pays)
        monkeypatch.setattr(real_models.amp_jax, "cpu_bf16_support", lambda s=support: s)
        row = table_with("\n".join(real_models.targets({"m": res})), "model")[1]
        assert row[0] == "m" and row[-2:] == [step, "misses"], (pays, row)


@heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="8 devices (conftest forces 8 host ones)")
def test_collectives():
    t = table_with(run("collectives"), "layout", "mode", "program", "after partitioning")
    assert [row[1] for row in t[1:]] == ["auto"] * 3 + ["explicit"] * 3
    assert [row[2] for row in t[1:4]] == ["float32", "amp bfloat16", "hand cast to bfloat16"]
    assert all("all-reduce" in row[3] for row in t[1:]), t  # (the gradient's)


@heavy
@pytest.mark.skipif(not CPU, reason="memory_analysis of the host compiler")
def test_eager_memory():
    text = run("eager_memory")
    t = table_with(text, "optimizer", "variant", "params MiB")
    assert {row[0] for row in t[1:]} == {"sgd(momentum=0.9)", "adam", "kahan(adam)", "adamw 8bit"}
    assert table_with(text, "optimizer", "variant", "temp MiB", "peak MiB", "bound MiB")


@heavy
def test_plan_hash():
    t = table_with(run("plan_hash"), "entry", "sha256[:16]", "unchanged")
    assert first_column(t) == ["mlp.hlo", "mlp.jaxpr", "mlp.explain", "mlp.report"]


@heavy
def test_dot_thresholds():
    text = run("dot_thresholds")
    t = table_with(text, "m", "n = 2")
    assert [row[0] for row in t[1:]] == ["1", "64"]
    assert "The candidate rule lowers" in text


@heavy
def test_float8_numerics():
    t = table_with(run("float8_numerics"), "model", "policy", "loss rel err", "grad rel err")
    assert [row[1] for row in t[1:]] == ["bfloat16", "float8", "float8_rowwise"]


@heavy
def test_quantized_states(tmp_path):
    t = table_with(run("quantized_states", "--out", str(tmp_path)), "seed", "states")
    assert first_column(t) == ["0", "0"] and t[1][1] == "float32 AdamW"
    assert (tmp_path / "QUANTIZED_STATES.md").exists()


@heavy
def test_long_run():
    text = run("long_run")
    stream = table_with(text, "states", "rounding")
    assert [r[:2] for r in stream[1:]] == [
        ["bf16 mu + nu", "stochastic"],
        ["bf16 nu", "stochastic"],
    ]
    applied = table_with(text, "recipe", "displacement / float32's")
    assert first_column(applied) == ["Kahan, bf16 moments + bf16 compensation"]
    model_stream = table_with(text.split("The gradients of a real model")[1], "states", "rounding")
    assert [r[:2] for r in model_stream[1:]] == [
        ["bf16 mu + nu", "stochastic"],
        ["float16 mu", "stochastic"],
    ]
    # bf16 nu against float32's; a float16 mu's nu is float32 ("-"); both updates
    assert 0.5 < float(model_stream[1][2]) < 2 and model_stream[2][2] == "-", model_stream
    assert all(0.5 < float(r[3]) < 2 for r in model_stream[1:]), model_stream
    model = table_with(text, "recipe", "final val loss, mean over seeds")
    assert first_column(model) == ["float32", "bf16 params + Kahan (bf16 moments)"]


@heavy
def test_long_run_merge_keeps_the_recipes_it_does_not_train(tmp_path):
    kept = {"name": "float32", "val_steps": [20], "val_loss": [[4.0]], "train_loss": [[4.0]]}
    kept |= {"seconds": 1.0, "state_bytes_per_param": 8.0}
    (tmp_path / "long_run.json").write_text(json.dumps([kept]))
    name = "bf16 params + Kahan (bf16 moments)"
    argv = ["--no-stream", "--merge", "--only", name, "--out", str(tmp_path)]
    text = run("long_run", *argv)
    model = table_with(text, "recipe", "final val loss, mean over seeds")
    assert first_column(model) == ["float32", name] and model[1][1] == "4.0000"
    assert "kept from the previous run" in text


def test_optim_bytes():  # no sizes to shrink: the table of docs/optim.md, from eval_shape
    text = run_plain("optim_bytes")
    assert "float32 AdamW" in first_column(table_with(text, "scheme", "weights", "gradients"))


STUDIES = sorted(p.stem for p in (ROOT / "benchmarks" / "studies").glob("[!_]*.py"))


@pytest.mark.parametrize("name", STUDIES)
def test_studies_import_and_name_their_results(name):
    module = importlib.import_module(f"benchmarks.studies.{name}")
    first = module.__doc__.splitlines()[0]
    assert first.startswith("Frozen study; its results: benchmarks/"), first
    assert callable(module.main)


def test_every_benchmark_is_smoke_tested_and_in_the_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    here = pathlib.Path(__file__).read_text()
    for path in (ROOT / "benchmarks").glob("[!_]*.py"):
        if path.stem == "torch_peer":  # imported by run.py on a GPU with PyTorch
            continue
        assert f"python -m benchmarks.{path.stem}" in readme, path.stem
        assert f'"{path.stem}"' in here, f"{path.stem} has no smoke test"
    for name in STUDIES:
        assert f"benchmarks/studies/{name}.py" in readme, name


# -- the GPU session (benchmarks/gpu_session.py) and its profile ----------------------


@heavy
def test_gpu_profile():
    from benchmarks.gpu_profile import KINDS

    text = run("gpu_profile")
    t = table_with(text, "kind", "amp ms/step", "hand ms/step", "hand - amp")
    assert first_column(t) == [k for k, _ in KINDS] + [
        "other",
        "total (device)",
        "wall (host, traced)",
    ]
    total = t[-2]
    assert float(total[1]) > 0 and float(total[2]) > 0
    assert table_with(text, "kernel", "kind", "calls/step", "ms/step")


def _trace(tracks: dict[tuple[str, str], list[tuple[str, float]]]) -> dict:
    """A Perfetto-style trace: {(process, thread): [(event name, microseconds)]}."""
    events, pids = [], {}
    for tid, ((proc, thread), evs) in enumerate(tracks.items()):
        pid = pids.setdefault(proc, len(pids) + 1)
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": proc}})
        events.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}
        )
        events += [
            {"ph": "X", "pid": pid, "tid": tid, "ts": 0, "dur": dur, "name": name}
            for name, dur in evs
        ]
    return {"traceEvents": events}


def test_gpu_profile_sums_the_device_streams_by_kind():
    from benchmarks import gpu_profile as G

    trace = _trace(
        {
            ("/device:GPU:0", "Stream #13(Compute)"): [
                ("sm90_xmma_gemm_bf16bf16_bf16f32", 600.0),
                ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 300.0),
                ("loop_convert_fusion", 50.0),
                ("input_reduce_fusion", 30.0),
                ("loop_add_fusion", 20.0),
            ],
            # xprof's derived tracks repeat the stream's time by HLO op and module
            ("/device:GPU:0", "XLA Ops"): [("fusion.1", 1000.0)],
            ("/device:GPU:0", "XLA Modules"): [("jit_step", 1000.0)],
            ("/host:CPU", "python"): [("PjitFunction(step)", 5000.0)],
        }
    )
    s = G.summarize(G.device_events(trace), steps=2)
    assert s["by_kind"] == {
        "matmul": 0.3,
        "attention": 0.15,
        "convert": 0.025,
        "reduction": 0.015,
        "other fusion": 0.01,
    }
    assert abs(s["total_ms"] - 0.5) < 1e-12
    assert s["calls"]["loop_add_fusion"] == 0.5
    # without a device, the host's XLA threads stand in (the CPU check)
    host = _trace(
        {("/host:CPU", "tf_XLAEigen/1"): [("dot.3", 10.0)], ("/host:CPU", "python"): [("x", 99.0)]}
    )
    assert [e["name"] for e in G.device_events(host)] == ["dot.3"]


def test_gpu_session_cuts_a_stage_off_with_sigint_first(tmp_path):
    from benchmarks import gpu_session as S

    code = (
        "import time\n"
        "print('started', flush=True)\n"
        "try:\n    time.sleep(120)\n"
        "except KeyboardInterrupt:\n    print('kept what it had', flush=True)\n    raise\n"
    )
    log = tmp_path / "stage.log"
    rc, cut = S.run_stage([sys.executable, "-c", code], log, 2, dict(os.environ))
    assert cut and rc != 0
    assert log.read_text().split("\n")[:2] == ["started", "kept what it had"]
    rc, cut = S.run_stage([sys.executable, "-c", "print('done')"], log, 60, dict(os.environ))
    assert (rc, cut) == (0, False) and log.read_text() == "done\n"


def test_gpu_session_packs_its_folder_and_drops_the_bulk_past_the_limit(tmp_path, monkeypatch):
    from benchmarks import gpu_session as S

    work = tmp_path / "work"
    for name, size in (
        ("logs/tests.log", 10),
        ("hlo/gpt_amp.hlo.txt", 50_000),
        ("traces/t.gz", 10),
    ):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(os.urandom(size))  # random: gzip cannot shrink it

    def packed(limit):
        monkeypatch.setattr(S, "MAX_FILE", limit)
        S._pack(work, tmp_path / "logs.tar.gz")
        with tarfile.open(tmp_path / "logs.tar.gz") as tar:
            return {n for n in tar.getnames() if tar.getmember(n).isfile()}

    every = {
        "gpu_session/logs/tests.log",
        "gpu_session/hlo/gpt_amp.hlo.txt",
        "gpu_session/traces/t.gz",
    }
    assert packed(1 << 20) == every
    assert packed(20_000) == {"gpu_session/logs/tests.log"}


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_resume_runs_only_the_tests_a_cut_off_run_did_not_reach(tmp_path, workers):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_one(): pass\n"
        "def test_two(): pytest.skip('recorded too')\n"
        "def test_three(): pass\n"
    )
    done = tmp_path / "done.txt"
    env = {**os.environ, "AMP_JAX_RESUME": str(done), "PYTHONPATH": str(ROOT / "tools")}

    def pytest_run(*args):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "resume", "-p", "no:cacheprovider"]
        out = subprocess.run(
            [*cmd, *workers, "-W", "ignore", *args, "test_three.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        return out.stdout + out.stderr

    first = pytest_run("-k", "one or two")  # the run that was cut off
    assert "1 passed, 1 skipped" in first, first
    assert sorted(done.read_text().split()) == [
        "test_three.py::test_one",
        "test_three.py::test_two",
    ]
    second = pytest_run()
    # xdist's workers deselect, and its controller does not count them
    assert ("1 passed in" if workers else "1 passed, 2 deselected") in second, second
    assert sorted(done.read_text().split()) == [
        "test_three.py::test_one",
        "test_three.py::test_three",
        "test_three.py::test_two",
    ]


@heavy
def test_gpu_session(tmp_path):
    text = run(
        "gpu_session", "--out", str(tmp_path), "--fresh", "--resume", str(tmp_path / "d.txt")
    )
    stages = table_with(text, "stage", "seconds (share)", "exit", "cut off")
    assert first_column(stages) == [
        "device",
        "tests_gpu",
        "bench",
        "quantized",
        "profile",
        "tests_rest",
    ]
    assert all(row[2] == "0" and row[3] == "" for row in stages[1:]), stages
    assert table_with(text, "backend", "device", "JAX", "passed")
    assert table_with(text, "kind", "amp ms/step", "hand ms/step")  # the profile's, by kind
    assert table_with(text, "params", "states", "ms", "vs bf16-state AdamW")
    assert {
        "summary.md",
        "PROFILE_GPU.md",
        "QUANTIZED_UPDATE.md",
        "tests_done.txt",
        "logs.tar.gz",
    } <= {p.name for p in tmp_path.iterdir()}
    assert "tests/test_policy.py::" in (tmp_path / "tests_done.txt").read_text()
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        logs = {pathlib.PurePath(n).name for n in tar.getnames()}
    assert {"bench.log", "profile.log", "tests_gpu.log", "tests_rest.log", "junit.xml"} <= logs


def test_machine_lines_name_the_cpu_flags_and_amps_bf16_decision():
    from benchmarks import peers
    from benchmarks import run as bench_run

    m = bench_run.machine()
    assert m["amp bf16 dots on this cpu"].split(" (")[0] in ("yes", "no"), m
    assert "bf16 flags" not in m
    assert bench_run.cpu_flags({"avx2", "fma"}) == "no avx512_bf16, no amx_bf16, avx2"
    assert bench_run.cpu_flags({"avx512_bf16", "amx_bf16", "avx2"}) == (
        "avx512_bf16, amx_bf16, avx2"
    )
    line = peers.machine()[0]
    assert f"cpu flags: {m['cpu flags']}; amp bf16 dots: " in line, line


def test_results_live_in_their_folder_and_the_readme_indexes_them():
    """benchmarks/ holds the scripts; every page they write (and every record kept
    by hand) is in benchmarks/results/, and benchmarks/README.md indexes each."""
    bench = ROOT / "benchmarks"
    guides = {"README.md", "GPU_SESSION.md"}  # how to run them, not results
    loose = [
        p.name
        for p in bench.iterdir()
        if p.is_file() and p.suffix in (".md", ".json", ".png") and p.name not in guides
    ]
    assert not loose, f"result pages outside benchmarks/results/: {loose}"
    readme = (bench / "README.md").read_text()
    unindexed = [p.name for p in (bench / "results").iterdir() if p.name not in readme]
    assert not unindexed, f"benchmarks/README.md does not index {unindexed}"
    assert "](results/RESULTS.md)" in readme
