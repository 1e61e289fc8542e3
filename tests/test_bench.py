"""The benchmark suite's own tests: `python -m bench --quick` runs end to end and
writes well-formed JSON, markdown and plots; the cost formulas, the agreement
criterion and the strict JSON writer do what bench/README.md says; the inference
engines (ONNX Runtime, OpenVINO) run forward only with the run's threads, or are
listed as not run with the reason when their package is absent; the step family
times T=1 sequence calls and cell calls.

No timing is asserted here (speed lives in the benchmark, not in tests).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rnnkern
from bench import agreement, fma_peak, report, suite
from bench.cost import cost
from bench.grid import DEFAULT_FAMILIES, FAMILIES, PACKED_SIZES, STUDY_FAMILIES, build_grid
from rnnkern.check.probe import ISA_CAPS

ROOT = Path(__file__).resolve().parent.parent
CELLS = ("lstm", "gru", "rnn_tanh")
PHASES = ("forward", "forward_backward")
PEERS = ("onnxruntime", "openvino")
#: Each inference engine runs where its package is installed (requirements-dev.txt
#: installs both); where it is not, the run must list it as not run, with the reason.
PEER_INSTALLED = {p: importlib.util.find_spec(p) is not None for p in PEERS}
CPU_CANDIDATES = ("torch", "cpu", "auto", "reference", "compile") + tuple(p for p in PEERS if PEER_INSTALLED[p])
TIMED_FIGURES = ("median_ms", "min_ms", "speedup_vs_torch", "us_per_step", "tflops", "gbps", "pct_peak_flops",
                 "pct_peak_bw")


def positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `python -m bench --quick` on the CPU, as CI and a user run it.  CI runs it
    first, as the README's main job, and names its folder in RNNKERN_QUICK_BENCH_RUN
    (quick.json, quick.md, plots/, stdout.txt): the tests then read that run, which must
    be of this commit, instead of a second one."""
    done = os.environ.get("RNNKERN_QUICK_BENCH_RUN")
    if done:
        from rnnkern.check.probe import git_commit
        out = Path(done)
        meta = json.loads((out / "quick.json").read_text())["meta"]
        assert meta["git"] == git_commit(), f"{out}: a run of {meta['git']}, not of this tree ({git_commit()})"
        assert meta["command"].startswith("python -m bench --quick") and "--device cpu" in meta["command"]
        return out, (out / "stdout.txt").read_text()
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "bench", "--quick", "--device", "cpu", "--no-progress",
           "--json", str(out / "quick.json"), "--markdown", str(out / "quick.md"),
           "--plots", str(out / "plots")]
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"python -m bench --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out, proc.stdout


def test_quick_json_is_well_formed(quick_run):
    out, _ = quick_run
    text = (out / "quick.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-finite number {c} in the JSON"))
    meta = doc["meta"]
    assert meta["schema"] == "rnnkern-bench/1"
    assert meta["quick"] is True and meta["command"].startswith("python -m bench --quick")
    for key in ("date", "git", "device", "versions", "settings", "grid", "timing", "agreement", "candidates"):
        assert key in meta, key
    assert meta["device"]["type"] == "cpu" and meta["device"]["threads"] >= 1
    assert meta["settings"]["rnnkern_cuda_persistent"] in rnnkern.ops.PERSISTENT_MODES
    isa = meta["device"]["isa"]  # what ran, and any ISA caps (a stand-in run says so)
    assert isa["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isa["rnnkern_vector_bits"] == rnnkern._C.cpu_vector_bits()
    assert isa["rnnkern_fma_pipe_bits"] == rnnkern._C.cpu_fma_pipe_bits() in (256, 512)
    assert set(isa["cpu_flags"]) <= {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16"}
    assert isa.get("caps", {}) == {k: os.environ[k] for k in ISA_CAPS if os.environ.get(k)}
    assert meta["versions"]["torch"] == torch.__version__
    assert sorted(meta["grid"]) == sorted(FAMILIES)
    assert meta["grid_calls"]["step"] == ["sequence", "cell"] and meta["grid_calls"]["peers"] == ["sequence"]
    assert positive(doc["peaks"]["gemm_tflops"]["float32"]) and positive(doc["peaks"]["copy_gbps"])
    # The CPU's FLOP/s ceiling is the cores' FMA peak, every number behind it stated.
    fma = doc["peaks"]["fma"]
    assert fma["core"] in fma_peak.CORES and fma["threads"] == meta["device"]["threads"]
    assert positive(fma["clock_mhz"]) and fma["clock_source"]
    assert math.isclose(fma["tflops"]["float32"], fma["threads"] * fma["fma_units"] * fma["fp32_lanes_per_unit"]
                        * 2 * fma["clock_mhz"] * 1e-6, rel_tol=1e-9)
    assert fma["tflops"]["float32"] >= doc["peaks"]["gemm_tflops"]["float32"] * (1 - 1e-9)  # a ceiling of torch.mm too
    assert set(meta["device"]["cpu_id"]) == {"vendor", "family", "model", "stepping", "name"}
    assert positive(meta["timing"]["harness_overhead_us"])
    for name in CPU_CANDIDATES:
        assert meta["candidates"][name]["available"], meta["candidates"][name]
    for name in PEERS:
        c = meta["candidates"][name]
        assert c["phases"] == ["forward"], c
        if not PEER_INSTALLED[name]:
            assert c["available"] is False and "pip install 'rnnkern[peers]'" in c["note"], c
    assert meta["peers"]["openvino"]["config"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert meta["peers"]["onnx_export"]["opset"] >= 14

    results = doc["results"]
    seen = {(r["cell"], r["phase"], f) for r in results for f in r["families"]}
    assert seen == {(c, p, f) for c in CELLS for p in PHASES for f in FAMILIES if f not in STUDY_FAMILIES}
    for r in results:
        where = f"{r['cell']} B{r['B']} T{r['T']} H{r['H']} {r['phase']}"
        # float32 but for the bf16 family, measured in bfloat16 beside float32
        assert r["dtype"] == "float32" or (r["dtype"] == "bfloat16" and r["families"] == ["bf16"]), where
        assert r["I"] == r["H"], where
        for key in ("B", "T", "H", "flops", "bytes"):
            assert positive(r[key]), (where, key)
        assert r["truth"] == "torch.nn float64", where
        assert r["call"] in ("sequence", "cell") and (r["call"] == "sequence" or r["T"] == 1), where
        assert list(r["candidates"]) == list(CPU_CANDIDATES), where
        base = r["candidates"]["torch"]
        for name, e in r["candidates"].items():
            if name in PEERS and r["dtype"] != "float32":
                # The engines are timed in float32 only; the bf16 rows say so.
                assert e["status"] == "skipped" and "float32 only" in e["note"], (where, name, e)
                continue
            if name in PEERS and r["phase"] == "forward_backward":
                # An inference engine: its training phase is listed as not run, and why.
                assert e["status"] == "skipped" and e["phase_not_run"] is True, (where, name, e)
                assert "forward only" in e["note"] and "median_ms" not in e, (where, name, e)
                continue
            # Nothing else is skipped at the quick sizes: every candidate must have agreed and been timed.
            assert e["status"] == "timed", (where, name, e)
            a = e["agreement"]
            assert a["ok"] is True and a["rel_err"] <= a["allowed"], (where, name, a)
            assert a["worst"] in agreement.tensor_names(r["cell"], r["phase"]), (where, name)
            for key in TIMED_FIGURES:
                assert positive(e[key]), (where, name, key, e[key])
            assert e["samples"] >= 3 and e["calls_per_sample"] >= 1, (where, name)
            assert e["min_ms"] <= e["median_ms"] and e["iqr_ms"] >= 0, (where, name)
            assert math.isclose(e["us_per_step"], e["median_ms"] * 1e3 / r["T"], rel_tol=1e-9)
            assert math.isclose(e["speedup_vs_torch"], base["median_ms"] / e["median_ms"], rel_tol=1e-9)
            assert math.isclose(e["tflops"], r["flops"] / e["median_ms"] / 1e9, rel_tol=1e-9)
            # %peak is of a ceiling: the FMA peak, which no candidate exceeds.
            assert math.isclose(e["pct_peak_flops"], 100 * e["tflops"] / fma["tflops"][r["dtype"]], rel_tol=1e-9)
            assert e["pct_peak_flops"] <= 100, (where, name, e["pct_peak_flops"])
        assert base["speedup_vs_torch"] == 1.0



@pytest.mark.parametrize("family, model, flags, core, fp32_per_cycle", [
    (0x19, 0x01, {"avx2", "fma"}, "AMD Zen 3", 32),                          # EPYC Milan: 2 x 8 lanes x 2
    (0x19, 0x11, {"avx2", "fma", "avx512f", "avx512_bf16"}, "AMD Zen 4", 32),  # AVX-512 on 256-bit units
    (0x1A, 0x02, {"avx2", "fma", "avx512f", "avx512_bf16"}, "AMD Zen 5", 64),  # 512-bit units
    (0x1A, 0x44, {"avx2", "fma", "avx512f", "avx512_bf16"}, "AMD Zen 5", 64),  # desktop (Granite Ridge)
    (0x1A, 0x24, {"avx2", "fma", "avx512f", "avx512_bf16"}, "AMD Zen 5, mobile", 32),  # 256-bit halves
    (0x06, 0x55, {"avx2", "fma", "avx512f"}, "AVX-512 core", 64),
    (0x06, 0x8F, {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX-512 core", 64),  # SPR
    (0x06, 0x3C, {"avx2", "fma"}, "AVX2 core", 32),
])
def test_fma_peak_per_core(family, model, flags, core, fp32_per_cycle):
    """The FMA peak: threads x units x lanes x 2 x clock, per core generation
    (bench/fma_peak.py's table); float64 at half the float32 rate, bfloat16 at
    twice it where the core has a bfloat16 dot product, AMX's tile rate (1024
    flops a cycle) where it has AMX-BF16."""
    vendor = "AuthenticAMD" if family >= 0x17 else "GenuineIntel"
    identity = {"vendor": vendor, "family": family, "model": model, "stepping": 0, "name": "test"}
    peak = fma_peak.fma_peak(2, ("float64", "float32", "bfloat16"), clock_mhz=3000.0, clock_source="test",
                             identity=identity, flags=flags)
    assert peak["core"] == core
    assert peak["flops_per_cycle_per_core"]["float32"] == fp32_per_cycle
    assert peak["flops_per_cycle_per_core"]["float64"] == fp32_per_cycle // 2
    assert peak["flops_per_cycle_per_core"]["bfloat16"] == (
        1024 if "amx_bf16" in flags else fp32_per_cycle * (2 if "avx512_bf16" in flags else 1))
    assert math.isclose(peak["tflops"]["float32"], 2 * fp32_per_cycle * 3e9 / 1e12)
    assert peak["clock_mhz"] == 3000.0 and peak["clock_source"] == "test"
    # A GEMM measured above that peak means the cores ran faster than the stated clock.
    assert fma_peak.at_least_measured(peak, {"float32": 0.5 * peak["tflops"]["float32"]}) is peak
    raised = fma_peak.at_least_measured(peak, {"float32": 1.5 * peak["tflops"]["float32"]})
    assert math.isclose(raised["clock_mhz"], 4500.0) and raised["stated_clock_mhz"] == 3000.0
    assert math.isclose(raised["tflops"]["float32"], 1.5 * peak["tflops"]["float32"])
    assert "implied by the measured float32 GEMM" in raised["clock_source"]
    # The FMA loop's rate raises it the same way, the higher of the two deciding.
    looped = fma_peak.at_least_measured(peak, {"float32": 1.2 * peak["tflops"]["float32"]},
                                        1.5 * peak["tflops"]["float32"])
    assert math.isclose(looped["clock_mhz"], 4500.0) and looped["stated_clock_mhz"] == 3000.0
    assert "FMA loop" in looped["clock_source"] and looped["fma_loop_tflops"] == 1.5 * peak["tflops"]["float32"]
    # Raised a second time (the end of a run): against the first stated clock and source.
    again = fma_peak.at_least_measured(looped, {}, 1.6 * peak["tflops"]["float32"])
    assert math.isclose(again["clock_mhz"], 4800.0) and again["stated_clock_mhz"] == 3000.0
    assert again["clock_source"].endswith("above the stated 3000 MHz (test)")
    assert again["clock_source"].count("above the stated") == 1
    slower = fma_peak.at_least_measured(peak, {}, 0.9 * peak["tflops"]["float32"])
    assert slower["clock_mhz"] == 3000.0 and slower["fma_loop_tflops"] == 0.9 * peak["tflops"]["float32"]


def test_fma_loop_rate_is_a_rate():
    """rnnkern._C.cpu_fma_rate (the loop behind fma_loop_tflops) returns FLOP/s
    of a loop that ran; its size is checked before it runs.  (What it measures
    is the benchmark's business, not a test's.)"""
    from rnnkern import _C
    rate = _C.cpu_fma_rate(1000)
    assert isinstance(rate, float) and math.isfinite(rate) and rate > 0
    for bad in (0, -5):
        with pytest.raises(ValueError, match="iterations must be positive"):
            _C.cpu_fma_rate(bad)
    assert fma_peak.fma_loop_tflops(2, rounds=1, seconds=0.001) > 0

def test_quick_runs_the_peers_and_the_step_family(quick_run):
    """The peers family's cases and the step family's T=1 and cell calls, every cell;
    each engine ran with the run's threads (as the engine reports them back) and
    OpenVINO in float32."""
    out, stdout = quick_run
    doc = json.loads((out / "quick.json").read_text())
    threads = doc["meta"]["device"]["threads"]
    results = doc["results"]
    for cell in CELLS:
        peers = [r for r in results if r["cell"] == cell and "peers" in r["families"]]
        assert {r["phase"] for r in peers} == set(PHASES), cell
        step = {(r["call"], r["phase"]) for r in results if r["cell"] == cell and "step" in r["families"]}
        assert step == {(c, p) for c in ("sequence", "cell") for p in PHASES}, cell
        for r in results:
            if r["cell"] == cell and "step" in r["families"]:
                assert r["T"] == 1 and r["families"] == ["step"], r
    assert "lstm cell B1 H32 float32 fwd: torch.nn " in stdout
    assert "lstm B1 T1 H32 float32 fwd: torch.nn " in stdout
    for r in results:
        if r["phase"] != "forward" or r["dtype"] != "float32":
            continue
        for name in PEERS:
            if not PEER_INSTALLED[name]:
                assert name not in r["candidates"]
                continue
            e = r["candidates"][name]
            assert e["status"] == "timed" and e["agreement"]["ok"], (r["cell"], r["call"], name, e)
            engine = e["engine"]
            if name == "onnxruntime":
                assert engine["intra_op_num_threads"] == threads and engine["inter_op_num_threads"] == 1
                assert engine["providers"] == ["CPUExecutionProvider"]
                assert engine["graph_optimization_level"] == "ORT_ENABLE_ALL"
            else:
                props = engine["properties"]
                assert props["INFERENCE_NUM_THREADS"] == threads and props["INFERENCE_PRECISION_HINT"] == "f32"
                # A sequence call runs OpenVINO's own recurrent operator, a cell call the products.
                rnn_ops = {"LSTMSequence", "GRUSequence", "RNNSequence", "TensorIterator", "Loop"}
                assert bool(rnn_ops & set(engine["ops"])) == (r["call"] == "sequence"), (r, engine["ops"])


def test_quick_runs_the_packed_family(quick_run):
    """The packed family (bench/packed.py as a study of the run): every cell's packed
    batch of skewed lengths, agreed with torch.nn in float64 before its timing, its
    line printed as it is measured, and the report's table the JSON's figures."""
    out, stdout = quick_run
    doc = json.loads((out / "quick.json").read_text())
    T, B, I, H, mean = PACKED_SIZES["quick"]
    assert doc["meta"]["grid"]["packed"] == {"T": T, "B": B, "I": I, "H": H, "mean_length": mean}
    rows = doc["packed"]
    assert [r["cell"] for r in rows] == list(CELLS)
    md = (out / "quick.md").read_text()
    assert "packed batches of skewed lengths" in md
    for r in rows:
        assert (r["T"], r["B"], r["I"], r["H"]) == (T, B, I, H), r
        assert 0 <= r["float64_max_difference"] <= 1e-10, r
        assert B <= r["steps"] < r["grid"] == T * B, r  # mostly padding, as the study means
        for name in ("torch.nn packed", "rnnkern packed", "rnnkern lengths=", "rnnkern dense"):
            assert positive(r["ms"][name]), (r["cell"], name)
        assert r["speedup_vs_torch"] == pytest.approx(r["ms"]["torch.nn packed"] / r["ms"]["rnnkern packed"])
        assert "[packed] " + report.packed_line(r) in stdout
        assert "| " + " | ".join(next(row for row in report.packed_rows(doc) if row[0] == r["cell"])) + " |" in md
        assert f"| {r['cell']} | {B} | {T} | {H} | {r['steps']} / {T * B} | " in md


def test_quick_runs_the_speech_family(quick_run):
    """The speech family (bench/speech.py as a study of the run): the bidirectional
    two-layer LSTM and GRU at the quick size, agreed with torch.nn in float64 before
    any timing, rnnkern's cpu backend and auto timed against torch.nn in inference
    and training, each line printed as measured, the report's table the JSON's."""
    from bench import speech

    out, stdout = quick_run
    doc = json.loads((out / "quick.json").read_text())
    sizes = [dict(zip(("B", "T", "I", "H", "layers"), size)) for size in speech.SIZES["quick"]]
    assert doc["meta"]["grid"]["speech"] == sizes
    rows = doc["speech"]
    assert [(r["cell"], r["B"]) for r in rows] == [(c, s["B"]) for c in CELLS if c in speech.MODULES
                                                   for s in sizes]
    md = (out / "quick.md").read_text()
    assert "speech-sized bidirectional stacks" in md
    for r in rows:
        assert r["bidirectional"] and 0 <= r["float64_max_difference"] <= speech.TOLERANCE, r
        for phase in ("forward", "forward_backward"):
            p = r["phases"][phase]
            for name in speech.CANDIDATES:
                assert positive(p["ms"][name]), (r["cell"], phase, name)
            for name in speech.CANDIDATES[1:]:
                assert p["speedup_vs_torch"][name] == pytest.approx(p["ms"]["torch.nn"] / p["ms"][name])
            assert p["auto_runs"].startswith(("torch.nn", "rnnkern backend=")), p["auto_runs"]
        assert "[speech] " + report.speech_line(r) in stdout
        row = next(row for row in report.speech_rows(doc) if row[:2] == [r["cell"], str(r["B"])])
        assert "| " + " | ".join(row) + " |" in md


def test_quick_prints_tables_and_writes_plots(quick_run):
    out, stdout = quick_run
    assert "speed vs torch.nn, fwd " in stdout and "speed vs torch.nn, fwd+bwd" in stdout
    assert "speed vs torch.nn, fwd, one step" in stdout and "speed vs torch.nn, fwd+bwd, one step" in stdout
    md = (out / "quick.md").read_text()
    assert md.count("| cell | dtype | B | T | H | torch.nn ms |") == 2
    assert md.count("| cell | call | dtype | B | H | torch.nn us |") == 2
    assert "| lstm | cell | float32 | 1 | 32 |" in md and "| lstm | T=1 | float32 | 1 | 32 |" in md
    for name, label in (("onnxruntime", "ONNX Runtime"), ("openvino", "OpenVINO")):
        if PEER_INSTALLED[name]:
            assert f"{label} in training (inference engine: forward only)" in md
        else:
            assert f"{label} (the {name} package is not installed" in md
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == sorted([f"time-{c}-{d}.png" for c in CELLS for d in ("float32", "bfloat16")]
                          + ["speedup-float32.png", "speedup-bfloat16.png"])
    for p in (out / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_lines_stream_and_a_stopped_run_keeps_what_it_measured(tmp_path, sig):
    """Each case's line is printed while the run goes on; Ctrl-C or SIGTERM then ends it
    with the cases measured so far in the JSON (marked stopped), the markdown and the plots."""
    cmd = [sys.executable, "-u", "-m", "bench", "--quick", "--backends", "cpu", "--no-progress",
           "--out", str(tmp_path)]
    env = dict(os.environ, MPLBACKEND="Agg")
    # SIGINT back to its default in the child: a test run started in the background by
    # a non-interactive shell inherits it ignored, and Python keeps it so.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = []
    try:
        for line in proc.stdout:
            head.append(line)
            if line.startswith("[1/"):
                break
        assert proc.poll() is None, "the run ended before its first case line was read:\n" + "".join(head)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig.value, "".join(head) + rest
    assert f"stopped by {sig.name}" in rest
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["complete"] is False and doc["meta"]["stopped_by"] == sig.name
    total = 2 * len(build_grid("cpu", CELLS, ["float32"], FAMILIES, "quick"))
    measured = doc["results"]
    assert 2 <= len(measured) < total and len(measured) % 2 == 0
    first = measured[0]
    assert head[-1].startswith("[1/") and report.case_line(first) in head[-1]
    assert all(e["status"] == "timed" for r in measured for e in r["candidates"].values())
    md = (tmp_path / "bench.md").read_text()
    assert f"| {first['cell']} | float32 | {first['B']} | {first['T']} | {first['H']} |" in md
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png"))


def test_quick_runs_the_bf16_family(quick_run):
    """The bf16 family: every cell in bfloat16 and float32 at its size whatever the
    run's dtypes, and the report's table of each candidate's bf16 speed against its
    own float32, with the ratio of the two measured times."""
    out, _ = quick_run
    doc = json.loads((out / "quick.json").read_text())
    rows = [r for r in doc["results"] if "bf16" in r["families"]]
    for cell in CELLS:
        assert {(r["dtype"], r["phase"]) for r in rows if r["cell"] == cell} == {
            (d, p) for d in ("bfloat16", "float32") for p in PHASES}, cell
    md = (out / "quick.md").read_text()
    assert md.count("half type against float32") == 2
    for r in rows:
        if r["dtype"] != "bfloat16" or r["phase"] != "forward":
            continue
        twin = next(t for t in rows if t["dtype"] == "float32" and t["phase"] == "forward"
                    and (t["cell"], t["B"], t["T"], t["H"]) == (r["cell"], r["B"], r["T"], r["H"]))
        ratio = twin["candidates"]["cpu"]["median_ms"] / r["candidates"]["cpu"]["median_ms"]
        header = next(line for line in md.splitlines() if line.startswith("| cell | dtype | B | T | H | torch.nn |"))
        column = header.strip("|").split("|").index(" rnnkern-cpu ")
        line = next(line for line in md.split("**forward: half type against float32**")[1].splitlines()
                    if line.startswith(f"| {r['cell']} | bfloat16 | {r['B']} | {r['T']} | {r['H']} |"))
        assert line.strip("|").split("|")[column].strip() == f"{ratio:.2f}x", (line, ratio)


def test_bf16_family_runs_in_its_own_dtypes():
    """The bf16 family adds bfloat16 and float32 cases at its sizes; the other
    families keep the run's dtypes."""
    cases = build_grid("cpu", CELLS, ["float32"], ["headline", "bf16"], "default")
    assert {(c.dtype, c.B, c.T, c.H) for c in cases if "bf16" in c.families} == {
        (d, B, T, H) for d in ("bfloat16", "float32") for B, T, H in ((32, 128, 256), (64, 64, 512),
                                                                       (16, 128, 512))}
    assert {c.dtype for c in cases if "headline" in c.families} == {"float32"}
    only = build_grid("cpu", ["lstm"], ["float16"], ["bf16", "latency"], "default")
    assert {c.dtype for c in only if "latency" in c.families} == {"float16"}
    assert {c.dtype for c in only if "bf16" in c.families} == {"bfloat16", "float32"}


def test_default_grid_covers_every_cell_and_family_in_a_few_sizes():
    cases = build_grid("cpu", CELLS, ["float32"], DEFAULT_FAMILIES, "default")
    assert {(c.cell, f) for c in cases for f in c.families} == {(c, f) for c in CELLS for f in DEFAULT_FAMILIES}
    assert {(c.B, c.T, c.H) for c in cases if "headline" in c.families} == {(32, 256, 256)}
    assert 3 * len(cases) <= len(build_grid("cpu", CELLS, ["float32"], DEFAULT_FAMILIES, "full"))
    assert all(c.call == "sequence" for c in cases)


def test_peers_and_step_families_are_the_peer_tables():
    """The two tables of the peer comparison: the peers family's six sizes, and the step family's
    T=1 and cell calls at B 1, 16 x H 64, 256 and B 1 H 8 (not in the default run)."""
    peers = build_grid("cpu", CELLS, ["float32"], ["peers"], "default")
    assert [(c.cell, c.B, c.T, c.H, c.call) for c in peers] == [
        ("lstm", 32, 256, 256, "sequence"), ("lstm", 1, 256, 128, "sequence"), ("lstm", 64, 64, 128, "sequence"),
        ("gru", 1, 256, 128, "sequence"), ("gru", 32, 256, 256, "sequence"),
        ("rnn_tanh", 32, 256, 256, "sequence")]
    step = build_grid("cpu", CELLS, ["float32"], ["step"], "default")
    assert sorted((c.cell, c.B, c.H, c.call) for c in step) == sorted(
        (cell, B, H, call) for cell in CELLS for B, H in ((1, 8), (1, 64), (1, 256), (16, 64), (16, 256))
        for call in ("sequence", "cell"))
    assert all(c.T == 1 for c in step)
    # A size in two families is one case, tagged with both.
    both = build_grid("cpu", ["lstm"], ["float32"], ["headline", "peers"], "default")
    assert [c.families for c in both if (c.B, c.T, c.H) == (32, 256, 256)] == [("headline", "peers")]
    assert not {"peers", "step"} & set(DEFAULT_FAMILIES)


def test_a_cell_call_is_one_step():
    from bench.grid import Case

    with pytest.raises(ValueError, match="T must be 1"):
        Case("lstm", 1, 2, 8, "float32", ("step",), "cell")
    with pytest.raises(ValueError, match="call"):
        Case("lstm", 1, 1, 8, "float32", ("step",), "layer")
    assert Case("gru", 1, 1, 8, "float32", ("step",), "cell").label == "gru cell B1 H8 float32"


def test_peer_families_bring_the_engines_and_rounds_are_exact():
    assert not set(PEERS) & set(suite.Config().default_candidates())
    for families in (("peers",), ("step",), ("latency", "step")):
        assert set(PEERS) <= set(suite.Config(families=families).default_candidates()), families
    assert set(PEERS) <= set(suite.Config(grid="quick").default_candidates())
    assert suite.Config().run_families() == DEFAULT_FAMILIES
    assert suite.Config(grid="full").run_families() == FAMILIES
    t = suite.Config(rounds=7).timing()
    assert t["rounds"] == 7 and t["min_rounds"] == 7


# ------------------------------------------------------------ unit parts ----

def test_cost_counts_the_products_and_the_traffic():
    # One step, one sequence, I = H = 1, float32 (4 bytes): every term by hand.
    c = cost("lstm", T=1, B=1, I=1, H=1, dtype=torch.float32, phase="forward")
    # products: 2*4 (input) + 2*4 (recurrent); gate math: 21
    assert c.flops == 8 + 8 + 21
    # x 4 + projection 2*4*4 + weights (4+4+8)*4 + (h0, c0, h_n, c_n) 4*4 + output 4
    assert c.bytes == 4 + 32 + 64 + 16 + 4
    fb = cost("lstm", T=1, B=1, I=1, H=1, dtype=torch.float32, phase="forward_backward")
    # backward: products twice (32), bias gradients 2*4, gate math 2*21
    assert fb.flops == c.flops + 32 + 8 + 42
    # Large sizes: the products dominate, fwd+bwd is about three forwards.
    big_f = cost("gru", T=256, B=64, I=512, H=512, dtype=torch.bfloat16, phase="forward")
    big_fb = cost("gru", T=256, B=64, I=512, H=512, dtype=torch.bfloat16, phase="forward_backward")
    gemm = 2 * 256 * 64 * 512 * 3 * 512 * 2
    assert gemm < big_f.flops < 1.02 * gemm
    assert 2.9 < big_fb.flops / big_f.flops < 3.1
    # bfloat16 moves half the bytes of float32 in the forward.
    f32 = cost("gru", T=256, B=64, I=512, H=512, dtype=torch.float32, phase="forward")
    assert math.isclose(f32.bytes, 2 * big_f.bytes)


def test_cost_rejects_unknown_cell_and_phase():
    with pytest.raises(ValueError, match="cell"):
        cost("gru_reset_before", 1, 1, 1, 1, torch.float32, "forward")
    with pytest.raises(ValueError, match="phase"):
        cost("lstm", 1, 1, 1, 1, torch.float32, "backward")


def test_agreement_is_calibrated_by_torch_nn():
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(64, 32, generator=g, dtype=torch.float64)
    noise = torch.randn(64, 32, generator=g, dtype=torch.float64)
    baseline = truth + 1e-3 * noise
    as_good = truth - 1e-3 * noise
    ten_times_worse = truth + 1e-2 * noise
    ok = agreement.check(["output"], [as_good], [truth], [baseline], torch.float32)
    assert ok["ok"] and ok["worst"] == "output"
    bad = agreement.check(["output"], [ten_times_worse], [truth], [baseline], torch.float32)
    assert not bad["ok"] and bad["rel_err"] > bad["allowed"]
    nan = agreement.check(["output"], [torch.full_like(truth, math.nan)], [truth], [baseline], torch.float32)
    assert not nan["ok"] and nan["rel_err"] is None
    # An exact baseline still leaves the dtype's floor.
    exact = agreement.check(["output"], [truth + 1e-7 * noise], [truth], [truth], torch.float32)
    assert exact["ok"] and exact["allowed"] == agreement.FLOOR[torch.float32]


def test_json_writer_refuses_non_finite_numbers(tmp_path):
    with pytest.raises(ValueError):
        report.write_json({"x": math.inf}, tmp_path / "bad.json")


def test_a_disagreeing_or_failing_candidate_is_reported_not_timed(monkeypatch):
    from tqdm import tqdm

    from bench import candidates
    from bench.grid import Case

    def build_wrong(case, src, device):  # the vanilla loop, one percent off
        b = candidates.CANDIDATES["reference"].build(case, src, device)
        return candidates.Built(lambda x, h0, c0: (lambda o: (o[0] * 1.01, o[1], o[2]))(b.layer(x, h0, c0)),
                                b.params)

    def build_failing(case, src, device):
        def layer(x, h0, c0):
            raise RuntimeError("no kernel for this size")
        return candidates.Built(layer, [])

    always, never = (lambda device: None), (lambda case, device, options: None)
    monkeypatch.setitem(candidates.CANDIDATES, "wrong", candidates.Candidate("wrong", "wrong", always, never, build_wrong))
    monkeypatch.setitem(candidates.CANDIDATES, "failing",
                        candidates.Candidate("failing", "failing", always, never, build_failing))
    monkeypatch.setitem(candidates.LOOP_MAX_T, "cpu", 4)  # the loop is then skipped at T=8
    case = Case("rnn_tanh", 3, 8, 16, "float32", ("latency",))
    cfg = suite.Config(grid="quick", progress=False)
    records = suite.run_case(case, ["torch", "cpu", "reference", "wrong", "failing"], torch.device("cpu"), cfg,
                             tqdm(disable=True))
    assert [r["phase"] for r in records] == list(PHASES)
    for r in records:
        c = r["candidates"]
        assert c["torch"]["status"] == "timed" and c["cpu"]["status"] == "timed"
        assert c["reference"]["status"] == "skipped" and "T=8 > 4" in c["reference"]["note"]
        assert c["wrong"]["status"] == "disagrees" and c["wrong"]["agreement"]["ok"] is False
        assert "median_ms" not in c["wrong"]
        assert c["failing"]["status"] == "error" and "no kernel for this size" in c["failing"]["note"]
        assert "median_ms" not in c["failing"]


# ---------------------------------------------------------- step timing ----

def test_a_call_of_microseconds_gets_thousands_of_calls_per_sample():
    from bench import timing

    p = timing.plan(10e-6, rounds=7, round_target_s=0.05, budget_s=1.0, min_rounds=3)
    assert p.calls == 5000 and p.rounds == 7
    # On a GPU every call is its own sample: a round stays at 100 calls.
    assert timing.plan(10e-6, 10, 0.02, 0.5, 3, timing.MAX_CALLS["cuda"]).calls == 100
    # A short first call is re-estimated over a loop through the pool, not trusted alone.
    seen = []
    est = timing.estimate(seen.append, ["a", "b"], torch.device("cpu"), first_s=1e-6, min_s=1e-3)
    assert len(seen) == 1000 and seen[:3] == ["a", "b", "a"] and positive(est)
    assert timing.estimate(seen.append, ["a"], torch.device("cpu"), first_s=0.5) == 0.5 and len(seen) == 1000


# ------------------------------------------------------------- the peers ----

def _case_and_weights(cell="lstm", call="sequence", B=2, T=5, H=8, dtype="float32"):
    from bench.candidates import torch_module
    from bench.grid import Case
    from bench.suite import case_seed

    case = Case(cell, B, T, H, dtype, ("peers",), call)
    return case, torch_module(cell, case.I, H, case_seed(case))


def test_peers_run_on_the_cpu_in_float32_only():
    from bench.candidates import CANDIDATES, PEER_INSTALL

    assert PEER_INSTALL == "pip install 'rnnkern[peers]'"
    for name in PEERS:
        c = CANDIDATES[name]
        assert c.phases == ("forward",) and "forward only" in c.phase_note
        assert "CPU only" in c.unavailable(torch.device("cuda"))
        float64, _ = _case_and_weights(dtype="float64")
        assert "float32 only" in c.skip(float64, torch.device("cpu"), {})
        float32, _ = _case_and_weights()
        assert c.skip(float32, torch.device("cpu"), {}) is None


@pytest.mark.parametrize("name", PEERS)
def test_a_missing_engine_is_not_run_with_the_reason(monkeypatch, name):
    from bench.candidates import CANDIDATES

    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    reason = CANDIDATES[name].unavailable(torch.device("cpu"))
    assert reason == f"the {name} package is not installed: pip install 'rnnkern[peers]'"


@pytest.mark.parametrize("call", ["sequence", "cell"])
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_peers_compute_torch_nn_with_the_runs_threads(cell, call):
    """Built on 2 threads: each engine reports 2 threads back (ORT's session options,
    OpenVINO's compiled model), and its forward gives torch.nn's outputs."""
    from bench import candidates

    case, src = _case_and_weights(cell, call, T=1 if call == "cell" else 5)
    cpu = torch.device("cpu")
    base = candidates.CANDIDATES["torch"].build(case, src, cpu)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(case.T, case.B, case.I, generator=g)
    h0, c0 = torch.randn(case.B, case.H, generator=g), torch.randn(case.B, case.H, generator=g)
    c0 = c0 if cell == "lstm" else None
    with torch.no_grad():
        want = base.layer(x, h0, c0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name in PEERS:
            if not PEER_INSTALLED[name]:
                assert candidates.CANDIDATES[name].unavailable(cpu) is not None
                continue
            built = candidates.CANDIDATES[name].build(case, src, cpu)
            if name == "onnxruntime":
                assert built.info["intra_op_num_threads"] == 2 and built.info["inter_op_num_threads"] == 1
            else:
                assert built.info["properties"]["INFERENCE_NUM_THREADS"] == 2
                assert built.info["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
                assert built.info["properties"]["ENABLE_CPU_PINNING"] is False
            got = built.layer(x, h0, c0)
            for k, (a, b) in enumerate(zip(got, want)):
                if b is None:
                    assert a is None, (name, k)
                    continue
                assert isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.shape == b.shape, (name, k)
                assert agreement.relative_error(a, b.double()) < 1e-5, (name, k)
    finally:
        torch.set_num_threads(previous)


def test_onnx_export_is_cached_per_case_and_weights():
    from bench import candidates

    case, src = _case_and_weights("gru")
    first = candidates.onnx_model(case, src)
    assert candidates.onnx_model(case, src) is first
    _, other_weights = _case_and_weights("gru", B=3)  # same shapes but for B: other seed
    assert candidates.onnx_model(case, other_weights) is not first
    other_case, _ = _case_and_weights("gru", B=3)
    assert candidates.onnx_model(other_case, src) is not first


def test_a_peer_on_wrong_weights_disagrees_and_is_not_timed(monkeypatch):
    """Each engine built from a module whose weights are 1% off: reported as
    disagreeing, not timed; the same engine on the right weights, in the same case
    (so the ONNX cache cannot mix them up), agrees and is timed."""
    from tqdm import tqdm

    from bench import candidates
    from bench.grid import Case

    def perturbed(build):
        def wrong(case, src, device):
            bad = candidates.copy_module(type(src), src, case, torch.device("cpu"), torch.float64)
            with torch.no_grad():
                bad.weight_hh_l0.mul_(1.01)
            return build(case, bad, device)
        return wrong

    installed = [n for n in PEERS if PEER_INSTALLED[n]]
    for name in installed:
        c = candidates.CANDIDATES[name]
        monkeypatch.setitem(candidates.CANDIDATES, "wrong_" + name, candidates.Candidate(
            "wrong_" + name, "wrong " + c.label, c.unavailable, c.skip, perturbed(c.build), c.phases, c.phase_note))
    case = Case("lstm", 2, 6, 16, "float32", ("peers",))
    names = ["torch"] + [n for p in installed for n in (p, "wrong_" + p)]
    records = suite.run_case(case, names, torch.device("cpu"), suite.Config(grid="quick", progress=False),
                             tqdm(disable=True))
    fwd, train = records
    assert fwd["phase"] == "forward" and train["phase"] == "forward_backward"
    for name in installed:
        right, wrong = fwd["candidates"][name], fwd["candidates"]["wrong_" + name]
        assert right["status"] == "timed" and right["agreement"]["ok"], right
        assert wrong["status"] == "disagrees" and wrong["agreement"]["ok"] is False, wrong
        assert wrong["agreement"]["rel_err"] > wrong["agreement"]["allowed"] and "median_ms" not in wrong
        for n in (name, "wrong_" + name):
            assert train["candidates"][n]["status"] == "skipped" and train["candidates"][n]["phase_not_run"]
    assert fwd["candidates"]["torch"]["status"] == "timed" and train["candidates"]["torch"]["status"] == "timed"
    # Where no engine is installed the test still checks that the baseline ran alone.
    assert list(fwd["candidates"]) == names


def test_resets_bench_checks_agreement_then_times(tmp_path):
    """`python -m bench.resets --quick`: rnnkern's resets= against torch.nn run over
    the pieces between restarts, float64 agreement first, then interleaved times."""
    out = tmp_path / "resets.json"
    proc = subprocess.run([sys.executable, "-m", "bench.resets", "--quick", "--cells", "lstm", "gru",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["cell"] for r in doc["results"]] == ["lstm", "gru"]
    for r in doc["results"]:
        assert r["float64_max_difference"] <= 1e-10
        assert positive(r["torch_pieces_ms"]) and positive(r["rnnkern_ms"]) and positive(r["speedup"])
        assert r["rounds"] == {"torch.nn pieces": 3, "rnnkern resets=": 3}
        assert 1 <= r["torch_pieces"] <= r["T"]
    assert "isa" in doc["meta"] and doc["meta"]["threads"] >= 1


def test_resets_bench_refuses_to_time_a_wrong_answer(monkeypatch):
    from bench import resets

    right = resets.rnnkern_resets

    def off_by_a_millionth(*args):
        out, h, c = right(*args)
        return out * (1 + 1e-6), h, c

    monkeypatch.setattr(resets, "rnnkern_resets", off_by_a_millionth)
    with pytest.raises(SystemExit, match="differ by"):
        resets.measure("gru", 6, 3, 8, 0.3, rounds=1, seed=0)


def test_packed_bench_checks_agreement_then_times(tmp_path):
    """`python -m bench.packed --quick`: a packed batch of skewed lengths, rnnkern
    against torch.nn (float64 agreement first), its lengths= on the padded batch,
    and against its own dense batch of the same number of steps."""
    out = tmp_path / "packed.json"
    proc = subprocess.run([sys.executable, "-m", "bench.packed", "--quick", "--cells", "lstm", "gru",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["cell"] for r in doc["results"]] == ["lstm", "gru"]
    for r in doc["results"]:
        assert r["float64_max_difference"] <= 1e-10
        assert r["T"] <= r["steps"] < r["grid"] and r["dense_B"] * r["T"] <= 2 * r["steps"]
        assert all(positive(v) for v in r["ms"].values()) and len(r["ms"]) == 5
        assert positive(r["speedup_vs_torch"]) and positive(r["packed_over_dense"])
        assert positive(r["lengths_speedup_vs_torch"])
    assert "isa" in doc["meta"] and doc["meta"]["threads"] >= 1


def test_packed_bench_refuses_to_time_a_wrong_answer(monkeypatch):
    from bench import packed

    right = packed.forward_backward

    def off_by_a_millionth(m, inputs):
        results = right(m, inputs)
        return [results[0] * (1 + 1e-6) if isinstance(m, rnnkern.LSTM) else results[0], *results[1:]]

    monkeypatch.setattr(packed, "forward_backward", off_by_a_millionth)
    with pytest.raises(SystemExit, match="differ by"):
        packed.measure("lstm", 6, 4, 3, 8, 2.0, rounds=1, seed=0)
    monkeypatch.setattr(packed, "forward_backward", right)
    right_lengths = packed.lengths_forward_backward
    monkeypatch.setattr(packed, "lengths_forward_backward",
                        lambda m, inputs: [r * (1 + 1e-6) for r in right_lengths(m, inputs)])
    with pytest.raises(SystemExit, match="differ by"):
        packed.measure("lstm", 6, 4, 3, 8, 2.0, rounds=1, seed=0)


def test_gemm_bench_checks_agreement_then_times(tmp_path):
    """`python -m bench.gemm --quick`: rnnkern::linear and its two gradients against
    torch's matmul, each checked against the float64 product before it is timed."""
    out = tmp_path / "gemm.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gemm", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["product"] for r in doc["results"]] == ["y", "dX", "dW"] * 2
    for r in doc["results"]:
        assert all(positive(v) for v in (*r["ms"].values(), *r["gflops"].values()))
        assert positive(r["speedup_vs_torch"])
    assert doc["meta"]["fma_peak"]["threads"] == doc["meta"]["threads"]


def test_gemm_bench_refuses_to_time_a_wrong_answer(monkeypatch):
    from bench import gemm

    right = gemm.products

    def off_by_a_thousandth(x, w, gy):
        table = right(x, w, gy)
        ours, theirs, exact = table["dW"]
        table["dW"] = (lambda: ours() * (1 + 1e-3), theirs, exact)
        return table

    monkeypatch.setattr(gemm, "products", off_by_a_thousandth)
    with pytest.raises(SystemExit, match="dW at M=70 K=33 N=40: rnnkern is off by"):
        gemm.measure(70, 33, 40, rounds=1, seed=0)


def test_persistent_model_rows():
    """bench.persistent_model: every case has a forward model, the tensor cores for the
    half types only, and the parts add up to the total."""
    from bench import persistent_model as pm
    rows = pm.rows()
    assert {(r["cell"], r["B"], r["H"]) for r in rows} == set(pm.CASES)
    for r in rows:
        assert r["plan_forward"]["tensor_cores"] == (r["dtype"] in ("float16", "bfloat16"))
        f = r["forward_us"]
        assert abs(f["products"] + f["staging"] + f["barrier"] + f["units"] - f["total"]) < 1e-12
        assert r["model_forward_us"] > pm.GRID_BARRIER_S * 1e6
