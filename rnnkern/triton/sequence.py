"""Sequence kernels: the whole time loop inside one launch.

One program owns BLOCK_B batch rows and every hidden unit.  It loads W_hh (and
W_hr) once, keeps h (and c) on chip in the accumulate dtype for all T steps,
and per step runs the recurrent product ``h W_hh^T`` as one tl.dot per gate,
fused with the gates; only xproj is read and the outputs and the workspace
written.  The backward runs BPTT the same way, carrying dh and dc on chip.

That needs the weights to fit on chip: :func:`fits_on_chip` states the limit
and the host wrapper (:mod:`.ops`) takes the per-step kernels of :mod:`.step`
for larger sizes.  The gate formulas come from :mod:`.cells`.
"""
import torch
import triton
import triton.language as tl

from ..reference import gate_count
from .cells import (GRU, GRU_RESET_BEFORE, LSTM, RNN_RELU, gru_backward, gru_forward,
                    gru_rb_backward_candidate, gru_rb_backward_reset, gru_rb_candidate,
                    gru_rb_gates, lstm_backward, lstm_forward, lstm_hidden, rnn_backward,
                    rnn_forward)
from .tiles import dot, load_rows, load_vector, load_weight, positions, previous_position, store_rows
from .tuning import MIN_DOT, loop_configs

#: Bytes of weights (W_hh, plus W_hr with a projection, in their storage dtype,
#: padded to powers of two) a loop kernel keeps on chip for a whole sequence.
#: 128 KiB fits in the shared memory of an A100 / H100 SM (164 / 227 KiB) with
#: room for the dot operands; beyond it the per-step kernels run.
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


def fits_on_chip(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool = False) -> bool:
    """Whether the in-kernel time loop serves these sizes: the padded weights
    take at most ON_CHIP_BYTES.  With 128 KiB, for float16 / bfloat16:
    LSTM and GRU up to H = 128, RNN up to H = 256; for float32 half of that
    (LSTM, GRU H <= 64, RNN H <= 128); for float64 a quarter."""
    return on_chip_bytes(cell, H, P, dtype, proj) <= ON_CHIP_BYTES


@triton.autotune(configs=loop_configs(), key=["CELL", "H", "P"])
@triton.jit(do_not_specialize=["T"])
def forward_loop_kernel(
        p_xproj, p_h0, p_c0, p_w_hh, p_b_ih, p_b_hh, p_w_hr, p_len,
        p_out, p_h_n, p_c_n, p_ws,
        T, B, H, P,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr,
        HAS_B_IH: tl.constexpr, HAS_B_HH: tl.constexpr, HAS_PROJ: tl.constexpr,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, TRAIN: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """The forward of a whole sequence for BLOCK_B rows (ops.cpp conventions).

    xproj [T, B, G*H], h0 [B, P], c0 [B, H], w_hh [G*H, P], w_hr [P, H] ->
    out [T, B, P], h_n [B, P], c_n [B, H], workspace [T, B, WS] when TRAIN.
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

    # The state, on chip for the whole sequence.
    b_h = load_rows(p_h0, row_b, P, o_p, m_bp, ACC)
    if CELL == LSTM:
        b_c = load_rows(p_c0, row_b, H, o_h, m_bh, ACC)

    for s in range(0, T):
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        row = t.to(tl.int64) * B + o_b
        zero = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        x0 = load_rows(p_xproj, row, GH, o_h, m_act, ACC)
        hp0 = dot(b_h, b_w0, zero, DOT)
        if CELL == LSTM:
            x1 = load_rows(p_xproj + H, row, GH, o_h, m_act, ACC)
            x2 = load_rows(p_xproj + 2 * H, row, GH, o_h, m_act, ACC)
            x3 = load_rows(p_xproj + 3 * H, row, GH, o_h, m_act, ACC)
            hp1 = dot(b_h, b_w1, zero, DOT)
            hp2 = dot(b_h, b_w2, zero, DOT)
            hp3 = dot(b_h, b_w3, zero, DOT)
            i, f, g, o, c, h = lstm_forward(x0 + hp0 + bi0 + bh0, x1 + hp1 + bi1 + bh1,
                                            x2 + hp2 + bi2 + bh2, x3 + hp3 + bi3 + bh3, b_c)
            b_c = tl.where(act, c, b_c)
            if TRAIN:
                store_rows(p_ws, row, WS, o_h, m_bh, tl.where(act, i, 0.0))
                store_rows(p_ws + H, row, WS, o_h, m_bh, tl.where(act, f, 0.0))
                store_rows(p_ws + 2 * H, row, WS, o_h, m_bh, tl.where(act, g, 0.0))
                store_rows(p_ws + 3 * H, row, WS, o_h, m_bh, tl.where(act, o, 0.0))
                store_rows(p_ws + 4 * H, row, WS, o_h, m_bh, tl.where(act, c, 0.0))
            if HAS_PROJ:
                h = dot(h, b_wr, tl.zeros([BLOCK_B, BLOCK_P], ACC), DOT)
        elif CELL == GRU:
            x1 = load_rows(p_xproj + H, row, GH, o_h, m_act, ACC)
            x2 = load_rows(p_xproj + 2 * H, row, GH, o_h, m_act, ACC)
            hp1 = dot(b_h, b_w1, zero, DOT)
            hn = dot(b_h, b_w2, zero, DOT) + bh2
            r, z, n, h = gru_forward(x0 + bi0, x1 + bi1, x2 + bi2, hp0 + bh0, hp1 + bh1, hn, b_h)
            if TRAIN:
                store_rows(p_ws, row, WS, o_h, m_bh, tl.where(act, r, 0.0))
                store_rows(p_ws + H, row, WS, o_h, m_bh, tl.where(act, z, 0.0))
                store_rows(p_ws + 2 * H, row, WS, o_h, m_bh, tl.where(act, n, 0.0))
                store_rows(p_ws + 3 * H, row, WS, o_h, m_bh, tl.where(act, hn, 0.0))
        elif CELL == GRU_RESET_BEFORE:
            x1 = load_rows(p_xproj + H, row, GH, o_h, m_act, ACC)
            x2 = load_rows(p_xproj + 2 * H, row, GH, o_h, m_act, ACC)
            hp1 = dot(b_h, b_w1, zero, DOT)
            r, z, rh = gru_rb_gates(x0 + bi0, x1 + bi1, hp0 + bh0, hp1 + bh1, b_h)
            hn = dot(rh, b_w2, zero, DOT) + bh2
            n, h = gru_rb_candidate(x2 + bi2, hn, z, b_h)
            if TRAIN:
                store_rows(p_ws, row, WS, o_h, m_bh, tl.where(act, r, 0.0))
                store_rows(p_ws + H, row, WS, o_h, m_bh, tl.where(act, z, 0.0))
                store_rows(p_ws + 2 * H, row, WS, o_h, m_bh, tl.where(act, n, 0.0))
        else:
            h = rnn_forward(x0 + hp0 + bi0 + bh0, CELL == RNN_RELU)
        b_h = tl.where(act, h, b_h)
        store_rows(p_out, row, P, o_p, m_bp, tl.where(act, h, 0.0))

    store_rows(p_h_n, row_b, P, o_p, m_bp, b_h)
    if CELL == LSTM:
        store_rows(p_c_n, row_b, H, o_h, m_bh, b_c)


@triton.autotune(configs=loop_configs(), key=["CELL", "H", "P"])
@triton.jit(do_not_specialize=["T"])
def backward_loop_kernel(
        p_gout, p_dh_n, p_dc_n, p_h0, p_c0, p_w_hh, p_w_hr, p_out, p_ws, p_len,
        p_dx, p_dh0, p_dc0, p_aux_all, p_dh_tot_all,
        T, B, H, P,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_PROJ: tl.constexpr,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """BPTT of a whole sequence for BLOCK_B rows, dh [B, P] and dc [B, H] carried
    on chip from grad_h_n, grad_c_n down to grad_h0, grad_c0.

    Writes dx [T, B, G*H] (the gradient of xproj, zeros at padding positions)
    and the time-ordered extras of the weight gradients: aux_all [T, B, H]
    (GRU: dhn; reset-before GRU: r*h_{t-1}; LSTM with projection: o*tanh c)
    and, with a projection, dh_tot_all [T, B, P] (the gradient of each h_t)."""
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

    b_dh = load_rows(p_dh_n, row_b, P, o_p, m_bp, ACC)
    b_h0 = load_rows(p_h0, row_b, P, o_p, m_bp, ACC)
    if CELL == LSTM:
        b_dc = load_rows(p_dc_n, row_b, H, o_h, m_bh, ACC)
        b_c0 = load_rows(p_c0, row_b, H, o_h, m_bh, ACC)

    for i_s in range(0, T):
        s = T - 1 - i_s
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        m_actp = act & m_p[None, :]
        row = t.to(tl.int64) * B + o_b
        # h_{t-1} of an active row: the output one step earlier, or h0 at its first step.
        row_q = previous_position(t, s, REVERSE).to(tl.int64) * B + o_b
        zero_p = tl.zeros([BLOCK_B, BLOCK_P], ACC)

        d = b_dh + load_rows(p_gout, row, P, o_p, m_actp, ACC)
        if HAS_PROJ:
            d = tl.where(act, d, 0.0)
            store_rows(p_dh_tot_all, row, P, o_p, m_bp, d)
            d = dot(d, b_wr, tl.zeros([BLOCK_B, BLOCK_H], ACC), DOT)

        if CELL == LSTM:
            i = load_rows(p_ws, row, WS, o_h, m_act, ACC)
            f = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
            g = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
            o = load_rows(p_ws + 3 * H, row, WS, o_h, m_act, ACC)
            c = load_rows(p_ws + 4 * H, row, WS, o_h, m_act, ACC)
            c_prev = tl.where(s > 0, load_rows(p_ws + 4 * H, row_q, WS, o_h, m_act & (s > 0), ACC),
                              b_c0)
            di, df, dg, do, dc_prev = lstm_backward(d, b_dc, i, f, g, o, c, c_prev)
            di = tl.where(act, di, 0.0)
            df = tl.where(act, df, 0.0)
            dg = tl.where(act, dg, 0.0)
            do = tl.where(act, do, 0.0)
            store_rows(p_dx, row, GH, o_h, m_bh, di)
            store_rows(p_dx + H, row, GH, o_h, m_bh, df)
            store_rows(p_dx + 2 * H, row, GH, o_h, m_bh, dg)
            store_rows(p_dx + 3 * H, row, GH, o_h, m_bh, do)
            if HAS_PROJ:
                store_rows(p_aux_all, row, H, o_h, m_bh, tl.where(act, lstm_hidden(o, c), 0.0))
            b_dc = tl.where(act, dc_prev, b_dc)
            dh_prev = dot(di, b_w0, zero_p, DOT)
            dh_prev = dot(df, b_w1, dh_prev, DOT)
            dh_prev = dot(dg, b_w2, dh_prev, DOT)
            dh_prev = dot(do, b_w3, dh_prev, DOT)
        elif CELL == GRU:
            r = load_rows(p_ws, row, WS, o_h, m_act, ACC)
            z = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
            n = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
            hn = load_rows(p_ws + 3 * H, row, WS, o_h, m_act, ACC)
            h_prev = tl.where(s > 0, load_rows(p_out, row_q, P, o_p, m_actp & (s > 0), ACC), b_h0)
            dr, dz, dxn, dhn, dh_direct = gru_backward(d, r, z, n, hn, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            dxn = tl.where(act, dxn, 0.0)
            dhn = tl.where(act, dhn, 0.0)
            store_rows(p_dx, row, GH, o_h, m_bh, dr)
            store_rows(p_dx + H, row, GH, o_h, m_bh, dz)
            store_rows(p_dx + 2 * H, row, GH, o_h, m_bh, dxn)
            store_rows(p_aux_all, row, H, o_h, m_bh, dhn)
            dh_prev = dot(dr, b_w0, dh_direct, DOT)
            dh_prev = dot(dz, b_w1, dh_prev, DOT)
            dh_prev = dot(dhn, b_w2, dh_prev, DOT)
        elif CELL == GRU_RESET_BEFORE:
            r = load_rows(p_ws, row, WS, o_h, m_act, ACC)
            z = load_rows(p_ws + H, row, WS, o_h, m_act, ACC)
            n = load_rows(p_ws + 2 * H, row, WS, o_h, m_act, ACC)
            h_prev = tl.where(s > 0, load_rows(p_out, row_q, P, o_p, m_actp & (s > 0), ACC), b_h0)
            dz, dn, dh_direct = gru_rb_backward_candidate(d, z, n, h_prev)
            dn = tl.where(act, dn, 0.0)
            drh = dot(dn, b_w2, zero_p, DOT)
            dr, dh_reset = gru_rb_backward_reset(drh, r, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            store_rows(p_dx, row, GH, o_h, m_bh, dr)
            store_rows(p_dx + H, row, GH, o_h, m_bh, dz)
            store_rows(p_dx + 2 * H, row, GH, o_h, m_bh, dn)
            store_rows(p_aux_all, row, H, o_h, m_bh, tl.where(act, r * h_prev, 0.0))
            dh_prev = dot(dr, b_w0, dh_direct + dh_reset, DOT)
            dh_prev = dot(dz, b_w1, dh_prev, DOT)
        else:
            h = load_rows(p_out, row, P, o_p, m_actp, ACC)
            da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
            store_rows(p_dx, row, GH, o_h, m_bh, da)
            dh_prev = dot(da, b_w0, zero_p, DOT)
        b_dh = tl.where(act, dh_prev, b_dh)

    store_rows(p_dh0, row_b, P, o_p, m_bp, b_dh)
    if CELL == LSTM:
        store_rows(p_dc0, row_b, H, o_h, m_bh, b_dc)
