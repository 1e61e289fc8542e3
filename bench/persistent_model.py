"""A time model of the persistent kernels (csrc/cuda/persistent.cuh) on an H100,
before a GPU has timed them: per step, what each CTA does and what it waits for.

    python -m bench.persistent_model [--json OUT]
    python -m bench.persistent_model --triton [--json OUT]   # Triton's spread kernels

Triton's spread kernels (rnnkern/triton/spread.py, :func:`spread_rows`): one
program per BLOCK_B x BLOCK_H tile (rnnkern.triton.spread.tiles_for on 132
SMs); per step each program reads its slice of W_hh (G x BLOCK_H rows of P;
backward, BLOCK_H columns of G*H rows) and its rows of h (dA backward, float32)
through L2 -- W is not pinned in shared memory, so the model charges it every
step, an upper bound where L1 keeps it -- at the smaller of the SM's L2 port
(64 B a clock) and its share of L2's bandwidth; the tl.dot products at the
tensor cores' rate (half types) or the FMA rate (float32, IEEE); the same
assumed 1.5 us barrier.  The per-step path it replaces adds a launch per step
(2-5 us each, issue 26), which the spread kernels do not pay.

The plan is persistent_plan's (units per CTA, outputs, batch tile, split of k,
4 x 4 register tiles); per step and CTA the model adds
  * products: float32 / float64 in 4 x 4 register tiles: their FMAs (padding
    included) at the SM's FMA rate, or their shared-memory loads (4 + 4 per 16
    FMAs, one warp-wide load a clock), the slower; the half types on the tensor
    cores (WMMA 16x16x16 from shared memory): the MMAs at mma.sync's rate or their
    operands' bytes (1 KiB per MMA, W's slice re-read every step) at 128 B a clock;
  * staging: every CTA reads the batch's h_{t-1} (da_{t+1} backward) from L2, all
    CTAs sharing L2's bandwidth;
  * the grid barrier, an assumed 1.5 us (not measured yet: the first thing to time);
  * the pointwise units and the chunk sums, one pass of the block's threads.
Beside it, the measured per-step times of today's host loop (a GEMM and a
pointwise launch per step) and of torch.nn (cuDNN) from the committed H100 grid
(bench/results/gpu-h100-2026-11-27-session4/bench-cuda-grid), where the size is
there.  A model, not a measurement: it says where the time should go, and the
first GPU session checks it (`RNNKERN_CUDA_PERSISTENT=1`, bench candidate
"persistent").

Checked by the fifth H100 session (bench/results/gpu-h100-2026-11-27-session5):
the staging term was 20-50x too optimistic -- staging then copied one element
at a time, each load an L2 round trip (0.26 us), not at L2's bandwidth -- and
the measured step was 3.4 us + 0.26 us per element a thread staged.  Staging
has since moved to 16-byte chunks, 8 loads in flight, which this model's
bandwidth term describes better; not timed yet.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# H100 SXM (sm_90): per SM and clock, and the chip's.
SMS = 132
CLOCK_HZ = 1.755e9          # sustained boost under load
FMA_PER_CLOCK = {"float64": 64, "float32": 128, "float16": 128, "bfloat16": 128}  # FP32 FFMA / DFMA lanes
LDS_LANES_PER_CLOCK = 32    # one warp-wide shared-memory load instruction a clock
SMEM_BYTES_PER_CLOCK = 128
MMA_FMA_PER_CLOCK = 1024    # fp16/bf16 mma.sync with fp32 accumulators (about half of wgmma's peak)
L2_BYTES_PER_S = 5.5e12
GRID_BARRIER_S = 1.5e-6     # assumed; cooperative_groups grid.sync() over 132 CTAs
THREADS = 256
SMEM_OPT_IN = 227 * 1024
SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
GATES = {"rnn_tanh": 1, "lstm": 4, "gru": 3}
TILE = 4
GRID = Path(__file__).resolve().parent / "results" / "gpu-h100-2026-11-27-session4" / "bench-cuda-grid" / "bench_gpu.json"


def plan(H: int, B: int, K: int, outputs_per_unit: int, dtype: str) -> dict:
    """persistent_plan's choices (csrc/cuda/persistent.cuh)."""
    s, a = SIZE[dtype], 8 if dtype == "float64" else 4
    grid_max = min(H, SMS)
    units = math.ceil(H / grid_max)
    grid = math.ceil(H / units)
    outputs = outputs_per_unit * units
    up = lambda n: (n + 15) // 16 * 16  # noqa: E731
    half = s == 2

    def ld_of(k):
        return up(k) + 8 if half else (k if s >= 8 else next(x for x in range(k, k + 8) if (x * s) % 8 == 4))

    def smem(tile, split, piece=K):  # persistent_layout
        if half:
            w_rows, x_rows = up(outputs), up(tile)
            part = (w_rows // 16) * (x_rows // 16) * split * 256
        else:
            w_rows, x_rows, part = outputs, tile, tile * outputs * split
        return 128 + up(s * w_rows * ld_of(K)) + up(s * x_rows * ld_of(piece)) + a * part

    def tiles(tile):  # the products' work items
        if half:
            return math.ceil(outputs / 16) * math.ceil(tile / 16)
        return math.ceil(tile / TILE) * math.ceil(outputs / TILE)

    workers = THREADS // 32 if half else THREADS
    tile, piece = B, K
    while tile >= 1 and smem(tile, 1) > SMEM_OPT_IN:
        tile = tile // 2 if tile > 64 else tile - 1
    if tile < 1:  # rows in pieces of k beside the partial sums of a split busying every worker
        tile = min(B, 16)
        want = 1
        while want < 32 and tiles(tile) * want * 2 <= workers:
            want *= 2
        longest = 0
        while want >= 1 and not longest:
            longest = next((p for p in range((K - 1) // 16 * 16, 15, -16)
                            if smem(tile, want, p) <= SMEM_OPT_IN), 0)
            want //= 2
        if not longest:
            return {}
        pieces = math.ceil(K / longest)
        piece = up(math.ceil(K / pieces))
    steps = math.ceil(piece / 16) if half else piece
    split = 1
    while (split < 32 and split * 2 <= steps and tiles(tile) * split * 2 <= workers
           and smem(tile, split * 2, piece) <= SMEM_OPT_IN):
        split *= 2
    return dict(grid=grid, units=units, outputs=outputs, K=K, batch_tile=tile, split=split,
                k_piece=piece, smem=smem(tile, split, piece), tensor_cores=half)


def step_seconds(p: dict, B: int, dtype: str) -> dict:
    """The model's parts for one step of the busiest CTA."""
    s = SIZE[dtype]
    passes = math.ceil(B / p["batch_tile"])
    clocks = 0.0
    for i in range(passes):
        nb = min(p["batch_tile"], B - i * p["batch_tile"])
        if p["tensor_cores"]:
            mmas = math.ceil(nb / 16) * math.ceil(p["outputs"] / 16) * math.ceil(p["K"] / 16)
            clocks += max(mmas * 16 ** 3 / MMA_FMA_PER_CLOCK, mmas * 1024 / SMEM_BYTES_PER_CLOCK)
        else:
            tiles = math.ceil(nb / TILE) * math.ceil(p["outputs"] / TILE)
            clocks += max(tiles * TILE * TILE * p["K"] / FMA_PER_CLOCK[dtype],
                          tiles * 2 * TILE * p["K"] / LDS_LANES_PER_CLOCK)
    products = clocks / CLOCK_HZ
    staging = p["grid"] * B * p["K"] * s / L2_BYTES_PER_S
    # chunk sums and the units: a few passes of the block, ~40 clocks each (a guess)
    units = passes * (1 + p["split"] / 8) * math.ceil(B * p["outputs"] / THREADS / passes) * 40 / CLOCK_HZ
    return dict(products=products, staging=staging, barrier=GRID_BARRIER_S, units=units,
                total=products + staging + GRID_BARRIER_S + units)


def measured() -> dict:
    """(cell, B, H, dtype, phase) -> (host loop us/step, torch.nn us/step) from the committed grid."""
    if not GRID.exists():
        return {}
    out = {}
    for r in json.loads(GRID.read_text())["results"]:
        c = r["candidates"]
        if "cuda" in c and "torch" in c and "us_per_step" in c["cuda"]:
            out[(r["cell"], r["B"], r["H"], r["dtype"], r["phase"])] = (c["cuda"]["us_per_step"],
                                                                     c["torch"]["us_per_step"])
    return out


CASES = [("lstm", 16, 768), ("gru", 16, 768), ("rnn_tanh", 16, 768), ("lstm", 1, 256),
         ("rnn_tanh", 1, 256), ("lstm", 64, 1024), ("rnn_tanh", 64, 1024), ("lstm", 256, 1024)]
DTYPES = ["float16", "bfloat16", "float32"]


def rows() -> list[dict]:
    seen = measured()
    out = []
    for cell, B, H in CASES:
        G = GATES[cell]
        for dtype in DTYPES:
            fwd_plan = plan(H, B, H, G, dtype)
            bwd_plan = plan(H, B, G * H, 1, dtype)
            if not fwd_plan:
                continue
            fwd = step_seconds(fwd_plan, B, dtype)
            # a backward whose slice does not fit runs the host loop (None here)
            bwd = step_seconds(bwd_plan, B, dtype) if bwd_plan else None
            host_f, torch_f = seen.get((cell, B, H, dtype, "forward"), (None, None))
            host_fb, torch_fb = seen.get((cell, B, H, dtype, "forward_backward"), (None, None))
            out.append(dict(cell=cell, B=B, H=H, dtype=dtype, plan_forward=fwd_plan, plan_backward=bwd_plan,
                            forward_us=fwd, backward_us=bwd,
                            model_forward_us=fwd["total"] * 1e6,
                            model_forward_backward_us=None if bwd is None else (fwd["total"] + bwd["total"]) * 1e6,
                            host_loop_forward_us=host_f, torch_forward_us=torch_f,
                            host_loop_forward_backward_us=host_fb, torch_forward_backward_us=torch_fb))
    return out


L2_PORT_BYTES_PER_CLOCK = 64  # one SM's share of the L2 crossbar


def spread_step_seconds(cell: str, B: int, H: int, dtype: str, backward: bool) -> dict:
    """The model's parts for one step of a spread program (see the docstring)."""
    from rnnkern.triton.spread import tiles_for
    t = tiles_for(cell, B, H, False, SMS)
    if t is None:
        return {}
    G, s = GATES[cell], SIZE[dtype]
    bb, bh = t["BLOCK_B"], t["BLOCK_H"]
    programs = math.ceil(B / bb) * math.ceil(H / bh)
    K = G * H if backward else H  # the product's depth: dA [B, G*H] W_hh[:, slice] backward
    N = bh if backward else G * bh
    pad = lambda n, m: math.ceil(n / m) * m  # noqa: E731
    w_bytes = pad(K, t["BLOCK_K"]) * N * s
    row_bytes = bb * pad(K, t["BLOCK_K"]) * 4  # h (dA) in the float32 ping-pong buffers
    per_sm = min(L2_PORT_BYTES_PER_CLOCK * CLOCK_HZ, L2_BYTES_PER_S / programs)
    traffic = (w_bytes + row_bytes) / per_sm
    fmas = bb * pad(K, t["BLOCK_K"]) * N
    rate = MMA_FMA_PER_CLOCK if s == 2 else FMA_PER_CLOCK[dtype]
    products = fmas / rate / CLOCK_HZ
    return dict(programs=programs, BLOCK_B=bb, BLOCK_H=bh, traffic=traffic, products=products,
                barrier=GRID_BARRIER_S, total=max(traffic, products) + GRID_BARRIER_S)


def spread_rows() -> list[dict]:
    seen = measured()
    out = []
    for cell, B, H in CASES:
        for dtype in DTYPES:
            fwd = spread_step_seconds(cell, B, H, dtype, False)
            if not fwd:
                continue
            bwd = spread_step_seconds(cell, B, H, dtype, True)
            _, torch_f = seen.get((cell, B, H, dtype, "forward"), (None, None))
            _, torch_fb = seen.get((cell, B, H, dtype, "forward_backward"), (None, None))
            out.append(dict(cell=cell, B=B, H=H, dtype=dtype, forward_us=fwd, backward_us=bwd,
                            model_forward_us=fwd["total"] * 1e6,
                            model_forward_backward_us=(fwd["total"] + bwd["total"]) * 1e6,
                            torch_forward_us=torch_f, torch_forward_backward_us=torch_fb))
    return out


def fmt(v):
    """A figure, or "-": not measured (host loop, cuDNN), or the backward does not fit (model)."""
    return "-" if v is None else f"{v:.1f}"


def _persistent_line(r: dict) -> str:
    f = r["forward_us"]
    return (f"| {r['cell']} | {r['B']} | {r['H']} | {r['dtype']} | {r['plan_forward']['grid']} x "
            f"{r['plan_forward']['units']} | {r['model_forward_us']:.1f} ({f['products'] * 1e6:.1f} + "
            f"{f['staging'] * 1e6:.2f} + {f['barrier'] * 1e6:.1f}) | {fmt(r['host_loop_forward_us'])} | "
            f"{fmt(r['torch_forward_us'])} | {fmt(r['model_forward_backward_us'])} | "
            f"{fmt(r['host_loop_forward_backward_us'])} | {fmt(r['torch_forward_backward_us'])} |")


def _spread_line(r: dict) -> str:
    f = r["forward_us"]
    return (f"| {r['cell']} | {r['B']} | {r['H']} | {r['dtype']} | {f['programs']} "
            f"({f['BLOCK_B']}x{f['BLOCK_H']}) | {r['model_forward_us']:.1f} "
            f"(max({f['traffic'] * 1e6:.2f}, {f['products'] * 1e6:.2f}) + "
            f"{f['barrier'] * 1e6:.1f}) | {fmt(r['torch_forward_us'])} | "
            f"{r['model_forward_backward_us']:.1f} | {fmt(r['torch_forward_backward_us'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--triton", action="store_true", help="Triton's spread kernels instead")
    args = parser.parse_args()
    if args.triton:
        table, line, header = spread_rows(), _spread_line, (
            "| cell | B | H | dtype | programs (tile) | model fwd us/step (max(L2, products) + "
            "barrier) | cuDNN fwd | model fwd+bwd | cuDNN fwd+bwd |")
    else:
        table, line, header = rows(), _persistent_line, (
            "| cell | B | H | dtype | CTAs x units | model fwd us/step (products + staging + barrier) "
            "| host loop fwd | cuDNN fwd | model fwd+bwd | host loop fwd+bwd | cuDNN fwd+bwd |")
    print(header)
    print("|---" * header.count(" | ") + "|---|")
    for r in table:
        print(line(r))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
