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
from .tiles import (load_rows, load_vector, matmul, matmul_gates, positions, previous_position,
                    store_rows)
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
    m_act = active[:, None] & m_h[None, :]
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b
    GH = G * H

    # The x part of every gate ...
    acc0 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc1 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc3 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_X:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_x, row_b, I, m_b, I,
                                              p_w_ih, H * I, 1, I, o_h, m_h, G, BLOCK_K, DOT)
    else:
        acc0 = load_rows(p_xproj, row, GH, o_h, m_act, ACC)
        if G > 1:
            acc1 = load_rows(p_xproj + H, row, GH, o_h, m_act, ACC)
            acc2 = load_rows(p_xproj + 2 * H, row, GH, o_h, m_act, ACC)
        if G > 3:
            acc3 = load_rows(p_xproj + 3 * H, row, GH, o_h, m_act, ACC)
    # ... the GRU candidate keeps its x part apart ...
    if CELL >= GRU:
        acc_xn = acc2
        acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    # ... and the h part accumulates on the same blocks (reset-before GRU: r, z only).
    if CELL == GRU_RESET_BEFORE:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_h, row_b, P, m_b, P,
                                              p_w_hh, H * P, 1, P, o_h, m_h, 2, BLOCK_K, DOT)
    else:
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_h, row_b, P, m_b, P,
                                              p_w_hh, H * P, 1, P, o_h, m_h, G, BLOCK_K, DOT)

    bi0 = load_vector(p_b_ih, o_h, m_h, HAS_B_IH, ACC)[None, :]
    bh0 = load_vector(p_b_hh, o_h, m_h, HAS_B_HH, ACC)[None, :]
    if G > 1:
        bi1 = load_vector(p_b_ih + H, o_h, m_h, HAS_B_IH, ACC)[None, :]
        bh1 = load_vector(p_b_hh + H, o_h, m_h, HAS_B_HH, ACC)[None, :]
        bi2 = load_vector(p_b_ih + 2 * H, o_h, m_h, HAS_B_IH, ACC)[None, :]
        bh2 = load_vector(p_b_hh + 2 * H, o_h, m_h, HAS_B_HH, ACC)[None, :]
    if G > 3:
        bi3 = load_vector(p_b_ih + 3 * H, o_h, m_h, HAS_B_IH, ACC)[None, :]
        bh3 = load_vector(p_b_hh + 3 * H, o_h, m_h, HAS_B_HH, ACC)[None, :]

    if CELL == GRU_RESET_BEFORE:
        h_prev = load_rows(p_h, row_b, P, o_h, m, ACC)
        r, z, rh = gru_rb_gates(acc0 + bi0, acc1 + bi1, bh0, bh1, h_prev)
        store_rows(p_aux, row_b, 4 * H, o_h, m, r)
        store_rows(p_aux + H, row_b, 4 * H, o_h, m, z)
        store_rows(p_aux + 2 * H, row_b, 4 * H, o_h, m, acc_xn + bi2)
        store_rows(p_aux + 3 * H, row_b, 4 * H, o_h, m, rh)
    else:
        if CELL == LSTM:
            c_prev = load_rows(p_c, row_b, H, o_h, m, ACC)
            i, f, g, o, c, h = lstm_forward(acc0 + bi0 + bh0, acc1 + bi1 + bh1,
                                            acc2 + bi2 + bh2, acc3 + bi3 + bh3, c_prev)
            tl.store(p_c_next + row_b[:, None] * H + o_h[None, :],
                     tl.where(active[:, None], c, c_prev).to(p_c_next.dtype.element_ty), mask=m)
            if TRAIN:
                store_rows(p_ws, row, WS, o_h, m, tl.where(active[:, None], i, 0.0))
                store_rows(p_ws + H, row, WS, o_h, m, tl.where(active[:, None], f, 0.0))
                store_rows(p_ws + 2 * H, row, WS, o_h, m, tl.where(active[:, None], g, 0.0))
                store_rows(p_ws + 3 * H, row, WS, o_h, m, tl.where(active[:, None], o, 0.0))
                store_rows(p_ws + 4 * H, row, WS, o_h, m, tl.where(active[:, None], c, 0.0))
        elif CELL == GRU:
            h_prev = load_rows(p_h, row_b, P, o_h, m, ACC)
            hn = acc2 + bh2
            r, z, n, h = gru_forward(acc0 + bi0, acc1 + bi1, acc_xn + bi2, bh0, bh1, hn, h_prev)
            if TRAIN:
                store_rows(p_ws, row, WS, o_h, m, tl.where(active[:, None], r, 0.0))
                store_rows(p_ws + H, row, WS, o_h, m, tl.where(active[:, None], z, 0.0))
                store_rows(p_ws + 2 * H, row, WS, o_h, m, tl.where(active[:, None], n, 0.0))
                store_rows(p_ws + 3 * H, row, WS, o_h, m, tl.where(active[:, None], hn, 0.0))
        else:
            h = rnn_forward(acc0 + bi0 + bh0, CELL == RNN_RELU)

        if HAS_PROJ:
            store_rows(p_aux, row_b, H, o_h, m, h)  # projected by projection_forward_kernel
        else:
            store_rows(p_out, row, P, o_h, m, tl.where(active[:, None], h, 0.0))
            if STORE_STATE:
                h_prev = load_rows(p_h, row_b, P, o_h, m, ACC)
                store_rows(p_h_next, row_b, P, o_h, m, tl.where(active[:, None], h, h_prev))


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
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b

    hn = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    hn = matmul(hn, p_aux + 3 * H, row_b, 4 * H, m_b, H, p_w_hh + 2 * H * H, 1, H, o_h, m_h,
                BLOCK_K, DOT)
    hn += load_vector(p_b_hh + 2 * H, o_h, m_h, HAS_B_HH, ACC)[None, :]
    r = load_rows(p_aux, row_b, 4 * H, o_h, m, ACC)
    z = load_rows(p_aux + H, row_b, 4 * H, o_h, m, ACC)
    xn = load_rows(p_aux + 2 * H, row_b, 4 * H, o_h, m, ACC)
    h_prev = load_rows(p_h, row_b, H, o_h, m, ACC)
    n, h = gru_rb_candidate(xn, hn, z, h_prev)
    store_rows(p_out, row, H, o_h, m, tl.where(active[:, None], h, 0.0))
    if STORE_STATE:
        store_rows(p_h_next, row_b, H, o_h, m, tl.where(active[:, None], h, h_prev))
    if TRAIN:
        store_rows(p_ws, row, 3 * H, o_h, m, tl.where(active[:, None], r, 0.0))
        store_rows(p_ws + H, row, 3 * H, o_h, m, tl.where(active[:, None], z, 0.0))
        store_rows(p_ws + 2 * H, row, 3 * H, o_h, m, tl.where(active[:, None], n, 0.0))


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
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b

    h = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    h = matmul(h, p_aux, row_b, H, m_b, H, p_w_hr, 1, H, o_p, m_p, BLOCK_K, DOT)
    h_prev = load_rows(p_h, row_b, P, o_p, m, ACC)
    store_rows(p_out, row, P, o_p, m, tl.where(active[:, None], h, 0.0))
    store_rows(p_h_next, row_b, P, o_p, m, tl.where(active[:, None], h, h_prev))


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
        HAS_PROJ: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Backward of step s for a tile of rows x units.

    The gradient of this step's h: ``dh + dA_{s+1} W_hh`` (+ grad_output at the
    row's position when HAS_GOUT), or, with the LSTM projection,
    ``dh_tot W_hr`` from projection_backward_kernel.  Writes the gate gradients:
    dx [T, B, G*H] (the gradient of xproj, zeros at padding positions) and dA
    [B, G*H] (those that multiply W_hh: the GRU's n part is dhn; the reset-
    before GRU's is [dr, dz], with dr from gru_rb_reset_kernel), the direct
    part of dh_{t-1} (dh_out), dc_{t-1} (dc_out).  Finished rows pass their
    carry on unchanged.  Time-ordered extras for the weight gradients go to
    aux_all [T, B, H]: GRU dhn; LSTM with projection o*tanh(c).  The reset-
    before GRU leaves dn in aux [B, H] for its stage 2.
    """
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    m_act = active[:, None] & m_h[None, :]
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b
    GH = G * H
    # h_{t-1} (and c_{t-1}) of an active row: the output one step earlier, or h0.
    q = previous_position(t, s, REVERSE)
    row_q = q.to(tl.int64) * B + o_b
    m_q = m_act & (s > 0)
    m_0 = m_act & (s == 0)

    # The carried gradient of this step's (unprojected) h.
    d = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_PROJ:
        d = matmul(d, p_dh_tot, row_b, P, m_b, P, p_w_hr, H, 1, o_h, m_h, BLOCK_K, DOT)
    else:
        if HAS_NEXT:
            if CELL == GRU_RESET_BEFORE:  # dA holds [dr, dz]: dn reaches h through r*h
                d = matmul(d, p_da_next, row_b, 2 * H, m_b, 2 * H, p_w_hh, P, 1, o_h, m_h,
                           BLOCK_K, DOT)
            else:
                d = matmul(d, p_da_next, row_b, GH, m_b, GH, p_w_hh, P, 1, o_h, m_h,
                           BLOCK_K, DOT)
        d += load_rows(p_dh, row_b, P, o_h, m, ACC)
        carry = d
        if HAS_GOUT:
            d += load_rows(p_gout, row, P, o_h, m_act, ACC)
    act = active[:, None]

    if CELL == LSTM:
        i = load_rows(p_ws, row, WS, o_h, m_act, ACC)
        f = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
        g = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
        o = load_rows(p_ws + 3 * H, row, WS, o_h, m_act, ACC)
        c = load_rows(p_ws + 4 * H, row, WS, o_h, m_act, ACC)
        c_prev = (load_rows(p_ws + 4 * H, row_q, WS, o_h, m_q, ACC)
                  + load_rows(p_c0, row_b, H, o_h, m_0, ACC))
        dc = load_rows(p_dc, row_b, H, o_h, m, ACC)
        di, df, dg, do, dc_prev = lstm_backward(d, dc, i, f, g, o, c, c_prev)
        di = tl.where(act, di, 0.0)
        df = tl.where(act, df, 0.0)
        dg = tl.where(act, dg, 0.0)
        do = tl.where(act, do, 0.0)
        store_rows(p_dx, row, GH, o_h, m, di)
        store_rows(p_dx + H, row, GH, o_h, m, df)
        store_rows(p_dx + 2 * H, row, GH, o_h, m, dg)
        store_rows(p_dx + 3 * H, row, GH, o_h, m, do)
        store_rows(p_da, row_b, GH, o_h, m, di)
        store_rows(p_da + H, row_b, GH, o_h, m, df)
        store_rows(p_da + 2 * H, row_b, GH, o_h, m, dg)
        store_rows(p_da + 3 * H, row_b, GH, o_h, m, do)
        store_rows(p_dc_out, row_b, H, o_h, m, tl.where(act, dc_prev, dc))
        if HAS_PROJ:
            store_rows(p_aux_all, row, H, o_h, m, tl.where(act, lstm_hidden(o, c), 0.0))
        else:
            store_rows(p_dh_out, row_b, P, o_h, m, tl.where(act, 0.0, carry))
    elif CELL == GRU:
        r = load_rows(p_ws, row, WS, o_h, m_act, ACC)
        z = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
        n = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
        hn = load_rows(p_ws + 3 * H, row, WS, o_h, m_act, ACC)
        h_prev = load_rows(p_out, row_q, P, o_h, m_q, ACC) + load_rows(p_h0, row_b, P, o_h, m_0, ACC)
        dr, dz, dxn, dhn, dh_prev = gru_backward(d, r, z, n, hn, h_prev)
        dr = tl.where(act, dr, 0.0)
        dz = tl.where(act, dz, 0.0)
        dxn = tl.where(act, dxn, 0.0)
        dhn = tl.where(act, dhn, 0.0)
        store_rows(p_dx, row, GH, o_h, m, dr)
        store_rows(p_dx + H, row, GH, o_h, m, dz)
        store_rows(p_dx + 2 * H, row, GH, o_h, m, dxn)
        store_rows(p_da, row_b, GH, o_h, m, dr)
        store_rows(p_da + H, row_b, GH, o_h, m, dz)
        store_rows(p_da + 2 * H, row_b, GH, o_h, m, dhn)
        store_rows(p_aux_all, row, H, o_h, m, dhn)
        store_rows(p_dh_out, row_b, P, o_h, m, tl.where(act, dh_prev, carry))
    elif CELL == GRU_RESET_BEFORE:
        z = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
        n = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
        h_prev = load_rows(p_out, row_q, P, o_h, m_q, ACC) + load_rows(p_h0, row_b, P, o_h, m_0, ACC)
        dz, dn, dh_prev = gru_rb_backward_candidate(d, z, n, h_prev)
        dz = tl.where(act, dz, 0.0)
        dn = tl.where(act, dn, 0.0)
        store_rows(p_dx + H, row, GH, o_h, m, dz)
        store_rows(p_dx + 2 * H, row, GH, o_h, m, dn)
        store_rows(p_da + H, row_b, 2 * H, o_h, m, dz)
        store_rows(p_aux, row_b, H, o_h, m, dn)
        store_rows(p_dh_out, row_b, P, o_h, m, tl.where(act, dh_prev, carry))
    else:
        h = load_rows(p_out, row, P, o_h, m_act, ACC)
        da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
        store_rows(p_dx, row, GH, o_h, m, da)
        store_rows(p_da, row_b, GH, o_h, m, da)
        store_rows(p_dh_out, row_b, P, o_h, m, tl.where(act, 0.0, carry))


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
    m_act = active[:, None] & m_h[None, :]
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b
    q = previous_position(t, s, REVERSE)
    row_q = q.to(tl.int64) * B + o_b
    act = active[:, None]

    drh = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    drh = matmul(drh, p_aux, row_b, H, m_b, H, p_w_hh + 2 * H * H, H, 1, o_h, m_h, BLOCK_K, DOT)
    r = load_rows(p_ws, row, 3 * H, o_h, m_act, ACC)
    h_prev = (load_rows(p_out, row_q, H, o_h, m_act & (s > 0), ACC)
              + load_rows(p_h0, row_b, H, o_h, m_act & (s == 0), ACC))
    dr, dh_prev = gru_rb_backward_reset(drh, r, h_prev)
    dr = tl.where(act, dr, 0.0)
    store_rows(p_dx, row, 3 * H, o_h, m, dr)
    store_rows(p_da, row_b, 2 * H, o_h, m, dr)
    store_rows(p_aux_all, row, H, o_h, m, tl.where(act, r * h_prev, 0.0))
    dh = load_rows(p_dh, row_b, H, o_h, m, ACC)
    store_rows(p_dh_out, row_b, H, o_h, m, tl.where(act, dh + dh_prev, dh))


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
    m_act = active[:, None] & m_p[None, :]
    row_b = o_b.to(tl.int64)
    row = t.to(tl.int64) * B + o_b
    act = active[:, None]

    carry = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_NEXT:
        carry = matmul(carry, p_da_next, row_b, 4 * H, m_b, 4 * H, p_w_hh, P, 1, o_p, m_p,
                       BLOCK_K, DOT)
    carry += load_rows(p_dh, row_b, P, o_p, m, ACC)
    total = tl.where(act, carry + load_rows(p_gout, row, P, o_p, m_act, ACC), 0.0)
    store_rows(p_dh_tot, row_b, P, o_p, m, total)
    store_rows(p_dh_tot_all, row, P, o_p, m, total)
    store_rows(p_dh_out, row_b, P, o_p, m, tl.where(act, 0.0, carry))


@triton.autotune(configs=step_configs(), key=["I", "H", "P"])
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
    row_b = o_b.to(tl.int64)
    n_x = tl.cdiv(I, BLOCK_H)
    acc = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if i_n < n_x:
        o_n = i_n * BLOCK_H + tl.arange(0, BLOCK_H)
        m_n = o_n < I
        acc = matmul(acc, p_dx, row_b, GH, m_b, GH, p_w_ih, I, 1, o_n, m_n, BLOCK_K, DOT)
        store_rows(p_gx, row_b, I, o_n, m_b[:, None] & m_n[None, :], acc)
    else:
        o_n = (i_n - n_x) * BLOCK_H + tl.arange(0, BLOCK_H)
        m_n = o_n < P
        m = m_b[:, None] & m_n[None, :]
        acc = matmul(acc, p_da, row_b, DA, m_b, DA, p_w_hh, P, 1, o_n, m_n, BLOCK_K, DOT)
        acc += load_rows(p_dh, row_b, P, o_n, m, ACC)
        store_rows(p_gh, row_b, P, o_n, m, acc)
