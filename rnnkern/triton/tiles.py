"""Block helpers shared by the Triton kernels: loads, stores, tiled products,
and where each batch row is in time.

Naming (as fla-org/flash-linear-attention): ``p_`` pointers, ``b_`` blocks,
``i_`` program ids, ``o_`` offsets, ``m_`` masks.  Matrices are row-major with
the row stride given in elements; row offsets are int64 (T*B*G*H can pass 2^31).
Masked-off elements load as 0, so padding never carries NaN into a product.
Every tl.dot takes its operands in the weight dtype (``DOT``) and accumulates
in float32 (float64 for float64); float32 operands multiply in IEEE float32,
not TF32 (input_precision="ieee").

The kernels index their per-step rows with pointer blocks built once per step
rather than through these helpers: under the interpreter each call of a
jitted helper costs about as much as ten block operations.
"""
import triton
import triton.language as tl


@triton.jit
def load_rows(p, row, stride, o_c, m, ACC: tl.constexpr):
    """Block [R, C] of a row-major matrix: rows ``row`` (int64 [R]), columns o_c, in ACC."""
    return tl.load(p + row[:, None] * stride + o_c[None, :], mask=m, other=0.0).to(ACC)


@triton.jit
def store_rows(p, row, stride, o_c, m, value):
    """Stores a block [R, C] at rows ``row``, columns o_c, in the dtype of ``p``."""
    tl.store(p + row[:, None] * stride + o_c[None, :], value.to(p.dtype.element_ty), mask=m)


@triton.jit
def zero_rows(p, row, width, o, m_b, BLOCK: tl.constexpr):
    """Zeros into columns [0, width) of the rows ``row`` ([R] int64, row-major
    with stride width) where m_b holds, BLOCK (o's length) columns at a time."""
    zeros = tl.zeros([BLOCK], p.dtype.element_ty)[None, :]
    for k in range(0, width, BLOCK):
        tl.store(p + row[:, None] * width + k + o[None, :], zeros,
                 mask=m_b[:, None] & (k + o[None, :] < width))


@triton.jit
def sequence_steps(p_len, o_b, m_b, T, HAS_LENGTHS: tl.constexpr):
    """The steps a loop kernel's rows run: T, or with lengths the longest of
    them.  The steps after are padding for every row of the program (only
    zeros to write), so a program of short rows -- a packed batch's later
    rows, sorted longest first -- costs their real steps, not the batch's
    longest."""
    if HAS_LENGTHS:
        n = tl.max(tl.load(p_len + o_b, mask=m_b, other=0), axis=0).to(tl.int32)
    else:
        n = T
    return n


@triton.jit
def load_vector(p, o, m, HAS: tl.constexpr, ACC: tl.constexpr):
    """A bias slice, or zeros when the bias is absent."""
    if HAS:
        v = tl.load(p + o, mask=m, other=0.0).to(ACC)
    else:
        v = (o * 0).to(ACC)
    return v


@triton.jit
def load_gate_vectors(p, o, m, H, G: tl.constexpr, HAS: tl.constexpr, ACC: tl.constexpr):
    """The slices o of the G gate blocks of a bias ([G*H]), as [1, N] rows; zeros
    when the bias is absent or the gate does not exist."""
    v0 = load_vector(p, o, m, HAS, ACC)[None, :]
    v1 = v0 * 0
    v2 = v0 * 0
    v3 = v0 * 0
    if G > 1:
        v1 = load_vector(p + H, o, m, HAS, ACC)[None, :]
        v2 = load_vector(p + 2 * H, o, m, HAS, ACC)[None, :]
    if G > 3:
        v3 = load_vector(p + 3 * H, o, m, HAS, ACC)[None, :]
    return v0, v1, v2, v3


@triton.jit
def load_weight(p, o_k, m_k, stride_k, o_n, m_n, stride_n, DOT: tl.constexpr):
    """Block [K, N] of a weight, element (k, n) at p + k*stride_k + n*stride_n."""
    b_w = tl.load(p + o_k[:, None] * stride_k + o_n[None, :] * stride_n,
                  mask=m_k[:, None] & m_n[None, :], other=0.0)
    return b_w.to(DOT)


@triton.jit
def matmul(acc, p_a, row_a, stride_a, m_a, K, p_w, stride_wk, stride_wn, o_n, m_n,
           BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """acc + A[row_a, :K] @ W[:K, o_n], with W[k, n] at p_w + k*stride_wk + n*stride_wn.

    The K loop of every per-step product (recurrent GEMM, its transpose, the
    projection); K is a runtime size, the tail block is masked."""
    o_k = tl.arange(0, BLOCK_K)
    p_a = p_a + row_a[:, None] * stride_a + o_k[None, :]
    p_w = p_w + o_k[:, None] * stride_wk + o_n[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        m_k = o_k < K - k0
        b_a = tl.load(p_a, mask=m_a[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc = tl.dot(b_a.to(DOT), b_w.to(DOT), acc, input_precision="ieee", out_dtype=acc.dtype)
        p_a += BLOCK_K
        p_w += BLOCK_K * stride_wk
    return acc


@triton.jit
def matmul_gates(acc0, acc1, acc2, acc3, p_a, row_a, stride_a, m_a, K, p_w, gate_stride,
                 stride_wk, stride_wn, o_n, m_n, GATES: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr):
    """``matmul`` for up to four gates at once: acc_g + A[row_a, :K] @ W_g[:K, o_n]
    with W_g at p_w + g*gate_stride.  Each A block is loaded once for all gates."""
    o_k = tl.arange(0, BLOCK_K)
    p_a = p_a + row_a[:, None] * stride_a + o_k[None, :]
    p_w = p_w + o_k[:, None] * stride_wk + o_n[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        m_k = o_k < K - k0
        m_w = m_k[:, None] & m_n[None, :]
        b_a = tl.load(p_a, mask=m_a[:, None] & m_k[None, :], other=0.0).to(DOT)
        b_w = tl.load(p_w, mask=m_w, other=0.0).to(DOT)
        acc0 = tl.dot(b_a, b_w, acc0, input_precision="ieee", out_dtype=acc0.dtype)
        if GATES > 1:
            b_w = tl.load(p_w + gate_stride, mask=m_w, other=0.0).to(DOT)
            acc1 = tl.dot(b_a, b_w, acc1, input_precision="ieee", out_dtype=acc1.dtype)
        if GATES > 2:
            b_w = tl.load(p_w + 2 * gate_stride, mask=m_w, other=0.0).to(DOT)
            acc2 = tl.dot(b_a, b_w, acc2, input_precision="ieee", out_dtype=acc2.dtype)
        if GATES > 3:
            b_w = tl.load(p_w + 3 * gate_stride, mask=m_w, other=0.0).to(DOT)
            acc3 = tl.dot(b_a, b_w, acc3, input_precision="ieee", out_dtype=acc3.dtype)
        p_a += BLOCK_K
        p_w += BLOCK_K * stride_wk
    return acc0, acc1, acc2, acc3


@triton.jit
def positions(p_len, o_b, m_b, s, T, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr):
    """Where each batch row is at loop step s (csrc/ops.cpp conventions).

    Returns ``active`` (the row is a real row whose sequence has a step s) and
    the time position the row reads and writes: its own position (s, or
    length - 1 - s in reverse) when active, else the padding position s, where
    a finished sequence writes zeros."""
    if HAS_LENGTHS:
        n = tl.load(p_len + o_b, mask=m_b, other=0).to(tl.int32)
    else:
        n = o_b * 0 + T
    active = (s < n) & m_b
    if REVERSE:
        t = n - 1 - s
    else:
        t = n * 0 + s
    t = tl.where(active, t, s)
    return active, t


@triton.jit
def previous_position(t, s, REVERSE: tl.constexpr):
    """The position of h_{t-1} for an active row at position t and step s > 0
    (at s = 0 it is h0)."""
    if REVERSE:
        q = t + 1
    else:
        q = t - 1
    return q


@triton.jit
def reset_rows(p_resets, t, o_b, active, B):
    """[R] bool: whether each row's step at position t starts from the reset
    state (h0 and c0 unless given) instead of the previous state (resets [T, B] bool).  Only active rows reset:
    past a sequence's end nothing changes."""
    r = tl.load(p_resets + t.to(tl.int64) * B + o_b, mask=active, other=0)
    return (r != 0) & active


@triton.jit
def next_reset_rows(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS: tl.constexpr,
                    REVERSE: tl.constexpr):
    """[R] bool: whether each row's next step (loop step s + 1) exists and starts
    from h0: the per-step kernels store the state that step starts from
    (forward), and route the gradient of that state to grad_h0 (backward)."""
    active_next, t_next = positions(p_len, o_b, m_b, s + 1, T, HAS_LENGTHS, REVERSE)
    return reset_rows(p_resets, t_next, o_b, active_next, B)


@triton.jit
def zoneout_rows(p_z, t, o_b, o_u, m, stride_t, stride_b, stride_u, ACC: tl.constexpr):
    """Block [R, C] of the zoneout mask [T, B, Z] read through its strides (an
    evaluation mask is one [Z] vector expanded: strides (0, 0, 1)): rows o_b at
    their positions t, units o_u."""
    return tl.load(p_z + t.to(tl.int64)[:, None] * stride_t + o_b.to(tl.int64)[:, None] * stride_b
                   + o_u[None, :] * stride_u, mask=m, other=0.0).to(ACC)
