"""rnnkern's benchmark suite: ``python -m bench`` (bench/README.md).

    suite.py       the run: cases x phases, agreement first, interleaved timing; the CLI
    grid.py        the size grid (families latency / throughput / long / headline, per device)
    candidates.py  what is compared: torch.nn, rnnkern's backends, the vanilla loop,
                   torch.compile of it, FlashRNN
    agreement.py   numerical agreement with torch.nn (float64 truth), checked before timing
    timing.py      interleaved CPU / CUDA timers, the device's measured peaks
    cost.py        FLOPs and bytes of one call (the formulas, in one place)
    report.py      terminal tables, markdown, JSON, plots
"""
