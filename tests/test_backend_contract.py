"""The contract every backend keeps, over a ``backend`` parameter.

One test per clause, run on every backend this machine can run:

- ``reference`` (the plain-PyTorch formulas; gradcheck only) and ``cpu``;
- ``cuda_emulated`` when rnnkern was built with the emulated CUDA device
  (RNNKERN_CUDA_EMULATION=1), else skipped with the reason;
- ``triton-loop``, ``triton-spread`` and ``triton-step`` (the in-kernel time
  loop, the spread kernels and the per-step kernels: conftest.force_triton_path)
  under Triton's interpreter without a GPU (conftest.py sets
  TRITON_INTERPRET=1), on CUDA tensors with one;
- ``cuda`` (marker ``gpu``: skipped with the reason without a GPU).

The clauses: float64 gradcheck of the recurrence (outputs and final states,
lengths and reverse) and of the step; torch.library.opcheck of the ops; no
workspace without grad; empty sizes.  Each backend keeps the sizes its own
file used (the interpreter and the emulated device cost ~1000x a real run, so
theirs are smaller); the per-backend files keep what only their backend has.
"""
from __future__ import annotations

import os

import pytest
import torch

from rnnkern import ops, reference
from conftest import (CELLS, HAS_GPU, assert_close, differentiable, force_triton_path,
                      generator, randn, recurrence_inputs, run_recurrence, step_inputs,
                      to_device)

if (not ops.WITH_CUDA_EMULATION and os.environ.get("RNNKERN_REQUIRE_CUDA_EMULATION") == "1"):
    raise RuntimeError("RNNKERN_REQUIRE_CUDA_EMULATION=1 but rnnkern was built without the "
                       "emulated CUDA device: rebuild with RNNKERN_CUDA_EMULATION=1")

TRITON_DEVICE = "cuda" if HAS_GPU else "cpu"
NO_EMU = pytest.mark.skip(reason="rnnkern was built without the emulated CUDA device "
                                 "(RNNKERN_CUDA_EMULATION=1)")

#: backend parameter -> (ops backend name, device of its tensors, marks)
BACKENDS = {
    "reference": ("reference", "cpu", ()),
    "cpu": ("cpu", "cpu", ()),
    "cuda_emulated": ("cuda_emulated", "cpu", () if ops.WITH_CUDA_EMULATION else (NO_EMU,)),
    "triton-loop": ("triton", TRITON_DEVICE, ()),
    "triton-spread": ("triton", TRITON_DEVICE, ()),
    "triton-step": ("triton", TRITON_DEVICE, ()),
    "cuda": ("cuda", "cuda", (pytest.mark.gpu,)),
}


def use(backend, monkeypatch):
    """(ops backend name, device) of a backend parameter; a triton-* parameter
    forces its path for the duration of the test."""
    if backend.startswith("triton-"):
        force_triton_path(monkeypatch, backend.split("-", 1)[1])
    name, device, _ = BACKENDS[backend]
    return name, device


def param(backend, *values, id):
    return pytest.param(backend, *values, marks=BACKENDS[backend][2], id=f"{backend}-{id}")


def case_id(cell, proj):
    return f"{cell}-proj{proj}" if proj else cell


def gradcheck_flat(f, tensors):
    """float64 gradcheck of f(*tensors) in fast mode, with respect to all the
    tensors at once (one flat vector) and of all the outputs at once (one flat
    vector): under Triton's interpreter each evaluation runs the kernels, and
    this needs three forward and two backward runs instead of two per tensor
    and one per output.  (Missing output gradients go through the autograd
    formula shared with the C++ ops; test_triton.py's
    test_gradcheck_undefined_grads checks it once.)"""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).requires_grad_()
    sizes = [t.numel() for t in tensors]

    def g(v):
        outs = f(*[p.view_as(t) for p, t in zip(v.split(sizes), tensors)])
        return torch.cat([o.reshape(-1) for o in outs])

    return torch.autograd.gradcheck(g, [flat], fast_mode=True, check_undefined_grad=False)


def gradcheck(kind, f, tensors):
    """kind: "full" (torch's default), "fast" (fast mode) or "flat" (gradcheck_flat)."""
    if kind == "flat":
        return gradcheck_flat(lambda *t: tuple(x for x in f(*t)), tensors)
    return torch.autograd.gradcheck(f, tensors, fast_mode=kind == "fast")


# ------------------------------------------------------------- gradcheck ----

VARIANTS = ["plain", "reverse", "lengths", "lengths-reverse"]


def _recurrence_gradcheck_cases():
    """(backend, cell, proj, size): size = (T, B, H, H with a projection,
    lengths, reverse, input key, gradcheck kind)."""
    cases = []
    for backend in ("reference", "cpu"):
        sizes = [((T, B, 4, 6, None, False, (), "full"), f"T{T}-B{B}") for T in (1, 7) for B in (1, 3)]
        sizes += [((5, 4, 4, 6, [5, 2, 0, 4], rev, ("lengths",), "full"),
                   "lengths-" + ("reverse" if rev else "forward")) for rev in (False, True)]
        cases += [param(backend, c, p, s, id=f"{case_id(c, p)}-{i}")
                  for c, p in [(c, 0) for c in CELLS] + [("lstm", 3)] for s, i in sizes]
    for backend, T, B, H, lens, key, kind in [
            ("cuda_emulated", 4, 3, 5, [4, 0, 2], lambda v: ("emu", v), "fast"),
            ("cuda", 5, 4, 4, [5, 2, 0, 4], lambda v: (v,), "full")]:
        cases += [param(backend, c, p, (T, B, H, 6, lens if "lengths" in v else None, "reverse" in v,
                                        key(v), kind), id=f"{case_id(c, p)}-{v}")
                  for c, p in [(c, 0) for c in CELLS] + [("lstm", 3)] for v in VARIANTS]
    # Triton: reverse with lengths (one sequence full, one of one step, one
    # empty), every masking rule of the backward at once; the forward direction
    # and no lengths are checked against the reference's gradients in test_triton.
    for backend in ("triton-loop", "triton-spread", "triton-step"):
        cases += [param(backend, c, p, (3, 3, 6, 6, [3, 1, 0], True, ("gradcheck",), "flat"),
                        id=case_id(c, p))
                  for c, p in [(c, 0) for c in CELLS] + [("lstm", 5)]]
    return cases


@pytest.mark.parametrize("backend,cell,proj,size", _recurrence_gradcheck_cases())
def test_recurrence_gradcheck(backend, cell, proj, size, monkeypatch):
    """float64 gradcheck w.r.t. xproj, h0, c0 and every weight and bias, with
    non-zero random states; the checked function returns the outputs and the
    final states, so gradients flow from both; one sequence empty with lengths."""
    name, device = use(backend, monkeypatch)
    T, B, H, H_proj, lengths, reverse, key, kind = size
    args = to_device(recurrence_inputs(cell, T, B, H_proj if proj else H, proj=proj,
                                       requires_grad=True, key=key), device)
    lengths = None if lengths is None else torch.tensor(lengths)
    names = differentiable(args)

    def f(*tensors):
        out, h_n, c_n = run_recurrence(name, cell, {**args, **dict(zip(names, tensors))},
                                       lengths, reverse)
        return (out, h_n) if c_n is None else (out, h_n, c_n)

    assert gradcheck(kind, f, [args[n] for n in names])


def _step_gradcheck_cases():
    """(backend, cell, bias, size): size = (B, I, H, input key, gradcheck kind)."""
    sizes = {"reference": [((B, 3, 4, (), "full"), f"B{B}") for B in (1, 3)],
             "cpu": [((B, 3, 4, (), "full"), f"B{B}") for B in (1, 3)],
             "cuda_emulated": [((3, 7, 5, ("emu",), "fast"), "B3")],
             "triton-loop": [((3, 5, 6, ("gradcheck",), "flat"), "B3")],
             "cuda": [((3, 5, 4, (), "full"), "B3")]}
    return [param(backend, cell, bias, s, id=f"{cell}-{'bias' if bias else 'nobias'}-{i}")
            for backend, ss in sizes.items() for cell in CELLS for bias in (True, False)
            for s, i in ss]


@pytest.mark.parametrize("backend,cell,bias,size", _step_gradcheck_cases())
def test_step_gradcheck(backend, cell, bias, size, monkeypatch):
    """float64 gradcheck of one cell step w.r.t. x, h, c and every weight and bias.
    (The step op has one path in Triton: it runs once, as triton-loop.)"""
    name, device = use(backend, monkeypatch)
    B, I, H, key, kind = size
    args = to_device(step_inputs(cell, B, I, H, bias=bias, requires_grad=True, key=key), device)
    names = differentiable(args)

    def f(*tensors):
        kw = {**args, **dict(zip(names, tensors))}
        h, c = ops.step(cell, kw["x"], kw["h"], kw["c"], kw["w_ih"], kw["w_hh"], kw["b_ih"],
                        kw["b_hh"], backend=name)
        return h if c is None else (h, c)

    assert gradcheck(kind, lambda *t: (lambda r: r if isinstance(r, tuple) else (r,))(f(*t)),
                     [args[n] for n in names])


# --------------------------------------------------------------- opcheck ----

#: ops backend name -> its torch.ops namespace
NAMESPACES = {"cpu": "rnnkern", "cuda": "rnnkern", "cuda_emulated": "rnnkern_cuda_emu",
              "triton": "rnnkern_triton"}
KERNEL_BACKENDS = ["cpu", "cuda_emulated", "triton-loop", "triton-spread", "triton-step", "cuda"]


def family(name):
    if name == "cuda_emulated":
        # Its namespace is defined when rnnkern.cuda_emulated is imported, which the ops do
        # on first use: a worker whose first emulated test is here must not depend on that.
        import rnnkern.cuda_emulated  # noqa: F401
    return getattr(torch.ops, NAMESPACES[name])


def _opcheck_recurrence_cases():
    """(backend, cell, proj, size): size = (T, B, H, lengths, reverse, input key)."""
    cases = []
    for backend in ("cpu", "cuda"):
        cases += [param(backend, c, p, (4, 3, 6, [4, 1, 3] if lens else None, lens, ("opcheck",)),
                        id=f"{case_id(c, p)}-{'lengths' if lens else 'full'}")
                  for c, p in [(c, 0) for c in CELLS] + [("lstm", 4)] for lens in (False, True)]
    cases += [param("cuda_emulated", c, p, (3, 2, 5, [3, 1], True, ("emu-opcheck",)), id=case_id(c, p))
              for c, p in [("lstm", 3), ("gru", 0), ("gru_reset_before", 0), ("rnn_relu", 0)]]
    # Triton: every cell on the loop path; on the per-step path the cells with
    # two launches per step (their host code holds the most buffers).
    for backend, cells in [("triton-loop", [(c, 0) for c in CELLS] + [("lstm", 5)]),
                           ("triton-spread", [("lstm", 0), ("gru_reset_before", 0), ("lstm", 5)]),
                           ("triton-step", [("gru_reset_before", 0), ("lstm", 5)])]:
        cases += [param(backend, c, p, (3, 3, 6, [3, 1, 2], True, ("opcheck",)), id=case_id(c, p))
                  for c, p in cells]
    return cases


@pytest.mark.parametrize("backend,cell,proj,size", _opcheck_recurrence_cases())
def test_opcheck_recurrence(backend, cell, proj, size, monkeypatch):
    """Schema, fake implementation, autograd registration, no mutation or
    aliasing of inputs."""
    name, device = use(backend, monkeypatch)
    T, B, H, lengths, reverse, key = size
    args = to_device(recurrence_inputs(cell, T, B, H, proj=proj, requires_grad=True, key=key), device)
    lengths = None if lengths is None else torch.tensor(lengths)
    torch.library.opcheck(family(name).recurrence.default,
                          (cell, *args.values(), lengths, reverse, True))


def _opcheck_step_cases():
    sizes = {"cpu": (3, 5, 6, ("opcheck",)), "cuda_emulated": (2, 3, 5, ("emu-opcheck",)),
             "triton-loop": (3, 5, 6, ("opcheck",)), "cuda": (3, 5, 6, ("opcheck",))}
    return [param(backend, cell, size, id=cell) for backend, size in sizes.items() for cell in CELLS]


@pytest.mark.parametrize("backend,cell,size", _opcheck_step_cases())
def test_opcheck_step(backend, cell, size, monkeypatch):
    name, device = use(backend, monkeypatch)
    B, I, H, key = size
    args = to_device(step_inputs(cell, B, I, H, requires_grad=True, key=key), device)
    torch.library.opcheck(family(name).step.default, (cell, *args.values()))


@pytest.mark.parametrize("backend,T", [param(b, 3 if b.startswith("triton") else 4, id="gru-lstm")
                                       for b in KERNEL_BACKENDS])
def test_opcheck_backward_ops(backend, T, monkeypatch):
    name, device = use(backend, monkeypatch)
    fam = family(name)
    args = to_device(recurrence_inputs("gru", T, 3, 6, key=("opcheck-bwd",)), device)
    out, h_n, c_n, ws = fam.recurrence("gru", *args.values(), None, False, True)
    g = generator("opcheck-bwd")
    torch.library.opcheck(fam.recurrence_backward.default,
                          ("gru", randn(g, *out.shape).to(device), randn(g, *h_n.shape).to(device),
                           None, args["h0"], None, args["w_hh"], None, out, ws, None, False))
    s = to_device(step_inputs("lstm", 3, 5, 6, key=("opcheck-bwd",)), device)
    h, c, ws = fam.step("lstm", *s.values())
    torch.library.opcheck(fam.step_backward.default,
                          ("lstm", randn(g, *h.shape).to(device), randn(g, *c.shape).to(device),
                           s["x"], s["h"], s["c"], s["w_ih"], s["w_hh"], h, ws))


# ---------------------------------------------- no workspace without grad ----

@pytest.mark.parametrize("backend,T,B,H", [param(b, *((3, 2, 6) if b.startswith("triton") else (4, 2, 8)),
                                                 id="lstm") for b in KERNEL_BACKENDS])
def test_no_workspace_without_grad(backend, T, B, H, monkeypatch):
    """Inference keeps no workspace (an empty [0] tensor); training does, in the
    accumulate type (float64 here)."""
    name, device = use(backend, monkeypatch)
    args = to_device(recurrence_inputs("lstm", T, B, H), device)
    call = ("lstm", *args.values(), None, False)
    *_, ws = family(name).recurrence(*call, False)
    assert ws.numel() == 0 and ws.shape == (0,)
    *_, ws = family(name).recurrence(*call, True)
    assert ws.shape == (T, B, 5 * H) and ws.dtype == torch.float64


# ------------------------------------------------------------ empty sizes ----

def _empty_cases():
    """(backend, cell, T, B, H): no steps, no sequences, and the tiniest sizes."""
    cuda_sizes = [(0, 3, 5), (3, 0, 5), (1, 1, 5)]
    emu_sizes = [(0, 3, 4), (3, 0, 4), (2, 3, 1), (1, 1, 1)]
    sizes = {"cpu": [(c, s) for c in CELLS for s in cuda_sizes + emu_sizes],
             "cuda_emulated": [(c, s) for c in CELLS for s in emu_sizes],
             "triton-loop": [("lstm", (0, 3, 6)), ("lstm", (3, 0, 6))],
             "triton-spread": [("lstm", (0, 3, 6)), ("lstm", (3, 0, 6))],
             "triton-step": [("lstm", (0, 3, 6)), ("lstm", (3, 0, 6))],
             "cuda": [(c, s) for c in CELLS for s in cuda_sizes]}
    return [param(backend, cell, *s, id="{}-T{}-B{}-H{}".format(cell, *s))
            for backend, cs in sizes.items() for cell, s in cs]


@pytest.mark.parametrize("backend,cell,T,B,H", _empty_cases())
def test_empty_and_tiny(backend, cell, T, B, H, monkeypatch):
    """No steps or no sequences: the final states are the initial ones and the
    gradients of everything else are zero (an input the reference leaves out
    of its graph has a zero gradient); outputs and every gradient equal the
    reference's."""
    name, device = use(backend, monkeypatch)
    args = to_device(recurrence_inputs(cell, T, B, H, requires_grad=True, key=("edge",)), device)
    names = differentiable(args)
    results = []
    for b in ("reference", name):
        out = [t for t in run_recurrence(b, cell, args) if t is not None]
        g = generator("edge-cot", cell, T, B)
        loss = sum((o * randn(g, *o.shape).to(device)).sum() for o in out)
        grads = torch.autograd.grad(loss, [args[n] for n in names], allow_unused=True)
        results.append(out + [torch.zeros_like(args[n]) if gr is None else gr
                              for n, gr in zip(names, grads)])
    for i, (got, want) in enumerate(zip(results[1], results[0])):
        assert got.shape == want.shape, i
        assert_close(got, want, what=f"result {i}")


# ------------------------------------------- one step of a layer stack ----

def layers_step_inputs(cell, L, D, B, I, H, *, bias=True, batch_first=False, requires_grad=False,
                       key=()):
    """Random arguments of layers_step: input, h0, c0 and torch.nn's flat weights."""
    g = generator("layers_step", cell, L, D, B, I, H, bias, batch_first, *key)
    G = reference.gate_count(cell)
    s, rg = H ** -0.5, requires_grad
    weights = []
    for layer in range(L):
        width = I if layer == 0 else D * H
        for _ in range(D):
            weights += [randn(g, G * H, width, scale=s, requires_grad=rg),
                        randn(g, G * H, H, scale=s, requires_grad=rg)]
            if bias:
                weights += [randn(g, G * H, scale=s, requires_grad=rg) for _ in range(2)]
    return dict(input=randn(g, *((B, 1, I) if batch_first else (1, B, I)), requires_grad=rg),
                h0=randn(g, L * D, B, H, scale=0.5, requires_grad=rg),
                c0=randn(g, L * D, B, H, scale=0.5, requires_grad=rg) if cell == "lstm" else None,
                weights=weights)


def layers_by_steps(step, cell, input, h0, c0, weights, L, D, batch_first):
    """layers_step's result from one ``step(cell, x, h, c, w_ih, w_hh, b_ih, b_hh)``
    per layer and direction (what the op promises to be)."""
    per = len(weights) // (L * D)
    x = input[:, 0] if batch_first else input[0]
    h_n, c_n = [], []
    for layer in range(L):
        outs = []
        for d in range(D):
            i = layer * D + d
            w = weights[i * per:(i + 1) * per] + [None] * (4 - per)
            h, c = step(cell, x, h0[i], None if c0 is None else c0[i], *w)
            outs.append(h)
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outs, -1)
    out = x.unsqueeze(1 if batch_first else 0)
    return out, torch.stack(h_n), (torch.stack(c_n) if c0 is not None else None)


def _layers_step_cases():
    """(backend, size): size = (L, D, B, I, H, bias, batch_first, input key, gradcheck kind)."""
    forms = [(1, 1, True, False), (2, 2, True, True), (2, 1, False, False), (1, 2, False, True)]
    sizes = {"cpu": (3, 5, 4, ("lstep",), "full"), "cuda_emulated": (2, 3, 3, ("emu",), "fast"),
             "triton-loop": (2, 3, 4, ("lstep",), "flat"), "cuda": (3, 5, 4, ("lstep",), "full")}
    return [param(backend, cell, (L, D, B, I, H, bias, bf, key, kind),
                  id=f"{cell}-L{L}-D{D}-{'bias' if bias else 'nobias'}{'-bf' if bf else ''}")
            for backend, (B, I, H, key, kind) in sizes.items()
            for cell in CELLS for L, D, bias, bf in forms]


@pytest.mark.parametrize("backend,cell,size", _layers_step_cases())
def test_layers_step_is_its_steps(backend, cell, size, monkeypatch):
    """layers_step (the one-step call of a module's whole stack) gives the bits
    of the family's step op called per layer and direction, the reference's
    numbers in float64, and float64 gradcheck holds through it (its steps'
    autograd formulas)."""
    name, device = use(backend, monkeypatch)
    L, D, B, I, H, bias, batch_first, key, kind = size
    args = layers_step_inputs(cell, L, D, B, I, H, bias=bias, batch_first=batch_first, key=key)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else
            None if v is None else [w.to(device) for w in v] for k, v in args.items()}
    fam = family(name)
    got = fam.layers_step(cell, args["input"], args["h0"], args["c0"], args["weights"], L, D == 2,
                          batch_first)
    lstm = cell == "lstm"
    assert got[2].shape == ((L * D, B, H) if lstm else (0,))
    # The modules' eager call (unboxed, rnnkern._C.layers_step): the same op.
    eager = ops.run_layers_step(name, cell, args["input"], args["h0"], args["c0"],
                                args["weights"], L, D == 2, batch_first)
    assert all(torch.equal(a, b) for a, b in zip(eager, got[:3 if lstm else 2]))
    assert (eager[2] is None) == (not lstm)

    def fam_step(cell, x, h, c, *w):
        h_new, c_new, _ = fam.step(cell, x, h, c, *w)
        return h_new, c_new
    same = layers_by_steps(fam_step, cell, args["input"], args["h0"], args["c0"], args["weights"],
                           L, D, batch_first)
    ref = layers_by_steps(reference.step, cell, args["input"].cpu(), args["h0"].cpu(),
                          None if args["c0"] is None else args["c0"].cpu(),
                          [w.cpu() for w in args["weights"]], L, D, batch_first)
    for i in range(3 if lstm else 2):
        assert torch.equal(got[i], same[i]), f"result {i}: not the bits of its steps"
        assert_close(got[i].cpu(), ref[i], what=f"result {i} against the reference")

    tensors = [args["input"], args["h0"]] + ([args["c0"]] if lstm else []) + args["weights"]

    def f(*ts):
        x, h0, *rest = ts
        c0 = rest.pop(0) if lstm else None
        out, h_n, c_n = fam.layers_step(cell, x, h0, c0, list(rest), L, D == 2, batch_first)
        return (out, h_n, c_n) if lstm else (out, h_n)
    assert gradcheck(kind, f, [t.detach().requires_grad_() for t in tensors])


@pytest.mark.parametrize("backend", [param(b, id="lstm") for b in ("cpu", "cuda_emulated", "cuda")])
def test_opcheck_layers_step(backend, monkeypatch):
    """Schema, autograd (through its steps), fake tensors (by decomposition)."""
    name, device = use(backend, monkeypatch)
    args = layers_step_inputs("lstm", 2, 2, 2, 3, 4, requires_grad=True, key=("opcheck",))
    torch.library.opcheck(family(name).layers_step.default,
                          ("lstm", args["input"].to(device), args["h0"].to(device),
                           args["c0"].to(device), [w.to(device) for w in args["weights"]], 2, True,
                           False))


@pytest.mark.parametrize("change,message", [
    (dict(cell="lstm_ln"), "cell must be"),
    (dict(num_layers=0), "num_layers must be at least 1"),
    (dict(input=lambda a: a["input"].expand(2, -1, -1)), r"input must be \[1, B, I\]"),
    (dict(h0=lambda a: a["h0"][:1]), r"h0 must be \[num_layers \* directions, B, H\]"),
    (dict(c0=lambda a: None), "c0 is required"),
    (dict(c0=lambda a: a["c0"][:, :1]), "c0 must have h0's shape"),
    (dict(weights=lambda a: a["weights"][:-1]), r"weights must hold \(w_ih, w_hh"),
], ids=["cell", "layers", "input", "h0", "no-c0", "c0-shape", "weights"])
def test_layers_step_rejects_bad_arguments(change, message):
    """Each bad argument is named before any step runs."""
    a = layers_step_inputs("lstm", 2, 1, 3, 4, 5, key=("bad",))
    call = dict(cell="lstm", input=a["input"], h0=a["h0"], c0=a["c0"], weights=a["weights"],
                num_layers=2, bidirectional=False, batch_first=False)
    call.update({k: v(a) if callable(v) else v for k, v in change.items()})
    with pytest.raises(RuntimeError, match=message):
        torch.ops.rnnkern.layers_step(*call.values())


@pytest.mark.parametrize("position,value,message", [
    (2, "x", "input must be a Tensor, got str"),
    (4, 1.0, "c0 must be a Tensor, got float"),
    (5, None, "weights must be a list of Tensors"),
    (5, "weights", "weights\\[1\\] must be a Tensor, got int"),
    (6, "two", None),
], ids=["input", "c0", "weights", "weight", "num_layers"])
def test_eager_layers_step_call_rejects_bad_arguments(position, value, message):
    """rnnkern._C.layers_step (the modules' unboxed call of the op) names a bad
    argument with a TypeError, as torch.ops does."""
    from rnnkern import _C
    a = layers_step_inputs("lstm", 1, 1, 2, 3, 4, key=("bad-eager",))
    call = ["rnnkern", "lstm", a["input"], a["h0"], a["c0"], a["weights"], 1, False, False]
    call[position] = [a["weights"][0], 1] if value == "weights" else value
    with pytest.raises(TypeError, match=message):
        _C.layers_step(*call)
