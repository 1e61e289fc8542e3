"""Sequence kernels: the whole time loop inside one launch.

One program owns BLOCK_B batch rows and every hidden unit.  It loads W_hh (and
W_hr) once into shared memory, keeps h (and c) in registers in the accumulate
dtype for all T steps, and per step runs the recurrent product ``h W_hh^T`` as
one tl.dot per gate, fused with the gates; only xproj is read and the outputs
and the workspace written.  The backward runs BPTT the same way, carrying dh
and dc on chip.  The programs are independent (no grid-wide barrier), so the
interpreter, which runs them one after another, computes the same thing.

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
from .tiles import load_gate_vectors, load_rows, load_weight, positions, previous_position, store_rows
from .tuning import MIN_DOT, loop_configs

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


def fits_on_chip(cell: str, H: int, P: int, dtype: torch.dtype, proj: bool = False) -> bool:
    """Whether the in-kernel time loop serves these sizes: the padded weights
    take at most ON_CHIP_BYTES.  With 128 KiB (blocks are powers of two): for
    float16 / bfloat16 LSTM and GRU up to H = 128, RNN up to H = 256; for
    float32 and float64 LSTM and GRU up to H = 64, RNN up to H = 128.  An LSTM
    projection adds one more [H, P] block."""
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
    bi0, bi1, bi2, bi3 = load_gate_vectors(p_b_ih, o_h, m_h, H, G, HAS_B_IH, ACC)
    bh0, bh1, bh2, bh3 = load_gate_vectors(p_b_hh, o_h, m_h, H, G, HAS_B_HH, ACC)
    # Every gate but the GRU candidate takes the sum of the two biases.
    b0, b1, b2, b3 = bi0 + bh0, bi1 + bh1, bi2 + bh2, bi3 + bh3
    WS_DTYPE = p_ws.dtype.element_ty
    OUT_DTYPE = p_out.dtype.element_ty

    # The state, on chip for the whole sequence.
    b_h = load_rows(p_h0, row_b, P, o_p, m_bp, ACC)
    if CELL == LSTM:
        b_c = load_rows(p_c0, row_b, H, o_h, m_bh, ACC)

    for s in range(0, T):
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        row = t.to(tl.int64)[:, None] * B + o_b[:, None]
        # Pointers of this step's rows: xproj and the workspace (gate k at + k*H), the output.
        p_x = p_xproj + row * GH + o_h[None, :]
        p_w = p_ws + row * WS + o_h[None, :]
        zero = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        b_hd = b_h.to(DOT)
        x0 = tl.load(p_x, mask=m_act, other=0.0).to(ACC)
        hp0 = tl.dot(b_hd, b_w0, zero, input_precision="ieee")
        if CELL == LSTM:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            x3 = tl.load(p_x + 3 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee")
            hp2 = tl.dot(b_hd, b_w2, zero, input_precision="ieee")
            hp3 = tl.dot(b_hd, b_w3, zero, input_precision="ieee")
            i, f, g, o, c, h = lstm_forward(x0 + hp0 + b0, x1 + hp1 + b1, x2 + hp2 + b2,
                                            x3 + hp3 + b3, b_c)
            b_c = tl.where(act, c, b_c)
            if TRAIN:
                tl.store(p_w, tl.where(act, i, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, f, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, g, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 3 * H, tl.where(act, o, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 4 * H, tl.where(act, c, 0.0).to(WS_DTYPE), mask=m_bh)
            if HAS_PROJ:
                h = tl.dot(h.to(DOT), b_wr, tl.zeros([BLOCK_B, BLOCK_P], ACC), input_precision="ieee")
        elif CELL == GRU:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee")
            hn = tl.dot(b_hd, b_w2, zero, input_precision="ieee") + bh2
            r, z, n, h = gru_forward(x0 + bi0, x1 + bi1, x2 + bi2, hp0 + bh0, hp1 + bh1, hn, b_h)
            if TRAIN:
                tl.store(p_w, tl.where(act, r, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, z, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 3 * H, tl.where(act, hn, 0.0).to(WS_DTYPE), mask=m_bh)
        elif CELL == GRU_RESET_BEFORE:
            x1 = tl.load(p_x + H, mask=m_act, other=0.0).to(ACC)
            x2 = tl.load(p_x + 2 * H, mask=m_act, other=0.0).to(ACC)
            hp1 = tl.dot(b_hd, b_w1, zero, input_precision="ieee")
            r, z, rh = gru_rb_gates(x0 + bi0, x1 + bi1, hp0 + bh0, hp1 + bh1, b_h)
            hn = tl.dot(rh.to(DOT), b_w2, zero, input_precision="ieee") + bh2
            n, h = gru_rb_candidate(x2 + bi2, hn, z, b_h)
            if TRAIN:
                tl.store(p_w, tl.where(act, r, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + H, tl.where(act, z, 0.0).to(WS_DTYPE), mask=m_bh)
                tl.store(p_w + 2 * H, tl.where(act, n, 0.0).to(WS_DTYPE), mask=m_bh)
        else:
            h = rnn_forward(x0 + hp0 + b0, CELL == RNN_RELU)
        b_h = tl.where(act, h, b_h)
        tl.store(p_out + row * P + o_p[None, :], tl.where(act, h, 0.0).to(OUT_DTYPE), mask=m_bp)

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

    DX_DTYPE = p_dx.dtype.element_ty
    AUX_DTYPE = p_aux_all.dtype.element_ty
    for i_s in range(0, T):
        s = T - 1 - i_s
        active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
        act = active[:, None]
        m_act = act & m_h[None, :]
        m_actp = act & m_p[None, :]
        row = t.to(tl.int64)[:, None] * B + o_b[:, None]
        # h_{t-1} of an active row: the output one step earlier, or h0 at its first step.
        row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b[:, None]
        has_prev = s > 0
        p_w = p_ws + row * WS + o_h[None, :]
        p_d = p_dx + row * GH + o_h[None, :]
        p_a = p_aux_all + row * H + o_h[None, :]
        zero_p = tl.zeros([BLOCK_B, BLOCK_P], ACC)

        d = b_dh + tl.load(p_gout + row * P + o_p[None, :], mask=m_actp, other=0.0).to(ACC)
        if HAS_PROJ:
            d = tl.where(act, d, 0.0)
            tl.store(p_dh_tot_all + row * P + o_p[None, :], d.to(p_dh_tot_all.dtype.element_ty),
                     mask=m_bp)
            d = tl.dot(d.to(DOT), b_wr, tl.zeros([BLOCK_B, BLOCK_H], ACC), input_precision="ieee")

        if CELL == LSTM:
            i = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            f = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            g = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
            c = tl.load(p_w + 4 * H, mask=m_act, other=0.0).to(ACC)
            c_prev = tl.load(p_ws + row_q * WS + 4 * H + o_h[None, :], mask=m_act & has_prev,
                             other=0.0).to(ACC)
            c_prev = tl.where(has_prev, c_prev, b_c0)
            di, df, dg, do, dc_prev = lstm_backward(d, b_dc, i, f, g, o, c, c_prev)
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
            b_dc = tl.where(act, dc_prev, b_dc)
            dh_prev = tl.dot(di.to(DOT), b_w0, zero_p, input_precision="ieee")
            dh_prev = tl.dot(df.to(DOT), b_w1, dh_prev, input_precision="ieee")
            dh_prev = tl.dot(dg.to(DOT), b_w2, dh_prev, input_precision="ieee")
            dh_prev = tl.dot(do.to(DOT), b_w3, dh_prev, input_precision="ieee")
        elif CELL == GRU:
            r = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            hn = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
            h_prev = tl.load(p_out + row_q * P + o_p[None, :], mask=m_actp & has_prev,
                             other=0.0).to(ACC)
            h_prev = tl.where(has_prev, h_prev, b_h0)
            dr, dz, dxn, dhn, dh_direct = gru_backward(d, r, z, n, hn, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            dxn = tl.where(act, dxn, 0.0)
            dhn = tl.where(act, dhn, 0.0)
            tl.store(p_d, dr.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, dz.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, dxn.to(DX_DTYPE), mask=m_bh)
            tl.store(p_a, dhn.to(AUX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(dr.to(DOT), b_w0, dh_direct, input_precision="ieee")
            dh_prev = tl.dot(dz.to(DOT), b_w1, dh_prev, input_precision="ieee")
            dh_prev = tl.dot(dhn.to(DOT), b_w2, dh_prev, input_precision="ieee")
        elif CELL == GRU_RESET_BEFORE:
            r = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
            z = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
            n = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
            h_prev = tl.load(p_out + row_q * P + o_p[None, :], mask=m_actp & has_prev,
                             other=0.0).to(ACC)
            h_prev = tl.where(has_prev, h_prev, b_h0)
            dz, dn, dh_direct = gru_rb_backward_candidate(d, z, n, h_prev)
            dn = tl.where(act, dn, 0.0)
            drh = tl.dot(dn.to(DOT), b_w2, zero_p, input_precision="ieee")
            dr, dh_reset = gru_rb_backward_reset(drh, r, h_prev)
            dr = tl.where(act, dr, 0.0)
            dz = tl.where(act, dz, 0.0)
            tl.store(p_d, dr.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + H, dz.to(DX_DTYPE), mask=m_bh)
            tl.store(p_d + 2 * H, dn.to(DX_DTYPE), mask=m_bh)
            tl.store(p_a, tl.where(act, r * h_prev, 0.0).to(AUX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(dr.to(DOT), b_w0, dh_direct + dh_reset, input_precision="ieee")
            dh_prev = tl.dot(dz.to(DOT), b_w1, dh_prev, input_precision="ieee")
        else:
            h = tl.load(p_out + row * P + o_p[None, :], mask=m_actp, other=0.0).to(ACC)
            da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
            tl.store(p_d, da.to(DX_DTYPE), mask=m_bh)
            dh_prev = tl.dot(da.to(DOT), b_w0, zero_p, input_precision="ieee")
        b_dh = tl.where(act, dh_prev, b_dh)

    store_rows(p_dh0, row_b, P, o_p, m_bp, b_dh)
    if CELL == LSTM:
        store_rows(p_dc0, row_b, H, o_h, m_bh, b_dc)
