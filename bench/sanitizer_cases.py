"""A small case of every CUDA kernel of rnnkern, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python bench/sanitizer_cases.py
    compute-sanitizer --tool racecheck python bench/sanitizer_cases.py --kernels step

Runs the forward and backward of every cell (and the LSTM projection), with
and without lengths, in both directions, and the step op and its backward,
in every dtype, on sizes that leave partial tiles everywhere (odd B, H, I).
Each result is checked against the CPU backend on the same inputs, so a run
that the sanitizer passes also computed the right thing.  The step options
and the LayerNorm cell (``--kernels options``: resets, zoneout, the lstm_ln cell and its
row kernels, with rows longer than a block) are checked against the float64
reference instead (the CPU backend may lack them).  Run it with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation
and an access past its end is caught (gpu_check.sh does).

``--emulated`` runs the same cases on the emulated CUDA device instead
(backend "cuda_emulated", CPU tensors; rnnkern built with
RNNKERN_CUDA_EMULATION=1): how ``gpu_check.sh --rehearse`` exercises this
script where no GPU is.
"""
from __future__ import annotations

import argparse
import sys

import torch

import rnnkern  # noqa: F401  (registers the ops)

#: The device under test and its ops: the CUDA backend, or (--emulated) the
#: emulated device's ops on CPU tensors.
DEVICE = "cuda"
NAMESPACE = "rnnkern"


def device_ops():
    return getattr(torch.ops, NAMESPACE)


CELLS = ("rnn_tanh", "rnn_relu", "lstm", "gru", "gru_reset_before")
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3, "gru_reset_before": 3}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def close(a, b, dtype):
    """float64 / float32: elementwise against the CPU backend.  Half types only
    for shape and finiteness: their rounding differs from the CPU backend's
    (which keeps the state in float32), and a ReLU mask may flip."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or not bool(a.isfinite().all()):
        return False
    if dtype not in (torch.float64, torch.float32):
        return True
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def recurrence_case(cell, dtype, proj, lengths, reverse, g):
    T, B, H = 5, 3, 37
    G, P = GATES[cell], (proj or H)
    s = H ** -0.5
    args = [rand(g, T, B, G * H, dtype=dtype), rand(g, B, P, dtype=dtype, scale=0.5),
            rand(g, B, H, dtype=dtype, scale=0.5) if cell == "lstm" else None,
            rand(g, G * H, P, dtype=dtype, scale=s), rand(g, G * H, dtype=dtype, scale=s),
            rand(g, G * H, dtype=dtype, scale=s), rand(g, P, H, dtype=dtype, scale=s) if proj else None]
    lens = torch.tensor([5, 2, 0]) if lengths else None
    results = []
    for device, ops in (("cpu", torch.ops.rnnkern), (DEVICE, device_ops())):
        a = [None if t is None else t.to(device) for t in args]
        out, h_n, c_n, ws = ops.recurrence(cell, *a, lens, reverse, True)
        g2 = torch.Generator().manual_seed(1)
        go, gh = rand(g2, *out.shape, dtype=dtype).to(device), rand(g2, *h_n.shape, dtype=dtype).to(device)
        gc = rand(g2, *c_n.shape, dtype=dtype).to(device) if cell == "lstm" else None
        grads = ops.recurrence_backward(cell, go, gh, gc, a[1], a[2], a[3], a[6], out,
                                                      ws, lens, reverse)
        results.append([out, h_n, c_n, ws, *grads])
    return all(close(x, y, dtype) for x, y in zip(results[1], results[0]))


def step_case(cell, dtype, g):
    B, I, H = 19, 21, 35  # two row tiles, three unit tiles, K = 56: a partial chunk
    G = GATES[cell]
    s = H ** -0.5
    args = [rand(g, B, I, dtype=dtype), rand(g, B, H, dtype=dtype, scale=0.5),
            rand(g, B, H, dtype=dtype, scale=0.5) if cell == "lstm" else None,
            rand(g, G * H, I, dtype=dtype, scale=s), rand(g, G * H, H, dtype=dtype, scale=s),
            rand(g, G * H, dtype=dtype, scale=s), rand(g, G * H, dtype=dtype, scale=s)]
    results = []
    for device, ops in (("cpu", torch.ops.rnnkern), (DEVICE, device_ops())):
        a = [None if t is None else t.to(device) for t in args]
        h, c, ws = ops.step(cell, *a)
        g2 = torch.Generator().manual_seed(2)
        gh = rand(g2, *h.shape, dtype=dtype).to(device)
        gc = rand(g2, *c.shape, dtype=dtype).to(device) if cell == "lstm" else None
        grads = ops.step_backward(cell, gh, gc, a[0], a[1], a[2], a[3], a[4], h, ws)
        results.append([h, c, ws, *grads])
    return all(close(x, y, dtype) for x, y in zip(results[1], results[0]))


def options_case(cell, dtype, proj, g):
    """Every option at once (resets, a training zoneout mask, lengths in
    reverse; ln for lstm_ln), forward and backward, against the float64
    reference on the CPU.  H = 150: the LSTM-LN rows (4H = 600 values) take
    several passes of a block."""
    from rnnkern import reference
    T, B, H = 5, 3, 150 if cell == "lstm_ln" else 37
    G, P = (4 if cell == "lstm_ln" else GATES[cell]), (proj or H)
    has_c = cell in ("lstm", "lstm_ln")
    s = H ** -0.5
    f64 = torch.float64
    args = [rand(g, T, B, G * H, dtype=f64), rand(g, B, P, dtype=f64, scale=0.5),
            rand(g, B, H, dtype=f64, scale=0.5) if has_c else None,
            rand(g, G * H, P, dtype=f64, scale=s), rand(g, G * H, dtype=f64, scale=s),
            rand(g, G * H, dtype=f64, scale=s), rand(g, P, H, dtype=f64, scale=s) if proj else None]
    ln = 1 + 0.3 * rand(g, 10 * H, dtype=f64) if cell == "lstm_ln" else None
    resets = torch.rand(T, B, generator=g) < 0.35
    Z = P + H if has_c else H
    zoneout = (torch.rand(T, B, Z, generator=g) < 0.4).double()
    lens = torch.tensor([5, 2, 0])
    results = []
    for reference_side, device, dt in ((True, "cpu", f64), (False, DEVICE, dtype)):
        a = [None if t is None else t.to(device, dt).requires_grad_() for t in args]
        l_ = None if ln is None else ln.to(device, dt).requires_grad_()
        r, z = resets.to(device), zoneout.to(device, dt)
        if reference_side:
            out = reference.recurrence(cell, *a, lens, True, r, z, l_)
        else:
            out = device_ops().recurrence(cell, *a, lens, True, True, r, z, l_)[:3]
        out = [o for o in out if o is not None and o.numel() > 0]
        g2 = torch.Generator().manual_seed(3)
        loss = sum((o * rand(g2, *o.shape, dtype=o.dtype).to(device)).sum() for o in out)
        leaves = [t for t in a + [l_] if t is not None]
        results.append(out + list(torch.autograd.grad(loss, leaves)))
    return all(close(x, y, dtype) for x, y in zip(results[1], results[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=["all", "recurrence", "step", "options"],
                        default="all")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument("--emulated", action="store_true",
                        help="on the emulated CUDA device (no GPU; RNNKERN_CUDA_EMULATION=1 build)")
    args = parser.parse_args()
    global DEVICE, NAMESPACE
    if args.emulated:
        if not rnnkern.ops.WITH_CUDA_EMULATION:
            print("sanitizer_cases: --emulated needs rnnkern built with RNNKERN_CUDA_EMULATION=1",
                  file=sys.stderr)
            return 2
        from rnnkern import cuda_emulated
        DEVICE, NAMESPACE = "cpu", cuda_emulated.NAMESPACE
    elif not torch.cuda.is_available() or not rnnkern.ops.WITH_CUDA:
        print("sanitizer_cases: needs a GPU and rnnkern built with its CUDA kernels", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    failed = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for cell in CELLS + ("lstm_ln",):
            results = []
            if args.kernels in ("all", "recurrence") and cell in CELLS:
                for proj in ([0, 11] if cell == "lstm" else [0]):
                    for lengths, reverse in ((False, False), (True, True)):
                        ok = recurrence_case(cell, dtype, proj, lengths, reverse, g)
                        results.append((f"recurrence {cell} {name} proj={proj} lengths={lengths} "
                                        f"reverse={reverse}", ok))
            if args.kernels in ("all", "step") and cell in CELLS:
                results.append((f"step {cell} {name}", step_case(cell, dtype, g)))
            if args.kernels in ("all", "options"):
                for proj in ([0, 11] if cell == "lstm" else [0]):
                    results.append((f"options {cell} {name} proj={proj}",
                                    options_case(cell, dtype, proj, g)))
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            for label, ok in results:
                print(("ok    " if ok else "WRONG ") + label, flush=True)
                if not ok:
                    failed.append(label)
    print(f"sanitizer_cases: {len(failed)} wrong result(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
