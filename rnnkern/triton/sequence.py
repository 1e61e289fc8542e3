"""Sequence kernels: the whole time loop inside one launch.

One program owns BLOCK_B batch rows and every hidden unit.  It loads W_hh (and
W_hr) once into shared memory, keeps h (and c) in registers in the accumulate
dtype for all T steps, and per step runs the recurrent product ``h W_hh^T`` as
one tl.dot per gate, fused with the gates; only xproj is read and the outputs
and the workspace written.  The backward runs BPTT the same way, carrying dh
and dc on chip.  The programs are independent (no grid-wide barrier), so the
interpreter, which runs them one after another, computes the same thing.
With lengths a program runs the steps of its longest row only, and writes the
zeros of the padding positions after them (tiles.sequence_steps): the blocks
of a packed batch's short rows (sorted longest first) cost their real steps.

That needs the weights to fit on chip: :func:`fits_on_chip` states the limit
and the host wrapper (:mod:`.ops`) takes the per-step kernels of :mod:`.step`
for larger sizes.  The gate formulas come from :mod:`.cells`.

The step options (resets, zoneout) and the LayerNorm cell are constexpr flags, so the kernels without them are
the same code as before: HAS_RESETS (the step at a reset position starts from
h0 / c0, kept on chip; its start state's gradient goes to grad_h0 / grad_c0),
HAS_ZONEOUT (the blend of the start state and the candidate, the mask read
through its strides), and the cell LSTM_LN, whose three layer norms reduce
over rows the program holds whole (4H and H units).
"""
import torch
import triton
import triton.language as tl

from ..reference import gate_count
from .cells import (GRU, GRU_RESET_BEFORE, LSTM, LSTM_LN, RNN_RELU, gru_backward, gru_forward,
                    gru_rb_backward_candidate, gru_rb_backward_reset, gru_rb_candidate,
                    gru_rb_gates, ln_backward, ln_normalize, ln_rstd, lstm_backward,
                    lstm_candidate, lstm_forward, lstm_gates, lstm_hidden, lstm_ln_backward_gates,
                    lstm_ln_backward_output, lstm_ln_output, lstm_ln_pre_activation, rnn_backward,
                    rnn_forward, zoneout_forward, zoneout_to_candidate, zoneout_to_prev)
from .tiles import (load_gate_vectors, load_rows, load_vector, load_weight, positions,
                    previous_position, reset_rows, sequence_steps, store_rows, zero_rows,
                    zoneout_rows)
from .tuning import INTERPRET, MIN_DOT, loop_configs

#: Bytes of weights (W_hh, plus W_hr with a projection, in their storage dtype,
#: padded to powers of two) a loop kernel keeps on chip for a whole sequence.
#: Triton places them in shared memory once, before the time loop (checked in
#: the sm_90 TTGIR: the local_alloc of the W tiles is hoisted, each step only
#: reads them into the mma operands).  128 KiB fits the shared memory of an
#: A100 / H100 SM (164 / 227 KiB) with room for the rest; beyond it the
#: per-step kernels run.
ON_CHIP_BYTES = 128 * 1024


def block_size(n: int) -> int:
    """The block side holding n units: a power of two, at least a tl.dot side."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def on_chip_bytes(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool = False) -> int:
    """Bytes of weights the loop kernels hold on chip for these sizes."""
    elems = gate_count(cell) * block_size(H) * block_size(P)
    if proj:
        elems += block_size(H) * block_size(P)
    return elems * dtype.itemsize


def loop_compiles(dtype: torch.dtype, options: bool) -> bool:
    """Whether Triton compiles the time-loop kernels of this case for a GPU.
    float64 with resets or zoneout does not (Triton 3.6 and 3.8 for sm_90: with
    the reset state blended into the tl.dot operand, the float64 MMA lowering
    fails: "Currently fp64 don't support largeK MMA", PassManager::run failed),
    so those cases run on the per-step kernels, which compile.  The interpreter
    compiles nothing and runs both."""
    return INTERPRET or not (dtype == torch.float64 and options)


def fits_on_chip(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool = False) -> bool:
    """Whether the in-kernel time loop serves these sizes: the padded weights
    take at most ON_CHIP_BYTES.  With 128 KiB (blocks are powers of two): for
    float16 / bfloat16 LSTM and GRU up to H = 128, RNN up to H = 256; for
    float32 and float64 LSTM and GRU up to H = 64, RNN up to H = 128.  An LSTM
    projection adds one more [H, P] block."""
    return on_chip_bytes(cell, H, P, dtype, proj) <= ON_CHIP_BYTES


@triton.autotune(configs=loop_configs(), key=["CELL", "H", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["T", "B_CLASS"])
def forward_loop_kernel(
        p_xproj, p_h0, p_c0, p_w_hh, p_b_ih, p_b_hh, p_w_hr, p_len, p_resets, p_zo, p_ln,
        p_rh, p_rc, p_out, p_h_n, p_c_n, p_ws,
        T, B, H, P, s_zt, s_zb, s_zu,
        B_CLASS, CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr,
        HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr, HAS_PROJ: tl.constexpr,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, TRAIN: tl.constexpr,
        HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr, HAS_RESET_STATE: tl.constexpr,
        CELL_STEPS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """The forward of a whole sequence for BLOCK_B rows (ops.cpp conventions).

    xproj [T, B, G*H], h0 [B, P], c0 [B, H], w_hh [G*H, P], w_hr [P, H] ->
    out [T, B, P], h_n [B, P], c_n [B, H], workspace [T, B, WS] when TRAIN.
    resets [T, B] bool (HAS_RESETS), zoneout [T, B, Z] with strides s_z*
    (HAS_ZONEOUT), ln [10H] (LSTM_LN), the reset state rh [B, P], rc [B, H]
    (HAS_RESET_STATE; else a reset restarts from h0, c0; a row's first step
    starts from h0, c0 whatever resets says).  CELL_STEPS (LSTM): c_n is
    [T, B, H], the state after every step at its position (zeros past a row's
    length).
    BLOCK_H >= H and BLOCK_P >= P: every unit is in the program."""
    i_b = tl.program_id(0)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = tl.arange(0, BLOCK_H)
    o_p = tl.arange(0, BLOCK_P)
    m_b, m_h, m_p = o_b < B, o_h < H, o_p < P
    m_bh = m_b[:, None] & m_h[None, :]
    m_bp = m_b[:, None] & m_p[None, :]
    row_b = o_b.to(tl.int64)
    GH = G * H

    # W_g^T [BLOCK_P, BLOCK_H] per gate, loaded once: element (p, j) = w_hh[g*H + j, p].
    b_w0 = load_weight(p_w_hh, o_p, m_p, 1, o_h, m_h, P, DOT)
    if G > 1:
        b_w1 = load_weight(p_w_hh + H * P, o_p, m_p, 1, o_h, m_h, P, DOT)
        b_w2 = load_weight(p_w_hh + 2 * H * P, o_p, m_p, 1, o_h, m_h, P, DOT)
    if G > 3:
        b_w3 = load_weight(p_w_hh + 3 * H * P, o_p, m_p, 1, o_h, m_h, P, DOT)
    if HAS_PROJ:
        # W_hr^T [BLOCK_H, BLOCK_P]: element (j, p) = w_hr[p, j].
        b_wr = load_weight(p_w_hr, o_h, m_h, 1, o_p, m_p, H, DOT)
    bi0, bi1, bi2, bi3 = load_gate_vectors(p_b_ih, o_h, m_h, H, G, HAS_B_IH, ACC)
    bh0, bh1, bh2, bh3 = load_gate_vectors(p_b_hh, o_h, m_h, H, G, HAS_B_HH, ACC)
    # Every gate but the GRU candidate takes the sum of the two biases.
    b0, b1, b2, b3 = bi0 + bh0, bi1 + bh1, bi2 + bh2, bi3 + bh3
    if CELL == LSTM_LN:
        # The layer norms' gains per gate (zeros beyond H: the masked units of a
        # normalised row then add nothing), the cell norm's gain and shift.
        gx0, gx1, gx2, gx3 = load_gate_vectors(p_ln, o_h, m_h, H, 4, True, ACC)
        gh0, gh1, gh2, gh3 = load_gate_vectors(p_ln + 4 * H, o_h, m_h, H, 4, True, ACC)
        g_c = load_vector(p_ln + 8 * H, o_h, m_h, True, ACC)[None, :]
        beta_c = load_vector(p_ln + 9 * H, o_h, m_h, True, ACC)[None, :]
    WS_DTYPE = p_ws.dtype.element_ty
    OUT_DTYPE = p_out.dtype.element_ty

    # The state, on chip for the whole sequence.
    b_h = load_rows(p_h0, row_b, P, o_p, m_bp, ACC)
    if CELL == LSTM or CELL == LSTM_LN:
        b_c = load_rows(p_c0, row_b, H, o_h, m_bh, ACC)
    if HAS_RESETS:  # the states a reset step starts from
        if HAS_RESET_STATE:
            b_rh = load_rows(p_rh, row_b, P, o_p, m_bp, ACC)
            if CELL == LSTM or CELL == LSTM_LN:
                b_rc = load_rows(p_rc, row_b, H, o_h, m_bh, ACC)
        else:
            b_rh = b_h
            if CELL == LSTM or CELL == LSTM_LN:
                b_rc = b_c

    T_run = sequence_steps(p_len, o_b, m_b, T, HAS_LENGTHS)
    for s in range(0, T_run):
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        row = t.to(tl.int64)[:, None] * B + o_b[:, None]
        if HAS_RESETS:  # (not at the first step)
            rs = reset_rows(p_resets, t, o_b, active, B)[:, None] & (s > 0)
            b_h = tl.where(rs, b_rh, b_h)
            if CELL == LSTM or CELL == LSTM_LN:
                b_c = tl.where(rs, b_rc, b_c)
        # Pointers of this step's rows: xproj and the workspace (gate k at + k*H), the output.
        p_x = p_xproj + row * GH + o_h[None, :]
        p_w = p_ws + row * WS + o_h[None, :]
        zero = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        b_hd = b_h.to(DOT)
        x0 = tl.load(p_x, mask=m_act, other=0.0).to(ACC)
        hp0 = tl.dot(b_hd, b_w0, zero, input_precision="ieee", out_dtype=ACC)
        if CELL == LSTM:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            x3 = tl.load(p_x + 3 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee", out_dtype=ACC)
            hp2 = tl.dot(b_hd, b_w2, zero, input_precision="ieee", out_dtype=ACC)
            hp3 = tl.dot(b_hd, b_w3, zero, input_precision="ieee", out_dtype=ACC)
            i, f, g, o, c, h = lstm_forward(x0 + hp0 + b0, x1 + hp1 + b1, x2 + hp2 + b2,
                                            x3 + hp3 + b3, b_c)
            if HAS_ZONEOUT:
                m_zc = zoneout_rows(p_zo + P * s_zu, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
                c = zoneout_forward(m_zc, b_c, c)
            b_c = tl.where(act, c, b_c)
            if CELL_STEPS:
                tl.store(p_c_n + row * H + o_h[None, :],
                         tl.where(act, c, 0.0).to(p_c_n.dtype.element_ty), mask=m_bh)
            if TRAIN:
                tl.store(p_w, tl.where(act, i, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, f, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, g, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 3 * H, tl.where(act, o, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 4 * H, tl.where(act, c, 0.0).to(WS_DTYPE), mask=m_bh)
            if HAS_PROJ:
                h = tl.dot(h.to(DOT), b_wr, tl.zeros([BLOCK_B, BLOCK_P], ACC),
                           input_precision="ieee", out_dtype=ACC)
        elif CELL == LSTM_LN:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            x3 = tl.load(p_x + 3 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee", out_dtype=ACC)
            hp2 = tl.dot(b_hd, b_w2, zero, input_precision="ieee", out_dtype=ACC)
            hp3 = tl.dot(b_hd, b_w3, zero, input_precision="ieee", out_dtype=ACC)
            # The two gate layer norms over the 4H values of each row (masked
            # units load as 0 and are left out of the variance).
            mh = m_h[None, :]
            mean = tl.sum(x0 + x1 + x2 + x3, axis=1)[:, None] / (4 * H)
            v0, v1 = tl.where(mh, x0 - mean, 0.0), tl.where(mh, x1 - mean, 0.0)
            v2, v3 = tl.where(mh, x2 - mean, 0.0), tl.where(mh, x3 - mean, 0.0)
            rstd_x = ln_rstd(tl.sum(v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3, axis=1)[:, None]
                             / (4 * H))
            xh0, xh1 = ln_normalize(x0, mean, rstd_x), ln_normalize(x1, mean, rstd_x)
            xh2, xh3 = ln_normalize(x2, mean, rstd_x), ln_normalize(x3, mean, rstd_x)
            mean = tl.sum(hp0 + hp1 + hp2 + hp3, axis=1)[:, None] / (4 * H)
            v0, v1 = tl.where(mh, hp0 - mean, 0.0), tl.where(mh, hp1 - mean, 0.0)
            v2, v3 = tl.where(mh, hp2 - mean, 0.0), tl.where(mh, hp3 - mean, 0.0)
            rstd_h = ln_rstd(tl.sum(v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3, axis=1)[:, None]
                             / (4 * H))
            hh0, hh1 = ln_normalize(hp0, mean, rstd_h), ln_normalize(hp1, mean, rstd_h)
            hh2, hh3 = ln_normalize(hp2, mean, rstd_h), ln_normalize(hp3, mean, rstd_h)
            i, f, g, o = lstm_gates(lstm_ln_pre_activation(xh0, hh0, gx0, gh0, b0),
                                    lstm_ln_pre_activation(xh1, hh1, gx1, gh1, b1),
                                    lstm_ln_pre_activation(xh2, hh2, gx2, gh2, b2),
                                    lstm_ln_pre_activation(xh3, hh3, gx3, gh3, b3))
            c = lstm_candidate(i, f, g, b_c)
            # The cell layer norm over the H values of c~.
            mean = tl.sum(tl.where(mh, c, 0.0), axis=1)[:, None] / H
            v0 = tl.where(mh, c - mean, 0.0)
            rstd_c = ln_rstd(tl.sum(v0 * v0, axis=1)[:, None] / H)
            ch = ln_normalize(c, mean, rstd_c)
            h = lstm_ln_output(o, ch, g_c, beta_c)
            if HAS_ZONEOUT:
                m_zc = zoneout_rows(p_zo + P * s_zu, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
                c = zoneout_forward(m_zc, b_c, c)
            b_c = tl.where(act, c, b_c)
            if TRAIN:
                tl.store(p_w, tl.where(act, i, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, f, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, g, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 3 * H, tl.where(act, o, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 4 * H, tl.where(act, c, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 5 * H, tl.where(act, xh0, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 6 * H, tl.where(act, xh1, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 7 * H, tl.where(act, xh2, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 8 * H, tl.where(act, xh3, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 9 * H, tl.where(act, hh0, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 10 * H, tl.where(act, hh1, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 11 * H, tl.where(act, hh2, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 12 * H, tl.where(act, hh3, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 13 * H, tl.where(act, ch, 0.0).to(WS_DTYPE), mask=m_bh)
                # the rows' statistics (every unit of a row holds the same value: one stores)
                p_r = p_ws + row * WS + 14 * H + o_h[None, :] * 0
                m_r = m_b[:, None] & (o_h[None, :] == 0)
                tl.store(p_r, tl.where(act, rstd_x, 0.0).to(WS_DTYPE), mask=m_r)
                tl.store(p_r + 1, tl.where(act, rstd_h, 0.0).to(WS_DTYPE), mask=m_r)
                tl.store(p_r + 2, tl.where(act, rstd_c, 0.0).to(WS_DTYPE), mask=m_r)
        elif CELL == GRU:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee", out_dtype=ACC)
            hn = tl.dot(b_hd, b_w2, zero, input_precision="ieee", out_dtype=ACC) + bh2
            r, z, n, h = gru_forward(x0 + bi0, x1 + bi1, x2 + bi2, hp0 + bh0, hp1 + bh1, hn, b_h)
            if TRAIN:
                tl.store(p_w, tl.where(act, r, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, z, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 3 * H, tl.where(act, hn, 0.0).to(WS_DTYPE), mask=m_bh)
        elif CELL == GRU_RESET_BEFORE:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee", out_dtype=ACC)
            r, z, rh = gru_rb_gates(x0 + bi0, x1 + bi1, hp0 + bh0, hp1 + bh1, b_h)
            hn = tl.dot(rh.to(DOT), b_w2, zero, input_precision="ieee", out_dtype=ACC) + bh2
            n, h = gru_rb_candidate(x2 + bi2, hn, z, b_h)
            if TRAIN:
                tl.store(p_w, tl.where(act, r, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, z, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(WS_DTYPE), mask=m_bh)
        else:
            h = rnn_forward(x0 + hp0 + b0, CELL == RNN_RELU)
            if TRAIN and HAS_ZONEOUT:  # the backward needs the candidate, not the blend
                tl.store(p_w, tl.where(act, h, 0.0).to(WS_DTYPE), mask=m_bh)
        if HAS_ZONEOUT:  # h_t = m h_{t-1} + (1 - m) h~_t, h_{t-1} the state the step started from
            m_zh = zoneout_rows(p_zo, t, o_b, o_p, act & m_p[None, :], s_zt, s_zb, s_zu, ACC)
            h = zoneout_forward(m_zh, b_h, h)
        b_h = tl.where(act, h, b_h)
        tl.store(p_out + row * P + o_p[None, :], tl.where(act, h, 0.0).to(OUT_DTYPE), mask=m_bp)
    for s in range(T_run, T):  # padding for every row: zeros, as a finished row writes
        row_s = s * B + row_b
        zero_rows(p_out, row_s, P, o_p, m_b, BLOCK_P)
        if TRAIN:
            zero_rows(p_ws, row_s, WS, o_h, m_b, BLOCK_H)
        if CELL_STEPS:
            zero_rows(p_c_n, row_s, H, o_h, m_b, BLOCK_H)

    store_rows(p_h_n, row_b, P, o_p, m_bp, b_h)
    if (CELL == LSTM or CELL == LSTM_LN) and not CELL_STEPS:
        store_rows(p_c_n, row_b, H, o_h, m_bh, b_c)


@triton.autotune(configs=loop_configs(), key=["CELL", "H", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["T", "B_CLASS"])
def backward_loop_kernel(
        p_gout, p_dh_n, p_dc_n, p_h0, p_c0, p_w_hh, p_w_hr, p_out, p_ws, p_len, p_resets, p_zo,
        p_ln, p_rh, p_rc, p_dx, p_dh0, p_dc0, p_drh, p_drc, p_aux_all, p_dh_tot_all, p_da_all,
        p_dhr_all,
        T, B, H, P, s_zt, s_zb, s_zu,
        B_CLASS, CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_PROJ: tl.constexpr,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, HAS_RESET_STATE: tl.constexpr, CELL_STEPS: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """BPTT of a whole sequence for BLOCK_B rows, dh [B, P] and dc [B, H] carried
    on chip from grad_h_n, grad_c_n down to grad_h0, grad_c0.  CELL_STEPS
    (LSTM): grad_c_n is [T, B, H], each step's part added to the carry there.

    Writes dx [T, B, G*H] (the gradient of xproj, zeros at padding positions)
    and the time-ordered extras of the weight gradients: aux_all [T, B, H]
    (GRU: dhn; reset-before GRU: r*h_{t-1}; LSTM with projection: o*tanh c;
    LSTM-LN: dy, the gradient of c^ g_c + beta_c), with a projection
    dh_tot_all [T, B, P] (the gradient of each projected candidate h~_t), and
    for LSTM-LN da_all [T, B, 4H] (the gates' pre-activation gradients) and
    dhr_all [T, B, 4H] (the gradient of h_{t-1} W_hh^T, before its layer norm).
    A reset step's start state is h0 (c0), or with HAS_RESET_STATE rh (rc):
    the gradient of that state is summed into grad_h0 (grad_c0), or written
    to drh (drc), and nothing flows to the step before."""
    i_b = tl.program_id(0)
    o_b = i_b * BLOCK_B + tl.arange(0, BLOCK_B)
    o_h = tl.arange(0, BLOCK_H)
    o_p = tl.arange(0, BLOCK_P)
    m_b, m_h, m_p = o_b < B, o_h < H, o_p < P
    m_bh = m_b[:, None] & m_h[None, :]
    m_bp = m_b[:, None] & m_p[None, :]
    row_b = o_b.to(tl.int64)
    GH = G * H

    # W_g [BLOCK_H, BLOCK_P] per gate, loaded once: dh_{t-1} += dA_g W_g.
    b_w0 = load_weight(p_w_hh, o_h, m_h, P, o_p, m_p, 1, DOT)
    if G > 1:
        b_w1 = load_weight(p_w_hh + H * P, o_h, m_h, P, o_p, m_p, 1, DOT)
        b_w2 = load_weight(p_w_hh + 2 * H * P, o_h, m_h, P, o_p, m_p, 1, DOT)
    if G > 3:
        b_w3 = load_weight(p_w_hh + 3 * H * P, o_h, m_h, P, o_p, m_p, 1, DOT)
    if HAS_PROJ:
        b_wr = load_weight(p_w_hr, o_p, m_p, H, o_h, m_h, 1, DOT)  # W_hr [BLOCK_P, BLOCK_H]
    if CELL == LSTM_LN:
        gx0, gx1, gx2, gx3 = load_gate_vectors(p_ln, o_h, m_h, H, 4, True, ACC)
        gh0, gh1, gh2, gh3 = load_gate_vectors(p_ln + 4 * H, o_h, m_h, H, 4, True, ACC)
        g_c = load_vector(p_ln + 8 * H, o_h, m_h, True, ACC)[None, :]
        beta_c = load_vector(p_ln + 9 * H, o_h, m_h, True, ACC)[None, :]

    b_dh = load_rows(p_dh_n, row_b, P, o_p, m_bp, ACC)
    b_h0 = load_rows(p_h0, row_b, P, o_p, m_bp, ACC)
    if CELL == LSTM or CELL == LSTM_LN:
        if CELL_STEPS:
            b_dc = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        else:
            b_dc = load_rows(p_dc_n, row_b, H, o_h, m_bh, ACC)
        b_c0 = load_rows(p_c0, row_b, H, o_h, m_bh, ACC)
    if HAS_RESETS:  # the gradients of the reset steps' start states
        if HAS_RESET_STATE:  # (which are not h0, c0)
            b_rh = load_rows(p_rh, row_b, P, o_p, m_bp, ACC)
            if CELL == LSTM or CELL == LSTM_LN:
                b_rc = load_rows(p_rc, row_b, H, o_h, m_bh, ACC)
        b_dh0 = tl.zeros([BLOCK_B, BLOCK_P], ACC)
        if CELL == LSTM or CELL == LSTM_LN:
            b_dc0 = tl.zeros([BLOCK_B, BLOCK_H], ACC)

    DX_DTYPE = p_dx.dtype.element_ty
    AUX_DTYPE = p_aux_all.dtype.element_ty
    # The steps past every row's length first: zeros where a finished row writes them.
    T_run = sequence_steps(p_len, o_b, m_b, T, HAS_LENGTHS)
    for s in range(T_run, T):
        row_s = s * B + row_b
        zero_rows(p_dx, row_s, GH, o_h, m_b, BLOCK_H)
        if CELL == GRU or CELL == GRU_RESET_BEFORE or CELL == LSTM_LN or HAS_PROJ:
            zero_rows(p_aux_all, row_s, H, o_h, m_b, BLOCK_H)
        if HAS_PROJ:
            zero_rows(p_dh_tot_all, row_s, P, o_p, m_b, BLOCK_P)
        if CELL == LSTM_LN:
            zero_rows(p_da_all, row_s, GH, o_h, m_b, BLOCK_H)
            zero_rows(p_dhr_all, row_s, GH, o_h, m_b, BLOCK_H)
    for i_s in range(T - T_run, T):
        s = T - 1 - i_s
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        m_actp = act & m_p[None, :]
        row = t.to(tl.int64)[:, None] * B + o_b[:, None]
        # The state the step started from: the output one step earlier (the saved
        # c there), or b_hs (b_cs): h0 (c0) at the first step, the reset state at
        # a reset.
        row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b[:, None]
        has_prev = s > 0
        b_hs = b_h0
        if CELL == LSTM or CELL == LSTM_LN:
            b_cs = b_c0
        if HAS_RESETS:  # (not at the first step)
            rs = reset_rows(p_resets, t, o_b, active, B)[:, None] & (s > 0)
            has_prev = (rs == 0) & has_prev
            if HAS_RESET_STATE:
                b_hs = tl.where(s > 0, b_rh, b_h0)
                if CELL == LSTM or CELL == LSTM_LN:
                    b_cs = tl.where(s > 0, b_rc, b_c0)
        p_w = p_ws + row * WS + o_h[None, :]
        p_d = p_dx + row * GH + o_h[None, :]
        p_a = p_aux_all + row * H + o_h[None, :]
        zero_p = tl.zeros([BLOCK_B, BLOCK_P], ACC)

        # The gradient of the state h_t; with zoneout, split between the start
        # state (direct) and the candidate h~_t (into the cell's backward).
        d = b_dh + tl.load(p_gout + row * P + o_p[None, :], mask=m_actp, other=0.0).to(ACC)
        if HAS_ZONEOUT:
            m_zh = zoneout_rows(p_zo, t, o_b, o_p, m_actp, s_zt, s_zb, s_zu, ACC)
            dh_zoned = zoneout_to_prev(m_zh, d)
            d = zoneout_to_candidate(m_zh, d)
        if CELL == LSTM or CELL == LSTM_LN:
            c_prev = tl.load(p_ws + row_q * WS + 4 * H + o_h[None, :], mask=m_act & has_prev,
                             other=0.0).to(ACC)
            c_prev = tl.where(has_prev, c_prev, b_cs)
            dc = b_dc  # the gradient of the state c_t, split alike
            if CELL_STEPS:
                dc += tl.load(p_dc_n + row * H + o_h[None, :], mask=m_act, other=0.0).to(ACC)
            if HAS_ZONEOUT:
                m_zc = zoneout_rows(p_zo + P * s_zu, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
                dc_zoned = zoneout_to_prev(m_zc, dc)
                dc = zoneout_to_candidate(m_zc, dc)
        if HAS_PROJ:
            d = tl.where(act, d, 0.0)
            tl.store(p_dh_tot_all + row * P + o_p[None, :], d.to(p_dh_tot_all.dtype.element_ty),
                     mask=m_bp)
            d = tl.dot(d.to(DOT), b_wr, tl.zeros([BLOCK_B, BLOCK_H], ACC),
                       input_precision="ieee", out_dtype=ACC)

        if CELL == LSTM:
            i = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            f = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            g = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
            if HAS_ZONEOUT:  # the workspace holds the blended state: recompute c~
                c = lstm_candidate(i, f, g, c_prev)
            else:
                c = tl.load(p_w + 4 * H, mask=m_act, other=0.0).to(ACC)
            di, df, dg, do, dc_prev = lstm_backward(d, dc, i, f, g, o, c, c_prev)
            di = tl.where(act, di, 0.0)
            df = tl.where(act, df, 0.0)
            dg = tl.where(act, dg, 0.0)
            do = tl.where(act, do, 0.0)
            tl.store(p_d, di.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, df.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, dg.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 3 * H, do.to(DX_DTYPE), mask=m_bh)
            if HAS_PROJ:
                tl.store(p_a, tl.where(act, lstm_hidden(o, c), 0.0).to(AUX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(di.to(DOT), b_w0, zero_p, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(df.to(DOT), b_w1, dh_prev, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(dg.to(DOT), b_w2, dh_prev, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(do.to(DOT), b_w3, dh_prev, input_precision="ieee", out_dtype=ACC)
        elif CELL == LSTM_LN:
            i = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            f = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            g = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
            ch = tl.load(p_w + 13 * H, mask=m_act, other=0.0).to(ACC)
            p_r = p_ws + row * WS + 14 * H
            rstd_x = tl.load(p_r, mask=act, other=0.0).to(ACC)
            rstd_h = tl.load(p_r + 1, mask=act, other=0.0).to(ACC)
            rstd_c = tl.load(p_r + 2, mask=act, other=0.0).to(ACC)
            do, dch, dy = lstm_ln_backward_output(d, o, ch, g_c, beta_c)
            # The cell layer norm's backward (its gain is 0 beyond H: dch too).
            mean_d = tl.sum(dch, axis=1)[:, None] / H
            mean_dv = tl.sum(dch * ch, axis=1)[:, None] / H
            dc = dc + ln_backward(dch, ch, rstd_c, mean_d, mean_dv)
            di, df, dg, dc_prev = lstm_ln_backward_gates(dc, i, f, g, c_prev)
            di = tl.where(act, di, 0.0)
            df = tl.where(act, df, 0.0)
            dg = tl.where(act, dg, 0.0)
            do = tl.where(act, do, 0.0)
            p_da = p_da_all + row * GH + o_h[None, :]
            tl.store(p_da, di.to(DX_DTYPE), mask=m_bh)
            tl.store(p_da + H, df.to(DX_DTYPE), mask=m_bh)
            tl.store(p_da + 2 * H, dg.to(DX_DTYPE), mask=m_bh)
            tl.store(p_da + 3 * H, do.to(DX_DTYPE), mask=m_bh)
            tl.store(p_a, tl.where(act, dy, 0.0).to(AUX_DTYPE), mask=m_bh)
            # The input side's layer norm: dx = LN'(da g_ih) ...
            xh0 = tl.load(p_w + 5 * H, mask=m_act, other=0.0).to(ACC)
            xh1 = tl.load(p_w + 6 * H, mask=m_act, other=0.0).to(ACC)
            xh2 = tl.load(p_w + 7 * H, mask=m_act, other=0.0).to(ACC)
            xh3 = tl.load(p_w + 8 * H, mask=m_act, other=0.0).to(ACC)
            v0, v1, v2, v3 = di * gx0, df * gx1, dg * gx2, do * gx3
            mean_d = tl.sum(v0 + v1 + v2 + v3, axis=1)[:, None] / (4 * H)
            mean_dv = tl.sum(v0 * xh0 + v1 * xh1 + v2 * xh2 + v3 * xh3, axis=1)[:, None] / (4 * H)
            tl.store(p_d, ln_backward(v0, xh0, rstd_x, mean_d, mean_dv).to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, ln_backward(v1, xh1, rstd_x, mean_d, mean_dv).to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, ln_backward(v2, xh2, rstd_x, mean_d, mean_dv).to(DX_DTYPE),
                     mask=m_bh)
            tl.store(p_d + 3 * H, ln_backward(v3, xh3, rstd_x, mean_d, mean_dv).to(DX_DTYPE),
                     mask=m_bh)
            # ... and the recurrent side's: dhr = LN'(da g_hh), which multiplies W_hh.
            xh0 = tl.load(p_w + 9 * H, mask=m_act, other=0.0).to(ACC)
            xh1 = tl.load(p_w + 10 * H, mask=m_act, other=0.0).to(ACC)
            xh2 = tl.load(p_w + 11 * H, mask=m_act, other=0.0).to(ACC)
            xh3 = tl.load(p_w + 12 * H, mask=m_act, other=0.0).to(ACC)
            v0, v1, v2, v3 = di * gh0, df * gh1, dg * gh2, do * gh3
            mean_d = tl.sum(v0 + v1 + v2 + v3, axis=1)[:, None] / (4 * H)
            mean_dv = tl.sum(v0 * xh0 + v1 * xh1 + v2 * xh2 + v3 * xh3, axis=1)[:, None] / (4 * H)
            v0 = ln_backward(v0, xh0, rstd_h, mean_d, mean_dv)
            v1 = ln_backward(v1, xh1, rstd_h, mean_d, mean_dv)
            v2 = ln_backward(v2, xh2, rstd_h, mean_d, mean_dv)
            v3 = ln_backward(v3, xh3, rstd_h, mean_d, mean_dv)
            p_r = p_dhr_all + row * GH + o_h[None, :]
            tl.store(p_r, v0.to(DX_DTYPE), mask=m_bh)
            tl.store(p_r + H, v1.to(DX_DTYPE), mask=m_bh)
            tl.store(p_r + 2 * H, v2.to(DX_DTYPE), mask=m_bh)
            tl.store(p_r + 3 * H, v3.to(DX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(v0.to(DOT), b_w0, zero_p, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(v1.to(DOT), b_w1, dh_prev, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(v2.to(DOT), b_w2, dh_prev, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(v3.to(DOT), b_w3, dh_prev, input_precision="ieee", out_dtype=ACC)
        elif CELL == GRU:
            r = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            hn = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
            h_prev = tl.load(p_out + row_q * P + o_p[None, :], mask=m_actp & has_prev,
                             other=0.0).to(ACC)
            h_prev = tl.where(has_prev, h_prev, b_hs)
            dr, dz, dxn, dhn, dh_direct = gru_backward(d, r, z, n, hn, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            dxn = tl.where(act, dxn, 0.0)
            dhn = tl.where(act, dhn, 0.0)
            tl.store(p_d, dr.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, dz.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, dxn.to(DX_DTYPE), mask=m_bh)
            tl.store(p_a, dhn.to(AUX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(dr.to(DOT), b_w0, dh_direct, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(dz.to(DOT), b_w1, dh_prev, input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(dhn.to(DOT), b_w2, dh_prev, input_precision="ieee", out_dtype=ACC)
        elif CELL == GRU_RESET_BEFORE:
            r = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            h_prev = tl.load(p_out + row_q * P + o_p[None, :], mask=m_actp & has_prev,
                             other=0.0).to(ACC)
            h_prev = tl.where(has_prev, h_prev, b_hs)
            dz, dn, dh_direct = gru_rb_backward_candidate(d, z, n, h_prev)
            dn = tl.where(act, dn, 0.0)
            drh = tl.dot(dn.to(DOT), b_w2, zero_p, input_precision="ieee", out_dtype=ACC)
            dr, dh_reset = gru_rb_backward_reset(drh, r, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            tl.store(p_d, dr.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, dz.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, dn.to(DX_DTYPE), mask=m_bh)
            tl.store(p_a, tl.where(act, r * h_prev, 0.0).to(AUX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(dr.to(DOT), b_w0, dh_direct + dh_reset,
                             input_precision="ieee", out_dtype=ACC)
            dh_prev = tl.dot(dz.to(DOT), b_w1, dh_prev, input_precision="ieee", out_dtype=ACC)
        else:
            if HAS_ZONEOUT:  # the candidate h~_t, saved by the forward
                h = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            else:
                h = tl.load(p_out + row * P + o_p[None, :], mask=m_actp, other=0.0).to(ACC)
            da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
            tl.store(p_d, da.to(DX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(da.to(DOT), b_w0, zero_p, input_precision="ieee", out_dtype=ACC)
        if HAS_ZONEOUT:
            dh_prev += dh_zoned
            if CELL == LSTM or CELL == LSTM_LN:
                dc_prev += dc_zoned
        if HAS_RESETS:  # a reset step started from the reset state, not from the step before
            b_dh0 += tl.where(rs, dh_prev, 0.0)
            dh_prev = tl.where(rs, 0.0, dh_prev)
            if CELL == LSTM or CELL == LSTM_LN:
                b_dc0 += tl.where(rs, dc_prev, 0.0)
                dc_prev = tl.where(rs, 0.0, dc_prev)
        b_dh = tl.where(act, dh_prev, b_dh)
        if CELL == LSTM or CELL == LSTM_LN:
            b_dc = tl.where(act, dc_prev, b_dc)

    if HAS_RESET_STATE:
        store_rows(p_drh, row_b, P, o_p, m_bp, b_dh0)
        if CELL == LSTM or CELL == LSTM_LN:
            store_rows(p_drc, row_b, H, o_h, m_bh, b_dc0)
    elif HAS_RESETS:
        b_dh += b_dh0
        if CELL == LSTM or CELL == LSTM_LN:
            b_dc += b_dc0
    store_rows(p_dh0, row_b, P, o_p, m_bp, b_dh)
    if CELL == LSTM or CELL == LSTM_LN:
        store_rows(p_dc0, row_b, H, o_h, m_bh, b_dc)
