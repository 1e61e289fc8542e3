"""Per-step kernels: one time step, tiled over (batch rows, hidden units).

They serve two callers:
  * the single-step op (cells, token-by-token generation), where the product
    ``[x_t, h_{t-1}] [W_ih; W_hh]^T`` runs as one accumulation over the
    concatenated K: the K blocks of x against W_ih, then those of h against
    W_hh, into the same accumulators, fused with the gates;
  * the recurrence for hidden sizes too large for the in-kernel time loop
    (:mod:`.sequence`): a Python loop launches them once per step (twice for
    the reset-before GRU and the LSTM projection) with the step index as a
    kernel argument, never synchronising with the host, so the loop can be
    captured in a CUDA graph.  The recurrent GEMM is fused with the gates.

Every kernel reads its inputs and writes separate outputs (states ping-pong
between two buffers), so a kernel can be re-run by the autotuner without
changing the result.  The gate formulas come from :mod:`.cells`.

Kernels (F: forward, B: backward):
  F gates_forward_kernel       xproj (or x W_ih^T) + h W_hh^T, gates, state update
  F gru_rb_candidate_kernel    reset-before GRU, stage 2: (r*h) W_hn^T, candidate
  F projection_forward_kernel  LSTM projection h = (o*tanh c) W_hr^T
  B gates_backward_kernel      carried dh (+ dA_{t+1} W_hh), the cell's backward
  B gru_rb_reset_kernel        reset-before GRU, stage 2: dn W_hn, reset gate
  B projection_backward_kernel LSTM projection: carried dh (+ dA_{t+1} W_hh) + grad_output
  B input_grad_kernel          [dA_x W_ih | dh + dA_h W_hh]: grad of x and h
"""
import triton
import triton.language as tl

from .cells import (GRU, GRU_RESET_BEFORE, LSTM, RNN_RELU, gru_backward, gru_forward,
                    gru_rb_backward_candidate, gru_rb_backward_reset, gru_rb_candidate,
                    gru_rb_gates, lstm_backward, lstm_forward, lstm_hidden, rnn_backward,
                    rnn_forward)
from .tiles import (load_gate_vectors, load_vector, matmul, matmul_gates, positions,
                    previous_position)
from .tuning import step_configs


# ---------------------------------------------------------------- forward ----

@triton.autotune(configs=step_configs(), key=["CELL", "I", "H", "P", "HAS_X"])
@triton.jit(do_not_specialize=["s", "T"])
def gates_forward_kernel(
        p_x, p_w_ih, p_xproj, p_h, p_c, p_w_hh, p_b_ih, p_b_hh, p_len,
        p_out, p_h_next, p_c_next, p_ws, p_aux,
        s, T, B, I, H, P,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_X: tl.constexpr,
        HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr,
        REVERSE: tl.constexpr, TRAIN: tl.constexpr, HAS_PROJ: tl.constexpr,
        STORE_STATE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step s for a tile of rows x units.

    x part: ``x [B, I] W_ih^T`` (HAS_X, the single-step op) or the rows of
    ``xproj [T, B, G*H]`` at each row's position (the recurrence); h part:
    ``h [B, P] W_hh^T``.  Writes h into ``out`` [T, B, P] at the row's position
    (zeros for a finished row), the new states into h_next [B, P] and c_next
    [B, H] when STORE_STATE (a finished row keeps its state), the workspace
    when TRAIN.  The reset-before GRU stops after its first stage and the LSTM
    with projection before it: both leave their intermediate values in aux
    ([B, 4H]: r, z, xn, r*h; or [B, H]: o*tanh c) for the next kernel.
    """
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    m_act = act & m_h[None, :]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]  # rows of the [T, B, *] tensors
    o_bh = o_b64[:, None] * H + o_h[None, :]             # this tile of a [B, H] tensor
    o_bp = o_b64[:, None] * P + o_h[None, :]             # ... of a [B, P] one (P = H here)
    GH = G * H

    # The x part of every gate ...
    acc0 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc1 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc3 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_X:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_x, o_b64, I, m_b, I,
                                              p_w_ih, H * I, 1, I, o_h, m_h, G, BLOCK_K, DOT)
    else:
        p_xp = p_xproj + row * GH + o_h[None, :]
        acc0 = tl.load(p_xp, mask=m_act, other=0.0).to(ACC)
        if G > 1:
            acc1 = tl.load(p_xp + H, mask=m_act, other=0.0).to(ACC)
            acc2 = tl.load(p_xp + 2 * H, mask=m_act, other=0.0).to(ACC)
        if G > 3:
            acc3 = tl.load(p_xp + 3 * H, mask=m_act, other=0.0).to(ACC)
    # ... the GRU candidate keeps its x part apart ...
    if CELL >= GRU:
        acc_xn = acc2
        acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    # ... and the h part accumulates on the same blocks (reset-before GRU: r, z only).
    if CELL == GRU_RESET_BEFORE:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_h, o_b64, P, m_b, P,
                                              p_w_hh, H * P, 1, P, o_h, m_h, 2, BLOCK_K, DOT)
    else:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_h, o_b64, P, m_b, P,
                                              p_w_hh, H * P, 1, P, o_h, m_h, G, BLOCK_K, DOT)
    bi0, bi1, bi2, bi3 = load_gate_vectors(p_b_ih, o_h, m_h, H, G, HAS_B_IH, ACC)
    bh0, bh1, bh2, bh3 = load_gate_vectors(p_b_hh, o_h, m_h, H, G, HAS_B_HH, ACC)

    if CELL == GRU_RESET_BEFORE:
        h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
        r, z, rh = gru_rb_gates(acc0 + bi0, acc1 + bi1, bh0, bh1, h_prev)
        p_a = p_aux + o_b64[:, None] * (4 * H) + o_h[None, :]
        tl.store(p_a, r.to(p_aux.dtype.element_ty), mask=m)
        tl.store(p_a + H, z.to(p_aux.dtype.element_ty), mask=m)
        tl.store(p_a + 2 * H, (acc_xn + bi2).to(p_aux.dtype.element_ty), mask=m)
        tl.store(p_a + 3 * H, rh.to(p_aux.dtype.element_ty), mask=m)
    else:
        p_w = p_ws + row * WS + o_h[None, :]
        WS_DTYPE = p_ws.dtype.element_ty
        if CELL == LSTM:
            c_prev = tl.load(p_c + o_bh, mask=m, other=0.0).to(ACC)
            i, f, g, o, c, h = lstm_forward(acc0 + bi0 + bh0, acc1 + bi1 + bh1,
                                            acc2 + bi2 + bh2, acc3 + bi3 + bh3, c_prev)
            tl.store(p_c_next + o_bh, tl.where(act, c, c_prev).to(p_c_next.dtype.element_ty),
                     mask=m)
            if TRAIN:
                tl.store(p_w, tl.where(act, i, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + H, tl.where(act, f, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + 2 * H, tl.where(act, g, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + 3 * H, tl.where(act, o, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + 4 * H, tl.where(act, c, 0.0).to(WS_DTYPE), mask=m)
        elif CELL == GRU:
            h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
            hn = acc2 + bh2
            r, z, n, h = gru_forward(acc0 + bi0, acc1 + bi1, acc_xn + bi2, bh0, bh1, hn, h_prev)
            if TRAIN:
                tl.store(p_w, tl.where(act, r, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + H, tl.where(act, z, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(WS_DTYPE), mask=m)
                tl.store(p_w + 3 * H, tl.where(act, hn, 0.0).to(WS_DTYPE), mask=m)
        else:
            h = rnn_forward(acc0 + bi0 + bh0, CELL == RNN_RELU)

        if HAS_PROJ:  # projected by projection_forward_kernel
            tl.store(p_aux + o_bh, h.to(p_aux.dtype.element_ty), mask=m)
        else:
            tl.store(p_out + row * P + o_h[None, :],
                     tl.where(act, h, 0.0).to(p_out.dtype.element_ty), mask=m)
            if STORE_STATE:
                if CELL != GRU:
                    h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
                tl.store(p_h_next + o_bp, tl.where(act, h, h_prev).to(p_h_next.dtype.element_ty),
                         mask=m)


@triton.autotune(configs=step_configs(), key=["H"])
@triton.jit(do_not_specialize=["s", "T"])
def gru_rb_candidate_kernel(
        p_aux, p_h, p_w_hh, p_b_hh, p_len, p_out, p_h_next, p_ws,
        s, T, B, H,
        HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        TRAIN: tl.constexpr, STORE_STATE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reset-before GRU, stage 2 of step s: hn = (r*h) W_hn^T + b_hn from the
    r*h of every unit (aux, from gates_forward_kernel), the candidate and h."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    o_bh = o_b64[:, None] * H + o_h[None, :]

    hn = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    hn = matmul(hn, p_aux + 3 * H, o_b64, 4 * H, m_b, H, p_w_hh + 2 * H * H, 1, H, o_h, m_h,
                BLOCK_K, DOT)
    hn += load_vector(p_b_hh + 2 * H, o_h, m_h, HAS_B_HH, ACC)[None, :]
    p_a = p_aux + o_b64[:, None] * (4 * H) + o_h[None, :]
    r = tl.load(p_a, mask=m, other=0.0).to(ACC)
    z = tl.load(p_a + H, mask=m, other=0.0).to(ACC)
    xn = tl.load(p_a + 2 * H, mask=m, other=0.0).to(ACC)
    h_prev = tl.load(p_h + o_bh, mask=m, other=0.0).to(ACC)
    n, h = gru_rb_candidate(xn, hn, z, h_prev)
    tl.store(p_out + row * H + o_h[None, :], tl.where(act, h, 0.0).to(p_out.dtype.element_ty),
             mask=m)
    if STORE_STATE:
        tl.store(p_h_next + o_bh, tl.where(act, h, h_prev).to(p_h_next.dtype.element_ty), mask=m)
    if TRAIN:
        p_w = p_ws + row * (3 * H) + o_h[None, :]
        tl.store(p_w, tl.where(act, r, 0.0).to(p_ws.dtype.element_ty), mask=m)
        tl.store(p_w + H, tl.where(act, z, 0.0).to(p_ws.dtype.element_ty), mask=m)
        tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(p_ws.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["H", "P"])
@triton.jit(do_not_specialize=["s", "T"])
def projection_forward_kernel(
        p_aux, p_w_hr, p_h, p_len, p_out, p_h_next,
        s, T, B, H, P,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """LSTM projection of step s for a tile of rows x outputs (BLOCK_H of the P
    outputs): h = (o * tanh c) W_hr^T, from aux [B, H]."""
    i_b, i_p = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_p = i_p * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_p = o_b < B, o_p < P
    m = m_b[:, None] & m_p[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    o_bp = o_b64[:, None] * P + o_p[None, :]

    h = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    h = matmul(h, p_aux, o_b64, H, m_b, H, p_w_hr, 1, H, o_p, m_p, BLOCK_K, DOT)
    h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
    tl.store(p_out + row * P + o_p[None, :], tl.where(act, h, 0.0).to(p_out.dtype.element_ty),
             mask=m)
    tl.store(p_h_next + o_bp, tl.where(act, h, h_prev).to(p_h_next.dtype.element_ty), mask=m)


# --------------------------------------------------------------- backward ----
# Per step s (from T-1 down to 0) the carried gradient of h_{t} is split in a
# direct part dh [B, P] (what the pointwise backward passed on) and the GEMM
# part dA_{s+1} W_hh, which the next kernel adds on the fly for its own
# columns: one launch per step computes the carried gradient and the step.

@triton.autotune(configs=step_configs(), key=["CELL", "H", "P"])
@triton.jit(do_not_specialize=["s", "T"])
def gates_backward_kernel(
        p_gout, p_dh, p_da_next, p_w_hh, p_dc, p_ws, p_out, p_h0, p_c0, p_len, p_dh_tot, p_w_hr,
        p_dx, p_da, p_dh_out, p_dc_out, p_aux, p_aux_all,
        s, T, B, H, P,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_GOUT: tl.constexpr,
        HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_PROJ: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Backward of step s for a tile of rows x units.

    The gradient of this step's h: ``dh + dA_{s+1} W_hh`` (the product only when
    HAS_NEXT; + grad_output at the row's position when HAS_GOUT), or, with the
    LSTM projection, ``dh_tot W_hr`` from projection_backward_kernel.  Writes
    the gate gradients: dx [T, B, G*H] (the gradient of xproj, zeros at padding
    positions) and dA [B, DA] (those that multiply W_hh: the GRU's n part is
    dhn; the reset-before GRU's dA is [dr, dz], dr from gru_rb_reset_kernel),
    the direct part of dh_{t-1} (dh_out), dc_{t-1} (dc_out).  Finished rows
    pass their carry on unchanged.  Time-ordered extras for the weight
    gradients go to aux_all [T, B, H]: GRU dhn; LSTM with projection o*tanh c.
    The reset-before GRU leaves dn in aux [B, H] for its stage 2.
    """
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    m_act = act & m_h[None, :]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    o_bh = o_b64[:, None] * H + o_h[None, :]
    o_bp = o_b64[:, None] * P + o_h[None, :]  # P = H, except with a projection
    GH = G * H
    # h_{t-1} (and c_{t-1}) of an active row: the output one step earlier, or h0.
    row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b64[:, None]
    m_q = m_act & (s > 0)
    m_0 = m_act & (s == 0)
    p_w = p_ws + row * WS + o_h[None, :]
    p_d = p_dx + row * GH + o_h[None, :]
    DX_DTYPE = p_dx.dtype.element_ty
    DA_DTYPE = p_da.dtype.element_ty

    # The carried gradient of this step's (unprojected) h.
    d = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_PROJ:
        d = matmul(d, p_dh_tot, o_b64, P, m_b, P, p_w_hr, H, 1, o_h, m_h, BLOCK_K, DOT)
    else:
        if HAS_NEXT:
            if CELL == GRU_RESET_BEFORE:  # dA holds [dr, dz]: dn reaches h through r*h
                d = matmul(d, p_da_next, o_b64, 2 * H, m_b, 2 * H, p_w_hh, P, 1, o_h, m_h,
                           BLOCK_K, DOT)
            else:
                d = matmul(d, p_da_next, o_b64, GH, m_b, GH, p_w_hh, P, 1, o_h, m_h,
                           BLOCK_K, DOT)
        d += tl.load(p_dh + o_bp, mask=m, other=0.0).to(ACC)
        carry = d
        if HAS_GOUT:
            d += tl.load(p_gout + row * P + o_h[None, :], mask=m_act, other=0.0).to(ACC)

    if CELL == LSTM:
        i = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
        f = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
        g = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
        o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
        c = tl.load(p_w + 4 * H, mask=m_act, other=0.0).to(ACC)
        c_prev = (tl.load(p_ws + row_q * WS + 4 * H + o_h[None, :], mask=m_q, other=0.0).to(ACC)
                  + tl.load(p_c0 + o_bh, mask=m_0, other=0.0).to(ACC))
        dc = tl.load(p_dc + o_bh, mask=m, other=0.0).to(ACC)
        di, df, dg, do, dc_prev = lstm_backward(d, dc, i, f, g, o, c, c_prev)
        di = tl.where(act, di, 0.0)
        df = tl.where(act, df, 0.0)
        dg = tl.where(act, dg, 0.0)
        do = tl.where(act, do, 0.0)
        tl.store(p_d, di.to(DX_DTYPE), mask=m)
        tl.store(p_d + H, df.to(DX_DTYPE), mask=m)
        tl.store(p_d + 2 * H, dg.to(DX_DTYPE), mask=m)
        tl.store(p_d + 3 * H, do.to(DX_DTYPE), mask=m)
        p_a = p_da + o_b64[:, None] * GH + o_h[None, :]
        tl.store(p_a, di.to(DA_DTYPE), mask=m)
        tl.store(p_a + H, df.to(DA_DTYPE), mask=m)
        tl.store(p_a + 2 * H, dg.to(DA_DTYPE), mask=m)
        tl.store(p_a + 3 * H, do.to(DA_DTYPE), mask=m)
        tl.store(p_dc_out + o_bh, tl.where(act, dc_prev, dc).to(p_dc_out.dtype.element_ty), mask=m)
        if HAS_PROJ:
            tl.store(p_aux_all + row * H + o_h[None, :],
                     tl.where(act, lstm_hidden(o, c), 0.0).to(p_aux_all.dtype.element_ty), mask=m)
        else:
            tl.store(p_dh_out + o_bp, tl.where(act, 0.0, carry).to(p_dh_out.dtype.element_ty),
                     mask=m)
    elif CELL == GRU:
        r = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
        z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
        n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
        hn = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
        h_prev = (tl.load(p_out + row_q * P + o_h[None, :], mask=m_q, other=0.0).to(ACC)
                  + tl.load(p_h0 + o_bp, mask=m_0, other=0.0).to(ACC))
        dr, dz, dxn, dhn, dh_prev = gru_backward(d, r, z, n, hn, h_prev)
        dr = tl.where(act, dr, 0.0)
        dz = tl.where(act, dz, 0.0)
        dxn = tl.where(act, dxn, 0.0)
        dhn = tl.where(act, dhn, 0.0)
        tl.store(p_d, dr.to(DX_DTYPE), mask=m)
        tl.store(p_d + H, dz.to(DX_DTYPE), mask=m)
        tl.store(p_d + 2 * H, dxn.to(DX_DTYPE), mask=m)
        p_a = p_da + o_b64[:, None] * GH + o_h[None, :]
        tl.store(p_a, dr.to(DA_DTYPE), mask=m)
        tl.store(p_a + H, dz.to(DA_DTYPE), mask=m)
        tl.store(p_a + 2 * H, dhn.to(DA_DTYPE), mask=m)
        tl.store(p_aux_all + row * H + o_h[None, :], dhn.to(p_aux_all.dtype.element_ty), mask=m)
        tl.store(p_dh_out + o_bp, tl.where(act, dh_prev, carry).to(p_dh_out.dtype.element_ty),
                 mask=m)
    elif CELL == GRU_RESET_BEFORE:
        z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
        n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
        h_prev = (tl.load(p_out + row_q * P + o_h[None, :], mask=m_q, other=0.0).to(ACC)
                  + tl.load(p_h0 + o_bp, mask=m_0, other=0.0).to(ACC))
        dz, dn, dh_prev = gru_rb_backward_candidate(d, z, n, h_prev)
        dz = tl.where(act, dz, 0.0)
        dn = tl.where(act, dn, 0.0)
        tl.store(p_d + H, dz.to(DX_DTYPE), mask=m)
        tl.store(p_d + 2 * H, dn.to(DX_DTYPE), mask=m)
        tl.store(p_da + o_b64[:, None] * (2 * H) + H + o_h[None, :], dz.to(DA_DTYPE), mask=m)
        tl.store(p_aux + o_bh, dn.to(p_aux.dtype.element_ty), mask=m)
        tl.store(p_dh_out + o_bp, tl.where(act, dh_prev, carry).to(p_dh_out.dtype.element_ty),
                 mask=m)
    else:
        h = tl.load(p_out + row * P + o_h[None, :], mask=m_act, other=0.0).to(ACC)
        da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
        tl.store(p_d, da.to(DX_DTYPE), mask=m)
        tl.store(p_da + o_b64[:, None] * GH + o_h[None, :], da.to(DA_DTYPE), mask=m)
        tl.store(p_dh_out + o_bp, tl.where(act, 0.0, carry).to(p_dh_out.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["H"])
@triton.jit(do_not_specialize=["s", "T"])
def gru_rb_reset_kernel(
        p_aux, p_w_hh, p_ws, p_out, p_h0, p_len, p_dh, p_dx, p_da, p_dh_out, p_aux_all,
        s, T, B, H,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reset-before GRU, backward stage 2 of step s: drh = dn W_hn from the dn of
    every unit (aux), the reset gate's gradient, and the part of dh_{t-1}
    through r*h added to the direct part dh.  Records r*h_{t-1} in aux_all for dW_hn."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    m_act = act & m_h[None, :]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b64[:, None]
    o_bh = o_b64[:, None] * H + o_h[None, :]

    drh = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    drh = matmul(drh, p_aux, o_b64, H, m_b, H, p_w_hh + 2 * H * H, H, 1, o_h, m_h, BLOCK_K, DOT)
    r = tl.load(p_ws + row * (3 * H) + o_h[None, :], mask=m_act, other=0.0).to(ACC)
    h_prev = (tl.load(p_out + row_q * H + o_h[None, :], mask=m_act & (s > 0), other=0.0).to(ACC)
              + tl.load(p_h0 + o_bh, mask=m_act & (s == 0), other=0.0).to(ACC))
    dr, dh_prev = gru_rb_backward_reset(drh, r, h_prev)
    dr = tl.where(act, dr, 0.0)
    tl.store(p_dx + row * (3 * H) + o_h[None, :], dr.to(p_dx.dtype.element_ty), mask=m)
    tl.store(p_da + o_b64[:, None] * (2 * H) + o_h[None, :], dr.to(p_da.dtype.element_ty), mask=m)
    tl.store(p_aux_all + row * H + o_h[None, :],
             tl.where(act, r * h_prev, 0.0).to(p_aux_all.dtype.element_ty), mask=m)
    dh = tl.load(p_dh + o_bh, mask=m, other=0.0).to(ACC)
    tl.store(p_dh_out + o_bh, tl.where(act, dh + dh_prev, dh).to(p_dh_out.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["H", "P"])
@triton.jit(do_not_specialize=["s", "T"])
def projection_backward_kernel(
        p_gout, p_dh, p_da_next, p_w_hh, p_len, p_dh_tot, p_dh_out, p_dh_tot_all,
        s, T, B, H, P,
        HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """LSTM with projection, step s, for a tile of rows x outputs (BLOCK_H of
    the P outputs): the total gradient of the projected h_t,
    ``dh + dA_{s+1} W_hh + grad_output``, into dh_tot [B, P] (for
    gates_backward_kernel) and dh_tot_all [T, B, P] (for dW_hr).  The LSTM has
    no direct path from h_{t-1} to h_t: dh_out is 0, or the whole carry for a
    finished row."""
    i_b, i_p = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_p = i_p * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_p = o_b < B, o_p < P
    m = m_b[:, None] & m_p[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    act = active[:, None]
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    o_bp = o_b64[:, None] * P + o_p[None, :]

    carry = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_NEXT:
        carry = matmul(carry, p_da_next, o_b64, 4 * H, m_b, 4 * H, p_w_hh, P, 1, o_p, m_p,
                       BLOCK_K, DOT)
    carry += tl.load(p_dh + o_bp, mask=m, other=0.0).to(ACC)
    gout = tl.load(p_gout + row * P + o_p[None, :], mask=act & m_p[None, :], other=0.0).to(ACC)
    total = tl.where(act, carry + gout, 0.0)
    tl.store(p_dh_tot + o_bp, total.to(p_dh_tot.dtype.element_ty), mask=m)
    tl.store(p_dh_tot_all + row * P + o_p[None, :], total.to(p_dh_tot_all.dtype.element_ty), mask=m)
    tl.store(p_dh_out + o_bp, tl.where(act, 0.0, carry).to(p_dh_out.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["I", "GH", "P"])
@triton.jit
def input_grad_kernel(
        p_dx, p_w_ih, p_da, p_w_hh, p_dh, p_gx, p_gh,
        B, I, GH, DA, P,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The transposed product of the step, one GEMM over the concatenated N:
    ``[grad_x | grad_h] = [dx W_ih | dh + dA W_hh]`` for a tile of rows x
    columns; the first cdiv(I, BLOCK_H) column tiles are grad_x [B, I], the
    rest grad_h [B, P].  dx [B, G*H], dA [B, DA] (DA <= G*H rows of W_hh).
    With I = 0 it finishes the recurrence: grad_h0 = dh + dA_0 W_hh."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    o_b64 = o_b.to(tl.int64)
    n_x = tl.cdiv(I, BLOCK_H)
    acc = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if i_n < n_x:
        o_n = i_n * BLOCK_H + tl.arange(0, BLOCK_H)
        m_n = o_n < I
        acc = matmul(acc, p_dx, o_b64, GH, m_b, GH, p_w_ih, I, 1, o_n, m_n, BLOCK_K, DOT)
        tl.store(p_gx + o_b64[:, None] * I + o_n[None, :], acc.to(p_gx.dtype.element_ty),
                 mask=m_b[:, None] & m_n[None, :])
    else:
        o_n = (i_n - n_x) * BLOCK_H + tl.arange(0, BLOCK_H)
        m_n = o_n < P
        m = m_b[:, None] & m_n[None, :]
        o_bn = o_b64[:, None] * P + o_n[None, :]
        acc = matmul(acc, p_da, o_b64, DA, m_b, DA, p_w_hh, P, 1, o_n, m_n, BLOCK_K, DOT)
        acc += tl.load(p_dh + o_bn, mask=m, other=0.0).to(ACC)
        tl.store(p_gh + o_bn, acc.to(p_gh.dtype.element_ty), mask=m)
