"""The CPU comparison through pytest-benchmark: rnnkern's CPU backend against
torch.nn (oneDNN / ATen) at the README's CPU size (B=32, T=256, H=256, float32),
forward and forward + backward, each cell.

    python -m pytest bench/ --benchmark-only                 # the table, grouped per cell and phase
    python -m pytest bench/ --benchmark-only --benchmark-json=out.json

Not part of ``python -m pytest tests`` (pyproject's testpaths).  pytest-benchmark
times one test after the other, not interleaved: on a shared machine prefer
``python -m bench --families headline`` (bench/README.md), which interleaves.
Every benchmark first checks its result against torch.nn in float64 (the main
job's criterion, bench/agreement.py) and fails instead of timing a wrong answer.
"""
from __future__ import annotations

import pytest
import torch

from bench import agreement
from bench.candidates import CANDIDATES, torch_module
from bench.grid import Case
from bench.suite import PHASES, case_seed, make_inputs, phase_fn, truth_results

DEVICE = torch.device("cpu")
B, T, H = 32, 256, 256


@pytest.fixture(scope="module")
def prepared():
    """Per cell: the case, its weights, inputs, float64 truth and torch.nn's results."""
    cache = {}

    def get(cell):
        if cell not in cache:
            case = Case(cell, B, T, H, "float32", ("headline",))
            src = torch_module(cell, case.I, H, case_seed(case))
            pool = make_inputs(case, DEVICE, case_seed(case))
            truth, _ = truth_results(case, src, pool[0], DEVICE)
            built = CANDIDATES["torch"].build(case, src, DEVICE)
            base = {p: phase_fn(p, built, cell == "lstm")(pool[0]) for p in PHASES}
            cache[cell] = (case, src, pool, truth, base)
        return cache[cell]

    return get


@pytest.mark.parametrize("candidate", ["torch", "cpu"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_cpu(benchmark, prepared, cell, phase, candidate):
    case, src, pool, truth, base = prepared(cell)
    fn = phase_fn(phase, CANDIDATES[candidate].build(case, src, DEVICE), cell == "lstm")
    check = agreement.check(agreement.tensor_names(cell, phase), fn(pool[0]), truth[phase], base[phase],
                            torch.float32)
    assert check["ok"], f"{candidate} disagrees with torch.nn: {check}"
    benchmark.group = f"{cell} {phase} B{B} T{T} H{H} float32"
    benchmark.extra_info.update(threads=torch.get_num_threads(), rel_err=check["rel_err"])
    inputs = iter(pool * 1000)  # rotating input sets, as in the main job
    benchmark.pedantic(lambda: fn(next(inputs)), rounds=7, warmup_rounds=1, iterations=1)
