"""The per-step forward kernels (see :mod:`rnnkern.triton.step`): the gates and
the state update, the reset-before GRU's candidate, the LSTM projection, and
the layer-normalised LSTM's two stages."""
import triton
import triton.language as tl

from ..cells import (GRU, GRU_RESET_BEFORE, LSTM, RNN_RELU, gru_forward, gru_rb_candidate,
                     gru_rb_gates, ln_normalize, ln_rstd, lstm_candidate, lstm_forward, lstm_gates,
                     lstm_ln_output, lstm_ln_pre_activation, rnn_forward, zoneout_forward)
from ..tiles import load_gate_vectors, load_vector, matmul, matmul_gates, zoneout_rows
from ..tuning import row_configs, step_configs
from .tile import next_resets, step_rows, step_tile, store_next_state


@triton.autotune(configs=step_configs(), key=["CELL", "I", "H", "P", "HAS_X", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def gates_forward_kernel(
        p_x, p_w_ih, p_xproj, p_h, p_c, p_w_hh, p_b_ih, p_b_hh, p_len,
        p_out, p_h_next, p_c_next, p_ws, p_aux, p_h0, p_c0, p_resets, p_zo, p_c_steps,
        s, T, B, I, H, P, s_zt, s_zb, s_zu,
        B_CLASS, CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_X: tl.constexpr,
        HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr,
        REVERSE: tl.constexpr, TRAIN: tl.constexpr, HAS_PROJ: tl.constexpr,
        STORE_STATE: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr,
        CELL_STEPS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step s for a tile of rows x units.

    x part: ``x [B, I] W_ih^T`` (HAS_X, the single-step op) or the rows of
    ``xproj [T, B, G*H]`` at each row's position (the recurrence); h part:
    ``h [B, P] W_hh^T``.  Writes h into ``out`` [T, B, P] at the row's position
    (zeros for a finished row), the new states into h_next [B, P] and c_next
    [B, H] when STORE_STATE (a finished row keeps its state; with resets,
    h0 / c0 where the next step is a reset), the workspace when TRAIN.  The
    reset-before GRU stops after its first stage and the LSTM with projection
    before it: both leave their intermediate values in aux ([B, 4H]: r, z, xn,
    r*h; or [B, H]: o*tanh c~) for the next kernel.  With zoneout ([T, B, Z],
    strides s_z*) the states blend with the ones the step started from (h, c).
    """
    gates_forward_tile(p_x, p_w_ih, p_xproj, p_h, p_c, p_w_hh, p_b_ih, p_b_hh, p_len, p_out,
                       p_h_next, p_c_next, p_ws, p_aux, p_h0, p_c0, p_resets, p_zo, p_c_steps, s,
                       T, B, I, H, P, s_zt, s_zb, s_zu, CELL, G, WS, HAS_X, HAS_B_IH,
                       HAS_B_HH, HAS_LENGTHS, REVERSE, TRAIN, HAS_PROJ, STORE_STATE, HAS_RESETS,
                       HAS_ZONEOUT, CELL_STEPS, ACC, DOT, BLOCK_B, BLOCK_H, BLOCK_K)


@triton.jit
def gates_forward_tile(
        p_x, p_w_ih, p_xproj, p_h, p_c, p_w_hh, p_b_ih, p_b_hh, p_len,
        p_out, p_h_next, p_c_next, p_ws, p_aux, p_h0, p_c0, p_resets, p_zo, p_c_steps,
        s, T, B, I, H, P, s_zt, s_zb, s_zu,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_X: tl.constexpr,
        HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr,
        REVERSE: tl.constexpr, TRAIN: tl.constexpr, HAS_PROJ: tl.constexpr,
        STORE_STATE: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr,
        CELL_STEPS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of gates_forward_kernel: step s for the tile of program
    (i_b, i_h), also called once per step by the spread kernel (:mod:`..spread`)."""
    o_b, o_h, m_b, m_h, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, H, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
    m_act = act & m_h[None, :]
    o_bh = o_b64[:, None] * H + o_h[None, :]  # this tile of a [B, H] tensor
    o_bp = o_b64[:, None] * P + o_h[None, :]  # ... of a [B, P] one (P = H here)
    GH = G * H
    # rows whose next step starts from the reset state (p_h0 / p_c0: rnnkern/triton/ops.py)
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)

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
    if CELL == GRU or CELL == GRU_RESET_BEFORE:
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
            if HAS_ZONEOUT:
                m_zc = zoneout_rows(p_zo + P * s_zu, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
                c = zoneout_forward(m_zc, c_prev, c)
            store_next_state(p_c_next, o_bh, m, act, c, c_prev, p_c0, nr, HAS_RESETS, ACC)
            if CELL_STEPS:  # c_t at its position [T, B, H] (zeros past a row's length)
                tl.store(p_c_steps + row * H + o_h[None, :],
                         tl.where(act, c, 0.0).to(p_c_steps.dtype.element_ty), mask=m)
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
            if TRAIN and HAS_ZONEOUT:  # the backward needs the candidate, not the blend
                tl.store(p_w, tl.where(act, h, 0.0).to(WS_DTYPE), mask=m)

        if HAS_PROJ:  # projected (and zoned out) by projection_forward_kernel
            tl.store(p_aux + o_bh, h.to(p_aux.dtype.element_ty), mask=m)
        else:
            if CELL != GRU:
                if STORE_STATE or HAS_ZONEOUT:
                    h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
            if HAS_ZONEOUT:
                m_zh = zoneout_rows(p_zo, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
                h = zoneout_forward(m_zh, h_prev, h)
            tl.store(p_out + row * P + o_h[None, :],
                     tl.where(act, h, 0.0).to(p_out.dtype.element_ty), mask=m)
            if STORE_STATE:
                store_next_state(p_h_next, o_bp, m, act, h, h_prev, p_h0, nr, HAS_RESETS, ACC)


@triton.autotune(configs=step_configs(), key=["H", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def gru_rb_candidate_kernel(
        p_aux, p_h, p_w_hh, p_b_hh, p_len, p_out, p_h_next, p_ws, p_h0, p_resets, p_zo,
        s, T, B, H, s_zt, s_zb, s_zu,
        B_CLASS, HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        TRAIN: tl.constexpr, STORE_STATE: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reset-before GRU, stage 2 of step s: hn = (r*h) W_hn^T + b_hn from the
    r*h of every unit (aux, from gates_forward_kernel), the candidate and h
    (zoneout, the next step's start state as gates_forward_kernel)."""
    gru_rb_candidate_tile(p_aux, p_h, p_w_hh, p_b_hh, p_len, p_out, p_h_next, p_ws, p_h0,
                          p_resets, p_zo, s, T, B, H, s_zt, s_zb, s_zu, HAS_B_HH, HAS_LENGTHS,
                          REVERSE, TRAIN, STORE_STATE, HAS_RESETS, HAS_ZONEOUT, ACC, DOT, BLOCK_B,
                          BLOCK_H, BLOCK_K)


@triton.jit
def gru_rb_candidate_tile(
        p_aux, p_h, p_w_hh, p_b_hh, p_len, p_out, p_h_next, p_ws, p_h0, p_resets, p_zo,
        s, T, B, H, s_zt, s_zb, s_zu,
        HAS_B_HH: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        TRAIN: tl.constexpr, STORE_STATE: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of gru_rb_candidate_kernel, also called once per step by the spread kernel
    (:mod:`..spread`)."""
    o_b, o_h, m_b, m_h, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, H, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
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
    if HAS_ZONEOUT:
        h = zoneout_forward(zoneout_rows(p_zo, t, o_b, o_h, act & m_h[None, :], s_zt, s_zb, s_zu,
                                         ACC), h_prev, h)
    tl.store(p_out + row * H + o_h[None, :], tl.where(act, h, 0.0).to(p_out.dtype.element_ty),
             mask=m)
    if STORE_STATE:
        nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)
        store_next_state(p_h_next, o_bh, m, act, h, h_prev, p_h0, nr, HAS_RESETS, ACC)
    if TRAIN:
        p_w = p_ws + row * (3 * H) + o_h[None, :]
        tl.store(p_w, tl.where(act, r, 0.0).to(p_ws.dtype.element_ty), mask=m)
        tl.store(p_w + H, tl.where(act, z, 0.0).to(p_ws.dtype.element_ty), mask=m)
        tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(p_ws.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["H", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def projection_forward_kernel(
        p_aux, p_w_hr, p_h, p_len, p_out, p_h_next, p_h0, p_resets, p_zo,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        B_CLASS, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """LSTM projection of step s for a tile of rows x outputs (BLOCK_H of the P
    outputs): h = (o * tanh c) W_hr^T, from aux [B, H] (zoneout, the next
    step's start state as gates_forward_kernel)."""
    projection_forward_tile(p_aux, p_w_hr, p_h, p_len, p_out, p_h_next, p_h0, p_resets, p_zo, s,
                            T, B, H, P, s_zt, s_zb, s_zu, HAS_LENGTHS, REVERSE, HAS_RESETS,
                            HAS_ZONEOUT, ACC, DOT, BLOCK_B, BLOCK_H, BLOCK_K)


@triton.jit
def projection_forward_tile(
        p_aux, p_w_hr, p_h, p_len, p_out, p_h_next, p_h0, p_resets, p_zo,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of projection_forward_kernel, also called once per step by the spread kernel
    (:mod:`..spread`)."""
    o_b, o_p, m_b, m_p, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, P, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
    o_bp = o_b64[:, None] * P + o_p[None, :]

    h = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    h = matmul(h, p_aux, o_b64, H, m_b, H, p_w_hr, 1, H, o_p, m_p, BLOCK_K, DOT)
    h_prev = tl.load(p_h + o_bp, mask=m, other=0.0).to(ACC)
    if HAS_ZONEOUT:
        h = zoneout_forward(zoneout_rows(p_zo, t, o_b, o_p, act & m_p[None, :], s_zt, s_zb, s_zu,
                                         ACC), h_prev, h)
    tl.store(p_out + row * P + o_p[None, :], tl.where(act, h, 0.0).to(p_out.dtype.element_ty),
             mask=m)
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)
    store_next_state(p_h_next, o_bp, m, act, h, h_prev, p_h0, nr, HAS_RESETS, ACC)


@triton.autotune(configs=step_configs(), key=["I", "H", "HAS_X", "B_CLASS"])
@triton.jit(do_not_specialize=["B_CLASS"])
def ln_projections_kernel(
        p_x, p_w_ih, p_h, p_w_hh, p_xr, p_hr,
        B, I, H,
        B_CLASS, HAS_X: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """LSTM-LN, stage 1, for a tile of rows x units of the four gates: the raw
    products hr = h [B, H] W_hh^T and, when HAS_X (the single-step op),
    xr = x [B, I] W_ih^T, each [B, 4H]; their layer norms need whole rows
    (lstm_ln_forward_kernel)."""
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_b, m_h = o_b < B, o_h < H
    m = m_b[:, None] & m_h[None, :]
    o_b64 = o_b.to(tl.int64)
    o_r = o_b64[:, None] * (4 * H) + o_h[None, :]
    if HAS_X:
        acc0 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        acc1 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        acc3 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_x, o_b64, I, m_b, I,
                                              p_w_ih, H * I, 1, I, o_h, m_h, 4, BLOCK_K, DOT)
        XR_DTYPE = p_xr.dtype.element_ty
        tl.store(p_xr + o_r, acc0.to(XR_DTYPE), mask=m)
        tl.store(p_xr + o_r + H, acc1.to(XR_DTYPE), mask=m)
        tl.store(p_xr + o_r + 2 * H, acc2.to(XR_DTYPE), mask=m)
        tl.store(p_xr + o_r + 3 * H, acc3.to(XR_DTYPE), mask=m)
    acc0 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc1 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc2 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc3 = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    acc0, acc1, acc2, acc3 = matmul_gates(acc0, acc1, acc2, acc3, p_h, o_b64, H, m_b, H,
                                          p_w_hh, H * H, 1, H, o_h, m_h, 4, BLOCK_K, DOT)
    HR_DTYPE = p_hr.dtype.element_ty
    tl.store(p_hr + o_r, acc0.to(HR_DTYPE), mask=m)
    tl.store(p_hr + o_r + H, acc1.to(HR_DTYPE), mask=m)
    tl.store(p_hr + o_r + 2 * H, acc2.to(HR_DTYPE), mask=m)
    tl.store(p_hr + o_r + 3 * H, acc3.to(HR_DTYPE), mask=m)


@triton.autotune(configs=row_configs(), key=["H", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def lstm_ln_forward_kernel(
        p_xp, p_hr, p_h, p_c, p_b_ih, p_b_hh, p_ln, p_len, p_out, p_h_next, p_c_next, p_ws,
        p_tmp, p_h0, p_c0, p_resets, p_zo,
        s, T, B, H, s_zt, s_zb, s_zu,
        B_CLASS, WS: tl.constexpr, HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, TRAIN: tl.constexpr,
        STORE_STATE: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr,
        ACC: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """LSTM-LN, stage 2 of step s, for BLOCK_B whole rows (the units in chunks
    of BLOCK_H): the layer norms of x W_ih^T (the rows of xp [T, B, 4H] at each
    row's position; the single-step op passes its xr as T = 1) and of
    hr = h W_hh^T [B, 4H], the gates, the cell norm of c~, h~; zoneout with the
    start states h, c [B, H].  Writes out [T, B, H] (zeros for a finished row),
    c_next [B, H] always (the single-step op's c_new), h_next when STORE_STATE
    (h0 / c0 where the next step is a reset), the workspace when TRAIN.
    tmp [B, 2H] holds c~ and o between the passes.  Row statistics in ACC
    (float32, float64 for float64), two passes (mean, then deviations) as torch."""
    o_b, m_b, active, act, t, o_b64, row = step_rows(p_len, s, T, B, HAS_LENGTHS, REVERSE, BLOCK_B)
    p_x = p_xp + row * (4 * H)
    p_r = p_hr + o_b64[:, None] * (4 * H)
    p_w = p_ws + row * WS
    p_t = p_tmp + o_b64[:, None] * (2 * H)
    o_j = tl.arange(0, BLOCK_H)
    WS_DTYPE = p_ws.dtype.element_ty
    TMP_DTYPE = p_tmp.dtype.element_ty
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)

    # The means of the two 4H rows ...
    sum_x = tl.zeros([BLOCK_B], ACC)
    sum_h = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m = m_b[:, None] & (o_u < H)[None, :]
        m_x = act & (o_u < H)[None, :]
        p_xu = p_x + o_u[None, :]
        p_ru = p_r + o_u[None, :]
        sum_x += tl.sum(tl.load(p_xu, mask=m_x, other=0.0).to(ACC)
                        + tl.load(p_xu + H, mask=m_x, other=0.0).to(ACC)
                        + tl.load(p_xu + 2 * H, mask=m_x, other=0.0).to(ACC)
                        + tl.load(p_xu + 3 * H, mask=m_x, other=0.0).to(ACC), axis=1)
        sum_h += tl.sum(tl.load(p_ru, mask=m, other=0.0).to(ACC)
                        + tl.load(p_ru + H, mask=m, other=0.0).to(ACC)
                        + tl.load(p_ru + 2 * H, mask=m, other=0.0).to(ACC)
                        + tl.load(p_ru + 3 * H, mask=m, other=0.0).to(ACC), axis=1)
    mean_x = (sum_x / (4 * H))[:, None]
    mean_h = (sum_h / (4 * H))[:, None]
    # ... their variances ...
    sum_x = tl.zeros([BLOCK_B], ACC)
    sum_h = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m = m_b[:, None] & (o_u < H)[None, :]
        m_x = act & (o_u < H)[None, :]
        p_xu = p_x + o_u[None, :]
        p_ru = p_r + o_u[None, :]
        for k in tl.static_range(4):
            v = tl.where(m, tl.load(p_xu + k * H, mask=m_x, other=0.0).to(ACC) - mean_x, 0.0)
            sum_x += tl.sum(v * v, axis=1)
            v = tl.where(m, tl.load(p_ru + k * H, mask=m, other=0.0).to(ACC) - mean_h, 0.0)
            sum_h += tl.sum(v * v, axis=1)
    rstd_x = ln_rstd(sum_x / (4 * H))[:, None]
    rstd_h = ln_rstd(sum_h / (4 * H))[:, None]
    # ... the gates and c~ (kept in tmp with o), and the mean of c~ ...
    sum_c = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m_u = o_u < H
        m = m_b[:, None] & m_u[None, :]
        m_x = act & m_u[None, :]
        p_xu = p_x + o_u[None, :]
        p_ru = p_r + o_u[None, :]
        xh0 = ln_normalize(tl.load(p_xu, mask=m_x, other=0.0).to(ACC), mean_x, rstd_x)
        xh1 = ln_normalize(tl.load(p_xu + H, mask=m_x, other=0.0).to(ACC), mean_x, rstd_x)
        xh2 = ln_normalize(tl.load(p_xu + 2 * H, mask=m_x, other=0.0).to(ACC), mean_x, rstd_x)
        xh3 = ln_normalize(tl.load(p_xu + 3 * H, mask=m_x, other=0.0).to(ACC), mean_x, rstd_x)
        hh0 = ln_normalize(tl.load(p_ru, mask=m, other=0.0).to(ACC), mean_h, rstd_h)
        hh1 = ln_normalize(tl.load(p_ru + H, mask=m, other=0.0).to(ACC), mean_h, rstd_h)
        hh2 = ln_normalize(tl.load(p_ru + 2 * H, mask=m, other=0.0).to(ACC), mean_h, rstd_h)
        hh3 = ln_normalize(tl.load(p_ru + 3 * H, mask=m, other=0.0).to(ACC), mean_h, rstd_h)
        gx0, gx1, gx2, gx3 = load_gate_vectors(p_ln, o_u, m_u, H, 4, True, ACC)
        gh0, gh1, gh2, gh3 = load_gate_vectors(p_ln + 4 * H, o_u, m_u, H, 4, True, ACC)
        bi0, bi1, bi2, bi3 = load_gate_vectors(p_b_ih, o_u, m_u, H, 4, HAS_B_IH, ACC)
        bh0, bh1, bh2, bh3 = load_gate_vectors(p_b_hh, o_u, m_u, H, 4, HAS_B_HH, ACC)
        i, f, g, o = lstm_gates(lstm_ln_pre_activation(xh0, hh0, gx0, gh0, bi0 + bh0),
                                lstm_ln_pre_activation(xh1, hh1, gx1, gh1, bi1 + bh1),
                                lstm_ln_pre_activation(xh2, hh2, gx2, gh2, bi2 + bh2),
                                lstm_ln_pre_activation(xh3, hh3, gx3, gh3, bi3 + bh3))
        c = lstm_candidate(i, f, g, tl.load(p_c + o_b64[:, None] * H + o_u[None, :], mask=m,
                                            other=0.0).to(ACC))
        sum_c += tl.sum(tl.where(m, c, 0.0), axis=1)
        tl.store(p_t + o_u[None, :], c.to(TMP_DTYPE), mask=m)
        tl.store(p_t + H + o_u[None, :], o.to(TMP_DTYPE), mask=m)
        if TRAIN:
            p_wu = p_w + o_u[None, :]
            tl.store(p_wu, tl.where(act, i, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + H, tl.where(act, f, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 2 * H, tl.where(act, g, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 3 * H, tl.where(act, o, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 5 * H, tl.where(act, xh0, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 6 * H, tl.where(act, xh1, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 7 * H, tl.where(act, xh2, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 8 * H, tl.where(act, xh3, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 9 * H, tl.where(act, hh0, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 10 * H, tl.where(act, hh1, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 11 * H, tl.where(act, hh2, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 12 * H, tl.where(act, hh3, 0.0).to(WS_DTYPE), mask=m)
    mean_c = (sum_c / H)[:, None]
    # (tmp is read back by other threads of the program: a block-wide barrier)
    tl.debug_barrier()
    # ... the variance of c~ ...
    sum_c = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m = m_b[:, None] & (o_u < H)[None, :]
        v = tl.where(m, tl.load(p_t + o_u[None, :], mask=m, other=0.0).to(ACC) - mean_c, 0.0)
        sum_c += tl.sum(v * v, axis=1)
    rstd_c = ln_rstd(sum_c / H)[:, None]
    # ... and the output, zoneout and the states.
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m_u = o_u < H
        m = m_b[:, None] & m_u[None, :]
        o_bu = o_b64[:, None] * H + o_u[None, :]
        c = tl.load(p_t + o_u[None, :], mask=m, other=0.0).to(ACC)
        o = tl.load(p_t + H + o_u[None, :], mask=m, other=0.0).to(ACC)
        ch = ln_normalize(c, mean_c, rstd_c)
        h = lstm_ln_output(o, ch, load_vector(p_ln + 8 * H, o_u, m_u, True, ACC)[None, :],
                           load_vector(p_ln + 9 * H, o_u, m_u, True, ACC)[None, :])
        c_prev = tl.load(p_c + o_bu, mask=m, other=0.0).to(ACC)
        if HAS_ZONEOUT:
            m_zu = act & m_u[None, :]
            h_prev = tl.load(p_h + o_bu, mask=m, other=0.0).to(ACC)
            h = zoneout_forward(zoneout_rows(p_zo, t, o_b, o_u, m_zu, s_zt, s_zb, s_zu, ACC),
                                h_prev, h)
            c = zoneout_forward(zoneout_rows(p_zo + H * s_zu, t, o_b, o_u, m_zu, s_zt, s_zb,
                                             s_zu, ACC), c_prev, c)
        tl.store(p_out + row * H + o_u[None, :], tl.where(act, h, 0.0).to(p_out.dtype.element_ty),
                 mask=m)
        store_next_state(p_c_next, o_bu, m, act, c, c_prev, p_c0, nr, HAS_RESETS, ACC)
        if STORE_STATE:
            if not HAS_ZONEOUT:
                h_prev = tl.load(p_h + o_bu, mask=m, other=0.0).to(ACC)
            store_next_state(p_h_next, o_bu, m, act, h, h_prev, p_h0, nr, HAS_RESETS, ACC)
        if TRAIN:
            p_wu = p_w + o_u[None, :]
            tl.store(p_wu + 4 * H, tl.where(act, c, 0.0).to(WS_DTYPE), mask=m)
            tl.store(p_wu + 13 * H, tl.where(act, ch, 0.0).to(WS_DTYPE), mask=m)
    if TRAIN:
        m_r = m_b[:, None]
        tl.store(p_w + 14 * H, tl.where(act, rstd_x, 0.0).to(WS_DTYPE), mask=m_r)
        tl.store(p_w + 14 * H + 1, tl.where(act, rstd_h, 0.0).to(WS_DTYPE), mask=m_r)
        tl.store(p_w + 14 * H + 2, tl.where(act, rstd_c, 0.0).to(WS_DTYPE), mask=m_r)
