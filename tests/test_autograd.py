"""Autograd beyond the first-order backward, on every CPU-runnable backend
(second derivatives, forward mode, torch.func):

- second derivatives (``create_graph=True``): gradgradcheck of the ops, the
  gradient penalty against torch.nn, and the first-order gradients
  of the differentiable path equal to the kernels' own backward;
- forward-mode AD (dual tensors) and the torch.func transforms (jvp, grad,
  jacrev, vmap) against torch.nn (vmap, which torch.nn's modules lack, against
  a loop);
- in-place edits of the outputs (a residual ``out += x``) train as with
  torch.nn, and in the common case (no edit) the saved output is not copied.
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

import rnnkern
from rnnkern import ops
from conftest import (CELLS, TRITON_INTERPRET, assert_close, generator, randn, recurrence_inputs,
                      rnnkern_module, run_recurrence, step_inputs, torch_module)

# Every backend that runs on the CPU: the CUDA code through the emulated device.
BACKENDS = (["reference", "cpu"] + (["triton"] if TRITON_INTERPRET else [])
            + (["cuda_emulated"] if ops.WITH_CUDA_EMULATION else []))
TORCH_CELLS = [c for c in CELLS if c != "gru_reset_before"]
CELL_CLASSES = {"rnn_tanh": (nn.RNNCell, rnnkern.RNNCell, {}),
                "rnn_relu": (nn.RNNCell, rnnkern.RNNCell, {"nonlinearity": "relu"}),
                "gru": (nn.GRUCell, rnnkern.GRUCell, {}),
                "lstm": (nn.LSTMCell, rnnkern.LSTMCell, {})}


def twins(cell, backend, input_size=5, hidden_size=7, **kwargs):
    """torch.nn's module and rnnkern's on the same float64 weights."""
    torch.manual_seed(len(cell) + 7 * len(backend))
    theirs = torch_module(cell, input_size, hidden_size, dtype=torch.float64, **kwargs)
    ours = rnnkern_module(cell, input_size, hidden_size, dtype=torch.float64, backend=backend, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def cell_twins(cell, backend, input_size=5, hidden_size=7):
    theirs_cls, ours_cls, kw = CELL_CLASSES[cell]
    torch.manual_seed(len(cell) + 3 * len(backend))
    theirs = theirs_cls(input_size, hidden_size, dtype=torch.float64, **kw)
    ours = ours_cls(input_size, hidden_size, dtype=torch.float64, backend=backend, **kw)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def first(result):
    """The output (sequence modules) or h (cells) of a module's result."""
    return result[0] if isinstance(result, tuple) else result


def recurrence_fn(cell, backend, names, args, lengths, reverse):
    def f(*tensors):
        a = dict(args) | dict(zip(names, tensors))
        return tuple(t for t in run_recurrence(backend, cell, a, lengths, reverse) if t is not None)
    return f


# ------------------------------------------------------ second derivatives ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,variant", [(c, v) for c in CELLS for v in ("plain", "lengths-reverse")]
                         + [("lstm", "proj")])
def test_recurrence_gradgradcheck(cell, backend, variant):
    proj = 3 if variant == "proj" else 0
    args = recurrence_inputs(cell, 4, 3, 4, proj=proj, requires_grad=True, key=("gradgrad", variant))
    lengths = torch.tensor([4, 1, 3]) if variant == "lengths-reverse" else None
    names = [n for n, t in args.items() if t is not None]
    f = recurrence_fn(cell, backend, names, args, lengths, variant == "lengths-reverse")
    assert torch.autograd.gradgradcheck(f, [args[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_step_gradgradcheck(cell, backend):
    args = step_inputs(cell, 3, 5, 4, requires_grad=True, key=("gradgrad",))
    names = [n for n, t in args.items() if t is not None]

    def f(*tensors):
        a = dict(args) | dict(zip(names, tensors))
        return tuple(t for t in ops.step(cell, *a.values(), backend=backend) if t is not None)

    assert torch.autograd.gradgradcheck(f, [args[n] for n in names], fast_mode=True)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("cell", CELLS)
def test_differentiable_backward_equals_kernel_backward(cell, backend):
    """create_graph=True takes the differentiable path; its first-order
    gradients are the kernels' own, so switching paths changes no number."""
    args = recurrence_inputs(cell, 5, 3, 4, requires_grad=True, key=("paths",))
    lengths = torch.tensor([5, 2, 4])
    names = [n for n, t in args.items() if t is not None]
    out = [t for t in run_recurrence(backend, cell, args, lengths, True) if t is not None]
    g = generator("paths-cotangent", cell)
    cot = [randn(g, *o.shape) for o in out]
    plain = torch.autograd.grad(out, [args[n] for n in names], cot, retain_graph=True)
    graph = torch.autograd.grad(out, [args[n] for n in names], cot, create_graph=True)
    for n, a, b in zip(names, graph, plain):
        assert a.requires_grad, n
        assert_close(a, b, what=f"grad {n}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_gradient_penalty_matches_torch_nn(cell, backend):
    """A gradient penalty's |d penalty / dW_hh| (once 0.0 where torch.nn gives 1.62)."""
    theirs, ours = twins(cell, backend, num_layers=2, bidirectional=True)
    x = randn(generator("penalty", cell), 4, 3, 5, requires_grad=True)
    results = []
    for m in (theirs, ours):
        out, _ = m(x)
        g, = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        penalty = g.pow(2).sum()
        results.append([penalty, *torch.autograd.grad(penalty, [x, *m.parameters()])])
    assert results[0][2].abs().max() > 0  # the case is not degenerate
    for k, (got, want) in enumerate(zip(*results)):
        assert_close(got, want, what=f"{cell} penalty result {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_cell_gradient_penalty_matches_torch_nn(cell, backend):
    theirs, ours = cell_twins(cell, backend)
    g = generator("cell-penalty", cell)
    x = randn(g, 3, 5, requires_grad=True)
    state = (randn(g, 3, 7), randn(g, 3, 7)) if cell == "lstm" else randn(g, 3, 7)
    results = []
    for m in (theirs, ours):
        g, = torch.autograd.grad(first(m(x, state)).pow(2).sum(), x, create_graph=True)
        penalty = g.pow(2).sum()
        results.append(list(torch.autograd.grad(penalty, [x, *m.parameters()])))
    assert results[0][2].abs().max() > 0
    for k, (got, want) in enumerate(zip(*results)):
        assert_close(got, want, what=f"{cell} cell penalty gradient {k}")


# ------------------------------------------- forward mode and torch.func ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_forward_mode_ad_matches_torch_nn(cell, backend):
    theirs, ours = twins(cell, backend, num_layers=2)
    g = generator("fwad", cell)
    x, tangent = randn(g, 4, 3, 5), randn(g, 4, 3, 5)
    results = []
    for m in (theirs, ours):
        with fwAD.dual_level():
            out, hidden = m(fwAD.make_dual(x, tangent))
            results.append([fwAD.unpack_dual(t).tangent
                            for t in (out, *(hidden if isinstance(hidden, tuple) else (hidden,)))])
    assert results[0][0].abs().max() > 0
    for k, (got, want) in enumerate(zip(*results)):
        assert_close(got, want, what=f"{cell} tangent {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_func_jvp_of_cells_matches_torch_nn(cell, backend):
    """torch.func.jvp through the cells (once a silent 0.0 through LSTMCell)."""
    theirs, ours = cell_twins(cell, backend)
    g = generator("jvp", cell)
    x, hx, tx = randn(g, 3, 5), randn(g, 3, 7), randn(g, 3, 5)
    state = (hx, randn(g, 3, 7)) if cell == "lstm" else hx
    results = [torch.func.jvp(lambda x, m=m: m(x, state), (x,), (tx,)) for m in (theirs, ours)]
    assert torch.utils._pytree.tree_leaves(results[0][1])[0].abs().max() > 0
    for k, (got, want) in enumerate(zip(torch.utils._pytree.tree_leaves(results[1]),
                                        torch.utils._pytree.tree_leaves(results[0]))):
        assert_close(got, want, what=f"{cell} jvp result {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_func_grad_and_jacrev_over_functional_call_match_torch_nn(cell, backend):
    theirs, ours = twins(cell, backend, bidirectional=True)
    x = randn(generator("func", cell), 3, 2, 5)

    def loss(params, m):
        return torch.func.functional_call(m, params, (x,))[0].pow(2).sum()

    def output(x_, m):
        return m(x_)[0]

    for transform in ("grad", "jacrev"):
        got, want = [(torch.func.grad(loss)(dict(m.named_parameters()), m) if transform == "grad"
                      else torch.func.jacrev(output)(x, m)) for m in (ours, theirs)]
        for k, (a, b) in enumerate(zip(torch.utils._pytree.tree_leaves(got),
                                       torch.utils._pytree.tree_leaves(want))):
            assert_close(a, b, what=f"{cell} {transform} result {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_vmap_equals_a_loop(cell, backend):
    """torch.vmap over a batch of sequences (torch.nn's modules have no
    batching rule: the loop over torch.nn is the reference)."""
    theirs, ours = twins(cell, backend)
    xs = randn(generator("vmap", cell), 2, 4, 3, 5)
    got = torch.vmap(lambda x: ours(x)[0])(xs)
    want = torch.stack([theirs(x)[0] for x in xs])
    assert_close(got, want, what=f"{cell} vmap")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_batched_grad_outputs_as_torch_nn_s(cell, backend):
    """A forward outside any transform, its backward under vmap: ``is_grads_batched``
    (what ``torch.autograd.functional.jacobian(vectorize=True)`` and gradcheck's
    ``check_batched_grad`` run), through the kernels' registered backward, sequence
    module and cell, against torch.nn's on the same vectors."""
    for theirs, ours, x in [(*twins(cell, backend, num_layers=2), randn(generator("bgrad", cell), 4, 3, 5)),
                            (*cell_twins(cell, backend), randn(generator("bgrad-cell", cell), 3, 5))]:
        results = []
        for m in (theirs, ours):
            xg = x.clone().requires_grad_()
            y = first(m(xg))
            vs = randn(generator("bgrad-v", cell), 3, *y.shape)
            results.append(torch.autograd.grad(y, [xg] + list(m.parameters()), vs, is_grads_batched=True))
        for (name, _), want, got in zip([("input", None)] + list(theirs.named_parameters()), *results):
            assert got.shape[0] == 3
            assert_close(got, want, what=f"{cell} {type(ours).__name__} batched grad of {name}")


@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_vmap_over_an_ensemble_of_modules(cell):
    """An ensemble (torch.func.stack_module_state + functional_call under vmap,
    as RL critics ensembles run): outputs and each member's parameter
    gradients equal those of its torch.nn twin run alone (torch.nn's modules
    themselves raise: no batching rule for aten::lstm & co.)."""
    members = [twins(cell, "cpu", num_layers=2, bidirectional=True) for _ in range(3)]
    for k, (theirs, ours) in enumerate(members):  # distinct members
        with torch.no_grad():
            for p in theirs.parameters():
                p.mul_(1 + 0.1 * k)
        ours.load_state_dict(theirs.state_dict())
    ours_all = [o for _, o in members]
    params, buffers = torch.func.stack_module_state(ours_all)
    base = rnnkern_module(cell, 5, 7, dtype=torch.float64, backend="cpu", num_layers=2,
                          bidirectional=True).to("meta")
    x = randn(generator("ensemble", cell), 4, 3, 5)

    def output(p, b):
        return torch.func.functional_call(base, (p, b), (x,))[0]

    got = torch.func.vmap(output)(params, buffers)
    grads = torch.func.vmap(torch.func.grad(lambda p, b: output(p, b).pow(2).sum()))(params, buffers)
    for k, (theirs, _) in enumerate(members):
        out = theirs(x)[0]
        assert_close(got[k], out, what=f"{cell} member {k} output")
        out.pow(2).sum().backward()
        for name, p in theirs.named_parameters():
            assert_close(grads[name][k], p.grad, what=f"{cell} member {k} grad {name}")


# ---------------------------------------------------- in-place output edits ----

# The pooled size puts the output in the CPU backend's buffer cache (>= 1 MiB);
# the Triton interpreter runs the small size only (minutes at the large one).
@pytest.mark.parametrize("backend,size", [(b, "small") for b in BACKENDS]
                         + [("reference", "pooled"), ("cpu", "pooled")])
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_in_place_residual_on_output_trains_like_torch_nn(cell, backend, size):
    """``out += x`` after the module, then backward: torch.nn trains."""
    T, B, H = (4, 3, 5) if size == "small" else (64, 64, 40)  # 64*64*40*8 B = 1.25 MiB
    theirs, ours = twins(cell, backend, input_size=H, hidden_size=H)
    g = generator("inplace", cell, size)
    x = randn(g, T, B, H, requires_grad=True)
    cot = randn(g, T, B, H)
    results = []
    for m in (theirs, ours):
        out, hidden = m(x)
        out += x
        out.mul_(2)
        if isinstance(hidden, tuple):
            hidden[1].add_(1)  # c_n edited too
        loss = (out * cot).sum() + sum(h.sum() for h in (hidden if isinstance(hidden, tuple) else (hidden,)))
        results.append([out.detach(), *torch.autograd.grad(loss, [x, *m.parameters()])])
    for k, (got, want) in enumerate(zip(*results)):
        assert_close(got, want, what=f"{cell} in-place result {k}")


def _edited_after_forward(m, cell_call: bool, target: str, grads_of: str, edit: bool, seed: str):
    """m's forward on float64 data, then (with ``edit``) ``target`` -- the input, a
    part of hx, or a parameter -- scaled in place, then the gradients of
    ``grads_of`` ("all": input, hx and parameters; "parameters": those alone).
    Returns the gradients, or None where the backward raised torch's in-place error."""
    g = generator("edited-after-forward", seed)
    lstm = isinstance(m, (nn.LSTM, nn.LSTMCell))
    x = randn(g, 3, 5) if cell_call else randn(g, 4, 3, 5)
    layers = () if cell_call else (m.num_layers * (2 if m.bidirectional else 1),)
    proj = getattr(m, "proj_size", 0) or m.hidden_size
    state = {"x": x, "h": randn(g, *layers, 3, proj)}
    if lstm:
        state["c"] = randn(g, *layers, 3, m.hidden_size)
    leaves = dict(m.named_parameters())
    if grads_of == "all":
        for t in state.values():
            t.requires_grad_()
        leaves = state | leaves
    # An edit of a leaf that requires grad is refused by torch itself: the forward
    # reads a copy, which the edit then changes (the saved tensor is the copy).
    used = {k: (t * 1 if t.requires_grad else t) for k, t in state.items()}
    result = m(used["x"], (used["h"], used["c"]) if lstm else used["h"])
    outputs = torch.utils._pytree.tree_leaves(result)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).pow(2).sum() for o in outputs)
    if edit:
        with torch.no_grad():
            (used[target] if target in used else leaves[target]).mul_(2)
    try:
        return torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        return None


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"]
                         + (["triton"] if "triton" in BACKENDS else []))
@pytest.mark.parametrize("module", ["LSTM", "LSTM-proj-bi", "GRU-2", "RNN", "LSTMCell", "GRUCell", "RNNCell"])
def test_in_place_edit_of_a_saved_tensor_raises_or_leaves_the_gradients_right(module, backend):
    """Whatever a forward read -- the input, a part of hx, a weight or a bias -- edited
    in place before the backward (an optimizer's step between the two, a reused input
    buffer): the backward raises torch's in-place error, or its gradients are those of
    the forward as it ran, never gradients computed from the edited value.  With all
    leaves requiring grad, and with the parameters alone (where the input and hx enter
    only the weight gradients)."""
    if backend == "triton" and module not in ("LSTM", "GRUCell"):
        pytest.skip("the Triton interpreter takes seconds a launch: two configurations of it")
    kwargs = {"LSTM-proj-bi": dict(proj_size=3, bidirectional=True), "GRU-2": dict(num_layers=2)}.get(module, {})
    cls = getattr(rnnkern, module.split("-")[0])
    torch.manual_seed(5)
    m = cls(5, 4, backend=backend, dtype=torch.float64, **kwargs)
    cell_call = isinstance(m, nn.RNNCellBase)
    targets = ["x", "h"] + (["c"] if isinstance(m, (nn.LSTM, nn.LSTMCell)) else []) + [n for n, _ in m.named_parameters()]
    checked = raised = 0
    for grads_of in ("all", "parameters"):
        for target in targets:
            seed = f"{module}-{target}-{grads_of}"
            got = _edited_after_forward(m, cell_call, target, grads_of, True, seed)
            # the edit undone for the run without it
            with torch.no_grad():
                if target in dict(m.named_parameters()):
                    dict(m.named_parameters())[target].div_(2)
            if got is None:
                raised += 1
                continue
            want = _edited_after_forward(m, cell_call, target, grads_of, False, seed)
            checked += 1
            for k, (a, b) in enumerate(zip(got, want)):
                assert (a is None) == (b is None), (target, grads_of, k)
                if a is not None:
                    assert_close(a, b, what=f"{module} {backend}: gradient {k} after {target} was edited "
                                            f"(grads of {grads_of})")
    # Each edit either raised torch's error (any other error propagates) or was compared.
    assert raised + checked == 2 * len(targets)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"]
                         + (["triton"] if "triton" in BACKENDS else []))
@pytest.mark.parametrize("module", ["LSTM", "LSTM-proj-bi", "GRU-2", "RNN-relu", "LSTMCell", "GRUCell", "RNNCell"])
def test_bias_edited_between_forward_and_backward_trains_as_torch_nn(module, backend):
    """An optimizer's step on a bias between forward and backward: torch.nn's graph
    saves no bias (its gradients never read one), so it trains, with the gradients of
    the forward as it ran; rnnkern's first-order backward does not read the biases
    either and gives torch.nn's gradients.  The double backward (create_graph=True)
    recomputes the gates from the biases: there the edit raises torch's in-place error,
    naming the bias, rather than differentiating a forward that never ran."""
    if backend == "triton" and module not in ("LSTM", "GRUCell"):
        pytest.skip("the Triton interpreter takes seconds a launch: two configurations of it")
    name = module.split("-")[0]
    kwargs = {"LSTM-proj-bi": dict(proj_size=3, bidirectional=True), "GRU-2": dict(num_layers=2),
              "RNN-relu": dict(nonlinearity="relu")}.get(module, {})
    torch.manual_seed(11)
    theirs = getattr(nn, name)(5, 4, dtype=torch.float64, **kwargs)
    ours = getattr(rnnkern, name)(5, 4, backend=backend, dtype=torch.float64, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    biases = [n for n, _ in theirs.named_parameters() if n.startswith("bias")]
    assert biases
    for bias in biases:
        g = generator("bias-edit", module, bias)
        x = randn(g, 3, 5) if name.endswith("Cell") else randn(g, 4, 3, 5)
        grads = {}
        for who, m in (("torch.nn", theirs), ("rnnkern", ours)):
            xi = x.clone().requires_grad_()
            out = first(m(xi))
            loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).pow(2).sum()
            param = m.get_parameter(bias)
            with torch.no_grad():
                param.mul_(2)
            grads[who] = torch.autograd.grad(loss, [xi, *m.parameters()])
            with torch.no_grad():
                param.div_(2)
        for k, (a, b) in enumerate(zip(grads["rnnkern"], grads["torch.nn"])):
            assert_close(a, b, what=f"{module} {backend}: gradient {k} after {bias} was edited")
        # The double backward reads the biases: the edit is refused there.
        xi = x.clone().requires_grad_()
        out = first(ours(xi))
        param = ours.get_parameter(bias)
        with torch.no_grad():
            param.mul_(2)
        try:
            if backend == "reference":  # plain torch ops: torch.nn's graph, no bias saved
                torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
            else:
                with pytest.raises(RuntimeError, match=f"modified by an inplace operation: the bias b_"):
                    torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        finally:
            with torch.no_grad():
                param.div_(2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", TORCH_CELLS)
def test_in_place_edit_of_cell_state_trains_like_torch_nn(cell, backend):
    """h += x on a cell's result.  torch.nn's RNNCell itself raises here (its
    tanh saves its output): where torch.nn raises, the reference backend, which
    is torch.nn's formulation, raises the same error; the kernels train."""
    theirs, ours = cell_twins(cell, backend, input_size=7)
    g = generator("cell-inplace", cell)
    x = randn(g, 3, 7, requires_grad=True)
    results = []
    for m in (theirs, ours):
        def run():
            result = m(x)
            h = first(result)
            h += x
            if isinstance(result, tuple):
                result[1].mul_(3)
            return [h.detach(), *torch.autograd.grad(sum(t.sum() for t in torch.utils._pytree.tree_leaves(result)),
                                                     [x, *m.parameters()])]
        if cell.startswith("rnn") and (m is theirs or backend == "reference"):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run()
            continue
        results.append(run())
    if len(results) == 2:
        for k, (got, want) in enumerate(zip(*results)):
            assert_close(got, want, what=f"{cell} cell in-place result {k}")
    elif results:  # torch.nn raised: ours against the same edit made on a copy of torch.nn's output
        result = theirs(x)
        h = first(result) + x
        want = [h.detach(), *torch.autograd.grad(h.sum(), [x, *theirs.parameters()])]
        for k, (got, w) in enumerate(zip(results[0], want)):
            assert_close(got, w, what=f"{cell} cell in-place result {k}")


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_saved_output_is_not_copied_without_an_edit(cell):
    """The backward keeps a copy-on-write alias of the output: the kernels read
    it through const pointers, so without an in-place edit no copy is made, in
    a two-layer model whose second layer reads the first layer's output."""
    m = rnnkern_module(cell, 6, 8, num_layers=2, backend="cpu", dtype=torch.float64)
    x = randn(generator("cow", cell), 5, 3, 6, requires_grad=True)
    saved = []

    def pack(t):  # sees every tensor a backward node saves, the C++ formulas' too
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = m(x)
    # The layers' saved outputs: [T, B, H] copy-on-write aliases.
    outputs = [t for t in saved if t.shape == (5, 3, 8) and torch._C._is_cow_tensor(t)]
    assert len(outputs) == 2
    out.sum().backward(retain_graph=True)
    for t in outputs:
        assert torch._C._is_cow_tensor(t)
    assert torch._C._is_cow_tensor(out)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("B", [1, 5])
def test_step_backward_returns_only_what_is_needed(backend, cell, B):
    """step_backward's ``needs``: the outputs asked for equal the full call's,
    the others are empty [0] tensors (as the fake implementation says, so that
    compiled graphs see the shapes the kernels return); and a cell whose input
    needs no gradient still trains its weights exactly."""
    family = ops._op_family(backend)
    s = step_inputs(cell, B, 6, 7, key=("needs", backend))
    h, c, ws = family.step(cell, *s.values())
    g = generator("needs", cell, B)
    gh, gc = randn(g, B, 7), (randn(g, B, 7) if cell == "lstm" else None)
    args = (cell, gh, gc, s["x"], s["h"], s["c"], s["w_ih"], s["w_hh"], h, ws)
    full = family.step_backward(*args)
    for needs in (0b0011000, 0b0000001, 0b1100110):
        got = family.step_backward(*args, None, needs)
        for i, (a, b) in enumerate(zip(got, full)):
            if needs >> i & 1:
                assert_close(a, b, what=f"output {i}")
            else:
                assert a.numel() == 0, f"output {i} not asked for"
    torch.library.opcheck(family.step_backward.default, args + (None, 0b0011000))
    # Through autograd: weights only, against the reference.
    w = {k: (v.detach().requires_grad_() if k.startswith(("w_", "b_")) and v is not None else v)
         for k, v in s.items()}
    wr = {k: (v.detach().requires_grad_() if k.startswith(("w_", "b_")) and v is not None else v)
          for k, v in s.items()}
    outs = [t for t in ops.step(cell, *w.values(), backend=backend) if t is not None]
    want = [t for t in ops.step(cell, *wr.values(), backend="reference") if t is not None]
    params = [w[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")]
    params_r = [wr[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")]
    got = torch.autograd.grad(sum(o.sum() for o in outs), params)
    ref = torch.autograd.grad(sum(o.sum() for o in want), params_r)
    for a, b in zip(got, ref):
        assert_close(a, b, what="weight gradient")
