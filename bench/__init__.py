"""rnnkern's benchmark suite: ``python -m bench`` (bench/README.md).

The main job, ``python -m bench``:

    suite.py       the run: cases x phases, agreement first, interleaved timing; the CLI
    grid.py        the size grid (families latency / throughput / long / headline / peers /
                   step, per device)
    candidates/    what is compared, one family a module: torch.nn and rnnkern's backends
                   (modules.py), the vanilla loop and torch.compile of it (loop.py),
                   FlashRNN (flashrnn.py), the CPU inference engines ONNX Runtime and
                   OpenVINO (peers.py); the calling convention (common.py)
    agreement.py   numerical agreement with torch.nn (float64 truth), checked before timing
    timing.py      interleaved CPU / CUDA timers, the device's measured peaks
    fma_peak.py    the CPU's FLOP/s ceiling: the cores' FMA peak (units x lanes x clock)
    cost.py        FLOPs and bytes of one call (the formulas, in one place)
    report.py      terminal tables, markdown, JSON, plots

Studies and tools beside it:

    resets.py            ``python -m bench.resets``: ``resets=`` against the torch.nn loop
                         that splits a chunk at every episode boundary
    packed.py            ``python -m bench.packed``: a packed batch of skewed lengths
                         against torch.nn and against a dense batch of the same steps
    rl.py                ``python -m bench.rl``: sb3-contrib's RecurrentPPO and torchrl's
                         LSTMModule against rnnkern.integrations (docs/rl.md)
    threads.py           ``python -m bench.threads``: one CPU thread against two, quiet and
                         beside a busy neighbour
    sanitizer_cases.py   a small case of every CUDA kernel, for compute-sanitizer
    gpu_check.sh         everything a session with a lent GPU runs: build, GPU tests,
                         sanitizers, the GPU benchmark
    cooperative_check.cu the emulated device's cooperative-grid model (occupancy, the
                         too-large refusal, the grid barrier) checked on a real GPU;
                         cooperative_check.sh builds and runs it
    persistent_model.py  ``python -m bench.persistent_model``: a time model of the persistent
                         CUDA kernels per step on an H100 (no GPU needed)
    test_cpu_benchmarks.py  the CPU comparison through pytest-benchmark
    results/             committed result files

The machine's description (CPU model and ISA, versions, git commit, load) comes
from rnnkern's environment probe, :mod:`rnnkern.check.probe`.
"""
