"""Inputs and expected values for the CUDA backend's tests of the step options
(per-step resets, zoneout) and the LayerNorm cell (lstm_ln), shared by tests/test_cuda_emulated.py
(the emulated device) and tests/test_cuda.py (their GPU twins).  Not a test
module: the acceptance matrix of every backend is tests/test_options.py, whose
input builder this extends with the variants the CUDA kernels have paths for.
"""
from __future__ import annotations

import torch

from rnnkern import ops, reference
from conftest import generator, randn
from test_options import case_inputs, outputs_and_grads, run  # noqa: F401  (re-exported)

CASES = [(cell, 0) for cell in reference.CELLS] + [("lstm", 3), ("lstm_ln", 0)]
CASE_IDS = [f"{c}-proj{p}" if p else c for c, p in CASES]
#: Variants (option_inputs); "plain" only for lstm_ln (without options it is a new cell).
VARIANTS = ["resets", "resets-reverse", "zoneout-lengths", "zoneout-eval-reverse", "every-reset",
            "all-lengths-reverse"]
ALL = [(c, p, v) for c, p in CASES for v in VARIANTS] + [("lstm_ln", 0, "plain")]
ALL_IDS = [f"{c}-proj{p}-{v}" if p else f"{c}-{v}" for c, p, v in ALL]
INPUTS = ("xproj", "h0", "c0", "w_hh", "b_ih", "b_hh", "w_hr")


def option_inputs(cell, proj, variant, T=5, B=3, H=4, dtype=torch.float64, requires_grad=False,
                  device="cpu", key=()):
    """test_options' inputs with every option (a training mask, lengths, reverse),
    then cut down to the variant:
      resets / resets-reverse   resets alone, forward / reverse, no lengths
      zoneout-lengths           a training mask and lengths, forward
      zoneout-eval-reverse      an evaluation mask (strides 0, 0, 1), reverse
      every-reset               every position resets; row 0's mask all 1, row 1's all 0
      all-lengths-reverse       everything (the matrix's float32 case)
      plain                     none (lstm_ln)
    Returns (tensors, constants) on `device` (lengths stay on the CPU)."""
    tensors, c = case_inputs(cell, proj, "all-lengths-reverse", T=T, B=B, H=H, dtype=dtype,
                             key=("cuda-options", variant, *key))
    c = dict(c)
    if variant in ("resets", "resets-reverse"):
        c.update(zoneout=None, lengths=None, reverse=variant == "resets-reverse")
    elif variant == "zoneout-lengths":
        c.update(resets=None, reverse=False)
    elif variant == "zoneout-eval-reverse":
        Z = c["zoneout"].shape[2]
        c.update(resets=None, lengths=None, reverse=True,
                 zoneout=torch.full((Z,), 0.3, dtype=dtype).expand(T, B, Z))
    elif variant == "every-reset":
        c["resets"] = torch.ones(T, B, dtype=torch.bool)
        c["zoneout"][:, 0] = 1  # row 0 keeps h0 (c0) throughout
        c["zoneout"][:, 1] = 0
        c.update(lengths=None)
    elif variant == "plain":
        c.update(resets=None, zoneout=None, lengths=None, reverse=False)
    else:
        assert variant == "all-lengths-reverse", variant
    tensors = {n: None if t is None else t.to(device).requires_grad_(requires_grad)
               for n, t in tensors.items()}
    for n in ("resets", "zoneout"):
        if c[n] is not None:
            c[n] = c[n].to(device)
    return tensors, c


def expected_workspace(cell, t, c):
    """The workspace csrc/cells.h specifies (the layout every backend shares),
    computed row by row in float64 on the CPU from the formulas: lstm_ln's
    i f g o, c (after zoneout), x^ (4 blocks), h^ (4), c^ and the reciprocal
    standard deviations of x W_ih^T, h W_hh^T, c~; the LSTM's gates and
    zoned c; the RNN's candidate (with zoneout); zeros at padding positions.
    Returns (workspace, output): the output ties this loop to the reference."""
    t = {n: None if v is None else v.detach().double().cpu() for n, v in t.items()}
    c = {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in c.items()}
    xproj, h0, c0, w_hh, b_ih, b_hh = (t[n] for n in INPUTS[:6])
    T, B = xproj.shape[:2]
    H = h0.shape[1]
    W = reference.workspace_size(cell, H, zoneout=c["zoneout"] is not None)
    ws, out = torch.zeros(T, B, W, dtype=torch.float64), torch.zeros(T, B, H, dtype=torch.float64)
    lens = c["lengths"] if c["lengths"] is not None else torch.full((B,), T)

    def norm(v):
        rstd = 1 / torch.sqrt(v.var(unbiased=False) + reference.LN_EPS)
        return (v - v.mean()) * rstd, rstd

    for b in range(B):
        n = int(lens[b])
        h, cs = h0[b], (c0[b] if c0 is not None else None)
        for s in range(n):
            p = n - 1 - s if c["reverse"] else s
            if c["resets"] is not None and c["resets"][p, b]:
                h, cs = h0[b], (c0[b] if c0 is not None else None)
            m = (c["zoneout"][p, b].double() if c["zoneout"] is not None
                 else torch.zeros(2 * H, dtype=torch.float64))
            if cell == "lstm_ln":
                ln = t["ln"]
                xhat, rx = norm(xproj[p, b])
                hhat, rh = norm(h @ w_hh.t())
                pre = xhat * ln[:4 * H] + hhat * ln[4 * H:8 * H] + b_ih + b_hh
                i, f, g, o = pre.chunk(4)
                i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
                cc = f * cs + i * g
                chat, rc = norm(cc)
                hh = o * torch.tanh(chat * ln[8 * H:9 * H] + ln[9 * H:])
                c_new = m[H:] * cs + (1 - m[H:]) * cc
                stats = torch.stack([rx, rh, rc])
                ws[p, b] = torch.cat([i, f, g, o, c_new, xhat, hhat, chat, stats])
            elif cell == "lstm":
                i, f, g, o = (xproj[p, b] + b_ih + h @ w_hh.t() + b_hh).chunk(4)
                i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
                cc = f * cs + i * g
                hh = o * torch.tanh(cc)
                c_new = m[H:] * cs + (1 - m[H:]) * cc
                ws[p, b] = torch.cat([i, f, g, o, c_new])
            else:
                assert cell == "rnn_tanh" and c["zoneout"] is not None, cell
                hh = torch.tanh(xproj[p, b] + b_ih + h @ w_hh.t() + b_hh)
                c_new = None
                ws[p, b] = hh
            h = m[:H] * h + (1 - m[:H]) * hh
            cs = c_new
            out[p, b] = h
    return ws, out


def ln_step_inputs(B, I, H, dtype=torch.float64, device="cpu", key=()):
    """Arguments of the lstm_ln step (x, h, c, w_ih, w_hh, b_ih, b_hh, ln)."""
    g = generator("cuda-ln-step", B, I, H, *key)
    s = H ** -0.5
    a = dict(x=randn(g, B, I), h=randn(g, B, H, scale=0.5), c=randn(g, B, H, scale=0.5),
             w_ih=randn(g, 4 * H, I, scale=s), w_hh=randn(g, 4 * H, H, scale=s),
             b_ih=randn(g, 4 * H, scale=s), b_hh=randn(g, 4 * H, scale=s),
             ln=1 + 0.3 * randn(g, 10 * H))
    return {n: v.to(device=device, dtype=dtype) for n, v in a.items()}


def ln_step_results(backend, a, key=()):
    """h, c and the gradient of every argument of the lstm_ln step."""
    h, c = ops.step("lstm_ln", *(a[n] for n in ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")),
                    backend=backend, ln=a["ln"])
    g = generator("cuda-ln-step-cot", *key)
    loss = sum((o * randn(g, *o.shape, dtype=o.dtype).to(o.device)).sum() for o in (h, c))
    return [h, c, *torch.autograd.grad(loss, list(a.values()))]
