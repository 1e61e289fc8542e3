"""torch.compile(fullgraph=True) of the drop-in modules, forward and backward.

Dynamo refuses every instance of torch.nn.RNN/GRU/LSTM -- subclasses such as
rnnkern's included -- unless ``torch._dynamo.config.allow_rnn`` is set
(torch/_dynamo/variables/builder.py, torch 2.14); every test here sets it.
With it, padded input (with or without ``lengths=``) and PackedSequence input
compile into one graph: the ops have fake implementations and registered
autograd, and the modules read no data-dependent sizes under compile.

Two tests go through inductor (torch.compile's default) end to end; the others
use aot_eager, which runs the same Dynamo capture (fullgraph) and AOTAutograd
forward/backward tracing without inductor's code generation, to keep CI fast.
The reference backend is a Python loop over time steps, unrolled by Dynamo:
tiny sizes only.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import rnnkern
from rnnkern import ops
from conftest import HAS_GPU, TRITON_INTERPRET, assert_close, generator, randn


@pytest.fixture(autouse=True)
def dynamo_allows_rnn():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        yield
    torch._dynamo.reset()


def leaves(result):
    return [t.data if isinstance(t, PackedSequence) else t
            for t in torch.utils._pytree.tree_leaves(result, is_leaf=lambda t: isinstance(t, PackedSequence))]


def compare_with_eager(m, make_args, backend="aot_eager", calls=1):
    """Compiled (fullgraph) and eager forward and backward agree: results and the
    gradients of the input, hx and every parameter."""
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    for k in range(calls):
        results = []
        for fn in (compiled, m):
            args, kwargs, grad_leaves = make_args(k)
            out = leaves(fn(*args, **kwargs))
            g = generator("compile-cotangent", k)
            loss = sum((o * randn(g, *o.shape, dtype=o.dtype)).sum() for o in out)
            grads = torch.autograd.grad(loss, [*grad_leaves, *m.parameters()])
            results.append(out + list(grads))
        for i, (got, want) in enumerate(zip(*results)):
            assert_close(got, want, what=f"call {k} result {i}")


def padded_args(T, B, I, hx_shapes=(), batch_first=False, lengths=None):
    def make(k):
        g = generator("compile-padded", T, B, I, k)
        x = randn(g, *((B, T, I) if batch_first else (T, B, I)), requires_grad=True)
        hx = [randn(g, *s, scale=0.5, requires_grad=True) for s in hx_shapes]
        args = (x,) if not hx else (x, tuple(hx) if len(hx) == 2 else hx[0])
        kwargs = {} if lengths is None else {"lengths": lengths}
        return args, kwargs, [x, *hx]
    return make


def packed_args(lengths_per_call, I, enforce_sorted, hx_shape=None):
    def make(k):
        lengths = torch.tensor(lengths_per_call[k])
        g = generator("compile-packed", k)
        x = randn(g, int(lengths.max()), lengths.numel(), I, requires_grad=True)
        packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
        if hx_shape is None:
            return (packed,), {}, [x]
        h = randn(g, *hx_shape, scale=0.5, requires_grad=True)
        return (packed, h), {}, [x, h]
    return make


# ---------------------------------------------------------------- CPU ops ----

def test_lstm_padded_cpu():
    m = rnnkern.LSTM(3, 6, num_layers=2, bidirectional=True, proj_size=4, batch_first=True,
                     backend="cpu", dtype=torch.float64)
    compare_with_eager(m, padded_args(5, 3, 3, [(4, 3, 4), (4, 3, 6)], batch_first=True),
                       backend="inductor")


def test_gru_lengths_cpu():
    m = rnnkern.GRU(3, 6, num_layers=2, bidirectional=True, backend="cpu", dtype=torch.float64)
    compare_with_eager(m, padded_args(5, 4, 3, lengths=torch.tensor([5, 2, 0, 4])), backend="inductor")


def test_rnn_unbatched_cpu():
    m = rnnkern.RNN(3, 6, nonlinearity="relu", backend="cpu", dtype=torch.float64)
    compare_with_eager(m, lambda k: ((randn(generator("unbatched"), 5, 3, requires_grad=True),), {}, []))


@pytest.mark.parametrize("T", [4, 1])
def test_auto_compiles_after_eager_calls_kept_a_choice(T):
    """backend="auto": an eager call first (the module keeps its choice), then the
    compiled module -- the whole sequence path and the one-step path -- agrees
    with eager, forward and backward; Dynamo traces no part of the kept choice."""
    m = rnnkern.LSTM(3, 6, num_layers=2, dtype=torch.float64)
    m(torch.randn(T, 2, 3, dtype=torch.float64))  # (only to make it choose)
    assert "_auto_kept" in m.__dict__
    compare_with_eager(m, padded_args(T, 2, 3, hx_shapes=((2, 2, 6), (2, 2, 6))))


def test_lstm_packed_unsorted_cpu_recompiles_for_new_lengths():
    """A pack's batch size comes from its permutation's shape; a second batch
    with other lengths runs through the graph's guards and still agrees."""
    m = rnnkern.LSTM(3, 6, num_layers=2, backend="cpu", dtype=torch.float64)
    compare_with_eager(m, packed_args([[5, 2, 4], [3, 6, 1]], 3, enforce_sorted=False), calls=2)


def test_gru_packed_sorted_cpu():
    m = rnnkern.GRU(3, 6, bidirectional=True, backend="cpu", dtype=torch.float64)
    compare_with_eager(m, packed_args([[5, 4, 2], [6, 3, 3]], 3, enforce_sorted=True), calls=2)


def test_gru_packed_sorted_with_hx_cpu():
    m = rnnkern.GRU(3, 6, num_layers=2, backend="cpu", dtype=torch.float64)
    compare_with_eager(m, packed_args([[5, 4, 2]], 3, enforce_sorted=True, hx_shape=(2, 3, 6)))


def test_dropout_in_training_compiles():
    """Training mode with dropout between layers (masks come from the compiled
    graph's random stream, so only shapes and the zero fraction are compared)."""
    m = rnnkern.LSTM(4, 8, num_layers=3, dropout=0.5, backend="cpu").train()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 5, 4, requires_grad=True)
    out, (h, c) = compiled(x, lengths=torch.tensor([6, 1, 3, 6, 2]))
    (out.sum() + h.sum() + c.sum()).backward()
    assert out.shape == (6, 5, 8) and x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("cls", [rnnkern.LSTMCell, rnnkern.GRUCell])
def test_cells_cpu(cls):
    m = cls(3, 6, backend="cpu", dtype=torch.float64)
    shapes = [(4, 6), (4, 6)] if cls is rnnkern.LSTMCell else [(4, 6)]

    def make(k):
        g = generator("compile-cell", k)
        x = randn(g, 4, 3, requires_grad=True)
        hx = [randn(g, *s, scale=0.5, requires_grad=True) for s in shapes]
        return (x, tuple(hx) if len(hx) == 2 else hx[0]), {}, [x, *hx]

    compare_with_eager(m, make)


# -------------------------------------------------------- other backends ----

def test_reference_padded_and_lengths():
    m = rnnkern.GRU(2, 3, bidirectional=True, reset_after=False, backend="reference",
                    dtype=torch.float64)
    compare_with_eager(m, padded_args(3, 2, 2, lengths=torch.tensor([3, 1])))


def test_reference_packed():
    m = rnnkern.LSTM(2, 3, backend="reference", dtype=torch.float64)
    compare_with_eager(m, packed_args([[3, 1]], 2, enforce_sorted=False))


def test_triton_interpreter():
    if HAS_GPU:
        pytest.skip("the interpreter runs where there is no GPU; test_triton_cuda covers the GPU")
    m = rnnkern.LSTM(2, 4, bidirectional=True, backend="triton", dtype=torch.float64)
    compare_with_eager(m, padded_args(3, 2, 2, lengths=torch.tensor([3, 1])))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends(backend):
    m = rnnkern.LSTM(8, 16, num_layers=2, bidirectional=True, backend=backend, device="cuda")
    x = torch.randn(7, 4, 8, device="cuda", requires_grad=True)
    lengths = torch.tensor([7, 3, 1, 5])
    compiled = torch.compile(m, fullgraph=True)
    got = compiled(x, lengths=lengths)
    want = m(x, lengths=lengths)
    for a, b in zip(leaves(got), leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    sum(t.sum() for t in leaves(got)).backward()
    assert x.grad is not None


# ------------------------------------------------------- the Dynamo flag ----

@pytest.mark.parametrize("make", [lambda: rnnkern.GRU(3, 4, backend="cpu"), lambda: torch.nn.GRU(3, 4)],
                         ids=["rnnkern", "torch.nn"])
def test_dynamo_refuses_rnn_modules_without_allow_rnn(make):
    """Why the flag is needed: Dynamo's isinstance check on torch.nn.RNN/GRU/LSTM,
    the same for torch.nn's modules and rnnkern's (rnnkern leaves Dynamo as it
    is).  When a torch release lifts it (pytorch PR 185163), this test fails:
    drop the flag from the docs."""
    m = make()
    with torch._dynamo.config.patch(allow_rnn=False):
        compiled = torch.compile(m, fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="allow_rnn"):
            compiled(torch.randn(2, 1, 3))


@pytest.mark.parametrize("cls", [rnnkern.RNNCell, rnnkern.GRUCell, rnnkern.LSTMCell])
def test_cells_compile_without_the_flag(cls):
    """Dynamo's refusal concerns the sequence modules only."""
    torch._dynamo.reset()
    m = cls(3, 4, backend="cpu", dtype=torch.float64)
    x = randn(generator("cell-no-flag", cls.__name__), 2, 3)
    with torch._dynamo.config.patch(allow_rnn=False):
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    for a, b in zip(leaves(got), leaves(m(x))):
        assert_close(a, b, what=cls.__name__)


# ------------------------------------------------------ compiled autograd ----

def _compiled_autograd_cases():
    modules = ["LSTM-proj-bi-lengths", "GRU-2", "RNNCell", "LSTMCell"]
    cases = [(m, "cpu") for m in modules]
    if ops.WITH_CUDA_EMULATION:
        cases += [(m, "cuda_emulated") for m in modules]
    # The reference is plain torch ops (unrolled by the trace: one small case); the
    # Triton kernels under the interpreter take seconds a launch.
    cases.append(("RNNCell", "reference"))
    if TRITON_INTERPRET and not HAS_GPU:
        cases.append(("GRU-2", "triton"))
    return cases


@pytest.mark.parametrize("module,backend", _compiled_autograd_cases())
def test_compiled_autograd_runs_the_kernels_backward(module, backend):
    """torch.compile's compiled autograd (``torch._dynamo.config.compiled_autograd``,
    what torchtitan-style training turns on) traces the backward graph through each
    node: rnnkern's C++ nodes go in as opaque calls of their backward, and the
    gradients of the input and every parameter equal eager's.  (Its
    CppNode refuses nodes that mark outputs non-differentiable: the workspace output
    is left differentiable, its gradient never produced.)  Packed input is left out:
    torch's own PackPaddedSequenceBackward0 fails under compiled autograd (fake
    tensors without data), with torch.nn's modules as with rnnkern's."""
    name, *variant = module.split("-")
    kwargs = {"LSTM": dict(proj_size=3, bidirectional=True, num_layers=2),
              "GRU": dict(num_layers=2)}.get(name, {})
    torch.manual_seed(3)
    m = getattr(rnnkern, name)(5, 4, backend=backend, dtype=torch.float64, **kwargs)
    g = generator("compiled-autograd", module)
    x = randn(g, 3, 5) if name.endswith("Cell") else randn(g, 6, 3, 5)
    call_kwargs = {}
    if "lengths" in variant:
        call_kwargs["lengths"] = torch.tensor([6, 2, 4])
    with torch.no_grad():
        shape = leaves(m(x, **call_kwargs))[0].shape
    cotangent = randn(generator("compiled-autograd-cotangent", module), *shape)

    def train_step(x):
        out = leaves(m(x, **call_kwargs))[0]
        (out * cotangent).sum().backward()
        return out.detach()

    results = []
    for compiled in (True, False):
        torch._dynamo.reset()
        xi = x.clone().requires_grad_()
        if compiled:
            ops._C.clear_recurrence_backwards_ahead()  # (what earlier tests in this thread left)
            with torch._dynamo.config.patch(compiled_autograd=True):
                out = torch.compile(train_step, backend="aot_eager")(xi)
            if backend == "cpu":  # no backward run ahead of a node (bidirectional layers) left untaken
                assert ops._C.clear_recurrence_backwards_ahead() == 0
        else:
            out = train_step(xi)
        results.append([out, xi.grad] + [p.grad for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    for i, (got, want) in enumerate(zip(*results)):
        assert got is not None and want is not None, i
        assert_close(got, want, what=f"{module} {backend}: result {i}")
