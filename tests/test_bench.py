"""The benchmark suite's own tests: `python -m bench --quick` runs end to end and
writes well-formed JSON, markdown and plots; the cost formulas, the agreement
criterion and the strict JSON writer do what bench/README.md says.

No timing is asserted here (speed lives in the benchmark, not in tests).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import agreement, report
from bench.cost import cost
from bench.grid import build_grid

ROOT = Path(__file__).resolve().parent.parent
CELLS = ("lstm", "gru", "rnn_tanh")
FAMILIES = ("latency", "throughput", "long", "headline")
PHASES = ("forward", "forward_backward")
CPU_CANDIDATES = ("torch", "cpu", "reference", "compile")
TIMED_FIGURES = ("median_ms", "min_ms", "speedup_vs_torch", "us_per_step", "tflops", "gbps", "pct_peak_flops",
                 "pct_peak_bw")


def positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `python -m bench --quick` on the CPU, as CI and a user run it."""
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
    assert meta["versions"]["torch"] == torch.__version__
    assert sorted(meta["grid"]) == sorted(FAMILIES)
    assert positive(doc["peaks"]["gemm_tflops"]["float32"]) and positive(doc["peaks"]["copy_gbps"])
    for name in CPU_CANDIDATES:
        assert meta["candidates"][name]["available"], meta["candidates"][name]

    results = doc["results"]
    seen = {(r["cell"], r["phase"], f) for r in results for f in r["families"]}
    assert seen == {(c, p, f) for c in CELLS for p in PHASES for f in FAMILIES}
    for r in results:
        where = f"{r['cell']} B{r['B']} T{r['T']} H{r['H']} {r['phase']}"
        assert r["dtype"] == "float32" and r["I"] == r["H"], where
        for key in ("B", "T", "H", "flops", "bytes"):
            assert positive(r[key]), (where, key)
        assert r["truth"] == "torch.nn float64", where
        assert list(r["candidates"]) == list(CPU_CANDIDATES), where
        base = r["candidates"]["torch"]
        for name, e in r["candidates"].items():
            # Nothing is skipped at the quick sizes: every candidate must have agreed and been timed.
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
        assert base["speedup_vs_torch"] == 1.0


def test_quick_prints_tables_and_writes_plots(quick_run):
    out, stdout = quick_run
    assert "speed vs torch.nn, fwd " in stdout and "speed vs torch.nn, fwd+bwd" in stdout
    md = (out / "quick.md").read_text()
    assert md.count("| cell | dtype | B | T | H | torch.nn ms |") == 2
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == sorted([f"time-{c}-float32.png" for c in CELLS] + ["speedup-float32.png"])
    for p in (out / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_lines_stream_and_a_stopped_run_keeps_what_it_measured(tmp_path, sig):
    """Each case's line is printed while the run goes on; Ctrl-C or SIGTERM then ends it
    with the cases measured so far in the JSON (marked stopped), the markdown and the plots."""
    cmd = [sys.executable, "-u", "-m", "bench", "--quick", "--backends", "cpu", "--no-progress",
           "--out", str(tmp_path)]
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def test_default_grid_covers_every_cell_and_family_in_a_few_sizes():
    cases = build_grid("cpu", CELLS, ["float32"], FAMILIES, "default")
    assert {(c.cell, f) for c in cases for f in c.families} == {(c, f) for c in CELLS for f in FAMILIES}
    assert {(c.B, c.T, c.H) for c in cases if "headline" in c.families} == {(32, 256, 256)}
    assert 3 * len(cases) <= len(build_grid("cpu", CELLS, ["float32"], FAMILIES, "full"))


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

    from bench import candidates, suite
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
