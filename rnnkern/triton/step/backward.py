"""The per-step backward kernels (see :mod:`rnnkern.triton.step`).

Per step s (from T-1 down to 0) the carried gradient of h_{t} is split in a
direct part dh [B, P] (what the pointwise backward passed on) and the GEMM
part dA_{s+1} W_hh, which the next kernel adds on the fly for its own
columns: one launch per step computes the carried gradient and the step.
With resets, the carry of a row whose step s+1 was a reset is the gradient
of h0 (c0): it is added to the sums dh0_in [B, P] (dc0_in [B, H]) of the
steps after, written to dh0_out (dc0_out): every element, every step.
"""
import triton
import triton.language as tl

from ..cells import (GRU, GRU_RESET_BEFORE, LSTM, LSTM_LN, RNN_RELU, gru_backward,
                     gru_rb_backward_candidate, gru_rb_backward_reset, ln_backward, lstm_backward,
                     lstm_candidate, lstm_hidden, lstm_ln_backward_gates, lstm_ln_backward_output,
                     rnn_backward, zoneout_to_candidate, zoneout_to_prev)
from ..tiles import (load_gate_vectors, load_vector, matmul, previous_position, reset_rows,
                     zoneout_rows)
from ..tuning import row_configs, step_configs
from .tile import carry_past_reset, next_resets, start_state_rows, step_rows, step_tile


@triton.autotune(configs=step_configs(), key=["CELL", "H", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def gates_backward_kernel(
        p_gout, p_dh, p_da_next, p_w_hh, p_dc, p_ws, p_out, p_h0, p_c0, p_len, p_dh_tot, p_w_hr,
        p_dx, p_da, p_dh_out, p_dc_out, p_aux, p_aux_all, p_resets, p_zo, p_ln, p_da_all,
        p_dh0_in, p_dh0_out, p_dc0_in, p_dc0_out, p_gc_steps,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        B_CLASS, CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_GOUT: tl.constexpr,
        HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_PROJ: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr,
        CELL_STEPS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
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
    gradients go to aux_all [T, B, H]: GRU dhn; LSTM with projection o*tanh c~.
    The reset-before GRU leaves dn in aux [B, H] for its stage 2.  LSTM-LN
    stops at the output: do into da_all [T, B, 4H] (gate o), dy (the gradient
    of c^ g_c + beta_c) into aux_all, for lstm_ln_backward_kernel.
    """
    gates_backward_tile(p_gout, p_dh, p_da_next, p_w_hh, p_dc, p_ws, p_out, p_h0, p_c0, p_len,
                        p_dh_tot, p_w_hr, p_dx, p_da, p_dh_out, p_dc_out, p_aux, p_aux_all,
                        p_resets, p_zo, p_ln, p_da_all, p_dh0_in, p_dh0_out, p_dc0_in, p_dc0_out,
                        p_gc_steps, s, T, B, H, P, s_zt, s_zb, s_zu, CELL, G, WS,
                        HAS_GOUT, HAS_NEXT, HAS_LENGTHS, REVERSE, HAS_PROJ, HAS_RESETS,
                        HAS_ZONEOUT, CELL_STEPS, ACC, DOT, BLOCK_B, BLOCK_H, BLOCK_K)


@triton.jit
def gates_backward_tile(
        p_gout, p_dh, p_da_next, p_w_hh, p_dc, p_ws, p_out, p_h0, p_c0, p_len, p_dh_tot, p_w_hr,
        p_dx, p_da, p_dh_out, p_dc_out, p_aux, p_aux_all, p_resets, p_zo, p_ln, p_da_all,
        p_dh0_in, p_dh0_out, p_dc0_in, p_dc0_out, p_gc_steps,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_GOUT: tl.constexpr,
        HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_PROJ: tl.constexpr, HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr,
        CELL_STEPS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of gates_backward_kernel: the backward of step s for the tile
    of program (i_b, i_h), also called once per step by the spread kernel
    (:mod:`..spread`)."""
    o_b, o_h, m_b, m_h, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, H, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
    m_act = act & m_h[None, :]
    o_bh = o_b64[:, None] * H + o_h[None, :]
    o_bp = o_b64[:, None] * P + o_h[None, :]  # P = H, except with a projection
    GH = G * H
    # h_{t-1} (and c_{t-1}) of an active row: the output one step earlier, or
    # h0 at the first step and at a reset.
    row_q, m_q, m_0 = start_state_rows(p_resets, t, o_b, o_b64, active, m_act, s, B, REVERSE,
                                       HAS_RESETS)
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)
    p_w = p_ws + row * WS + o_h[None, :]
    p_d = p_dx + row * GH + o_h[None, :]
    DX_DTYPE = p_dx.dtype.element_ty
    DA_DTYPE = p_da.dtype.element_ty

    # The carried gradient of this step's (unprojected) h.
    d = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_PROJ:  # (its carry, grad_output and zoneout: projection_backward_kernel)
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
        # the gradient of h0 where the next step was a reset
        d = carry_past_reset(d, p_dh0_in, p_dh0_out, o_bp, m, nr, HAS_RESETS, ACC)
        carry = d
        if HAS_GOUT:
            d += tl.load(p_gout + row * P + o_h[None, :], mask=m_act, other=0.0).to(ACC)
        if HAS_ZONEOUT:  # the state's gradient: to the start state and to the candidate
            m_zh = zoneout_rows(p_zo, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
            dh_zoned = zoneout_to_prev(m_zh, d)
            d = zoneout_to_candidate(m_zh, d)
        else:  # (what the start state gets directly: nothing, for the LSTMs and the RNN)
            dh_zoned = tl.zeros([BLOCK_B, BLOCK_H], ACC)

    if CELL == LSTM:
        i = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
        f = tl.load(p_w + H, mask=m_act, other=0.0).to(ACC)
        g = tl.load(p_w + 2 * H, mask=m_act, other=0.0).to(ACC)
        o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
        c_prev = (tl.load(p_ws + row_q * WS + 4 * H + o_h[None, :], mask=m_q, other=0.0).to(ACC)
                  + tl.load(p_c0 + o_bh, mask=m_0, other=0.0).to(ACC))
        dc = tl.load(p_dc + o_bh, mask=m, other=0.0).to(ACC)
        dc = carry_past_reset(dc, p_dc0_in, p_dc0_out, o_bh, m, nr, HAS_RESETS, ACC)
        if CELL_STEPS:  # dL/dc_t of the step's own c (grad [T, B, H] at its position)
            dc += tl.load(p_gc_steps + row * H + o_h[None, :], mask=m_act, other=0.0).to(ACC)
        if HAS_ZONEOUT:  # the workspace holds the blended state: recompute c~
            c = lstm_candidate(i, f, g, c_prev)
            m_zc = zoneout_rows(p_zo + P * s_zu, t, o_b, o_h, m_act, s_zt, s_zb, s_zu, ACC)
            di, df, dg, do, dc_prev = lstm_backward(d, zoneout_to_candidate(m_zc, dc), i, f, g,
                                                    o, c, c_prev)
            dc_prev += zoneout_to_prev(m_zc, dc)
        else:
            c = tl.load(p_w + 4 * H, mask=m_act, other=0.0).to(ACC)
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
            tl.store(p_dh_out + o_bp, tl.where(act, dh_zoned, carry).to(p_dh_out.dtype.element_ty),
                     mask=m)
    elif CELL == LSTM_LN:
        o = tl.load(p_w + 3 * H, mask=m_act, other=0.0).to(ACC)
        ch = tl.load(p_w + 13 * H, mask=m_act, other=0.0).to(ACC)
        do, dch, dy = lstm_ln_backward_output(
            d, o, ch, load_vector(p_ln + 8 * H, o_h, m_h, True, ACC)[None, :],
            load_vector(p_ln + 9 * H, o_h, m_h, True, ACC)[None, :])
        tl.store(p_da_all + row * GH + 3 * H + o_h[None, :],
                 tl.where(act, do, 0.0).to(p_da_all.dtype.element_ty), mask=m)
        tl.store(p_aux_all + row * H + o_h[None, :],
                 tl.where(act, dy, 0.0).to(p_aux_all.dtype.element_ty), mask=m)
        tl.store(p_dh_out + o_bp, tl.where(act, dh_zoned, carry).to(p_dh_out.dtype.element_ty),
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
        if HAS_ZONEOUT:
            dh_prev += dh_zoned
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
        if HAS_ZONEOUT:
            dh_prev += dh_zoned
        tl.store(p_dh_out + o_bp, tl.where(act, dh_prev, carry).to(p_dh_out.dtype.element_ty),
                 mask=m)
    else:
        if HAS_ZONEOUT:  # the candidate h~_t, saved by the forward
            h = tl.load(p_w, mask=m_act, other=0.0).to(ACC)
        else:
            h = tl.load(p_out + row * P + o_h[None, :], mask=m_act, other=0.0).to(ACC)
        da = tl.where(act, rnn_backward(d, h, CELL == RNN_RELU), 0.0)
        tl.store(p_d, da.to(DX_DTYPE), mask=m)
        tl.store(p_da + o_b64[:, None] * GH + o_h[None, :], da.to(DA_DTYPE), mask=m)
        tl.store(p_dh_out + o_bp, tl.where(act, dh_zoned, carry).to(p_dh_out.dtype.element_ty),
                 mask=m)


@triton.autotune(configs=step_configs(), key=["H", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def gru_rb_reset_kernel(
        p_aux, p_w_hh, p_ws, p_out, p_h0, p_len, p_dh, p_dx, p_da, p_dh_out, p_aux_all, p_resets,
        s, T, B, H,
        B_CLASS, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reset-before GRU, backward stage 2 of step s: drh = dn W_hn from the dn of
    every unit (aux), the reset gate's gradient, and the part of dh_{t-1}
    through r*h added to the direct part dh.  Records r*h_{t-1} in aux_all for dW_hn."""
    gru_rb_reset_tile(p_aux, p_w_hh, p_ws, p_out, p_h0, p_len, p_dh, p_dx, p_da, p_dh_out,
                      p_aux_all, p_resets, s, T, B, H, HAS_LENGTHS, REVERSE, HAS_RESETS, ACC, DOT,
                      BLOCK_B, BLOCK_H, BLOCK_K)


@triton.jit
def gru_rb_reset_tile(
        p_aux, p_w_hh, p_ws, p_out, p_h0, p_len, p_dh, p_dx, p_da, p_dh_out, p_aux_all, p_resets,
        s, T, B, H,
        HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr,
        ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of gru_rb_reset_kernel, also called once per step by the spread kernel
    (:mod:`..spread`)."""
    o_b, o_h, m_b, m_h, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, H, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
    m_act = act & m_h[None, :]
    o_bh = o_b64[:, None] * H + o_h[None, :]
    # (a reset step started from h0)
    row_q, m_q, m_0 = start_state_rows(p_resets, t, o_b, o_b64, active, m_act, s, B, REVERSE,
                                       HAS_RESETS)

    drh = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    drh = matmul(drh, p_aux, o_b64, H, m_b, H, p_w_hh + 2 * H * H, H, 1, o_h, m_h, BLOCK_K, DOT)
    r = tl.load(p_ws + row * (3 * H) + o_h[None, :], mask=m_act, other=0.0).to(ACC)
    h_prev = (tl.load(p_out + row_q * H + o_h[None, :], mask=m_q, other=0.0).to(ACC)
              + tl.load(p_h0 + o_bh, mask=m_0, other=0.0).to(ACC))
    dr, dh_prev = gru_rb_backward_reset(drh, r, h_prev)
    dr = tl.where(act, dr, 0.0)
    tl.store(p_dx + row * (3 * H) + o_h[None, :], dr.to(p_dx.dtype.element_ty), mask=m)
    tl.store(p_da + o_b64[:, None] * (2 * H) + o_h[None, :], dr.to(p_da.dtype.element_ty), mask=m)
    tl.store(p_aux_all + row * H + o_h[None, :],
             tl.where(act, r * h_prev, 0.0).to(p_aux_all.dtype.element_ty), mask=m)
    dh = tl.load(p_dh + o_bh, mask=m, other=0.0).to(ACC)
    tl.store(p_dh_out + o_bh, tl.where(act, dh + dh_prev, dh).to(p_dh_out.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["H", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def projection_backward_kernel(
        p_gout, p_dh, p_da_next, p_w_hh, p_len, p_dh_tot, p_dh_out, p_dh_tot_all, p_resets, p_zo,
        p_dh0_in, p_dh0_out,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        B_CLASS, HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """LSTM with projection, step s, for a tile of rows x outputs (BLOCK_H of
    the P outputs): the total gradient of the projected h_t,
    ``dh + dA_{s+1} W_hh + grad_output``, into dh_tot [B, P] (for
    gates_backward_kernel) and dh_tot_all [T, B, P] (for dW_hr).  The LSTM has
    no direct path from h_{t-1} to h_t: dh_out is 0 (with zoneout, the start
    state's share), or the whole carry for a finished row."""
    projection_backward_tile(p_gout, p_dh, p_da_next, p_w_hh, p_len, p_dh_tot, p_dh_out,
                             p_dh_tot_all, p_resets, p_zo, p_dh0_in, p_dh0_out, s, T, B, H, P,
                             s_zt, s_zb, s_zu, HAS_NEXT, HAS_LENGTHS, REVERSE, HAS_RESETS,
                             HAS_ZONEOUT, ACC, DOT, BLOCK_B, BLOCK_H, BLOCK_K)


@triton.jit
def projection_backward_tile(
        p_gout, p_dh, p_da_next, p_w_hh, p_len, p_dh_tot, p_dh_out, p_dh_tot_all, p_resets, p_zo,
        p_dh0_in, p_dh0_out,
        s, T, B, H, P, s_zt, s_zb, s_zu,
        HAS_NEXT: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The body of projection_backward_kernel, also called once per step by the spread kernel
    (:mod:`..spread`)."""
    o_b, o_p, m_b, m_p, m, active, act, t, o_b64, row = step_tile(
        p_len, s, T, B, P, HAS_LENGTHS, REVERSE, BLOCK_B, BLOCK_H)
    o_bp = o_b64[:, None] * P + o_p[None, :]

    carry = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_NEXT:
        carry = matmul(carry, p_da_next, o_b64, 4 * H, m_b, 4 * H, p_w_hh, P, 1, o_p, m_p,
                       BLOCK_K, DOT)
    carry += tl.load(p_dh + o_bp, mask=m, other=0.0).to(ACC)
    # the gradient of h0 where the next step was a reset
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)
    carry = carry_past_reset(carry, p_dh0_in, p_dh0_out, o_bp, m, nr, HAS_RESETS, ACC)
    m_act = act & m_p[None, :]
    gout = tl.load(p_gout + row * P + o_p[None, :], mask=m_act, other=0.0).to(ACC)
    total = tl.where(act, carry + gout, 0.0)
    direct = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    if HAS_ZONEOUT:  # split between the start state and the candidate
        m_zh = zoneout_rows(p_zo, t, o_b, o_p, m_act, s_zt, s_zb, s_zu, ACC)
        direct = zoneout_to_prev(m_zh, total)
        total = zoneout_to_candidate(m_zh, total)
    tl.store(p_dh_tot + o_bp, total.to(p_dh_tot.dtype.element_ty), mask=m)
    tl.store(p_dh_tot_all + row * P + o_p[None, :], total.to(p_dh_tot_all.dtype.element_ty), mask=m)
    tl.store(p_dh_out + o_bp, tl.where(act, direct, carry).to(p_dh_out.dtype.element_ty), mask=m)


@triton.autotune(configs=row_configs(), key=["H", "B_CLASS"])
@triton.jit(do_not_specialize=["s", "T", "B_CLASS"])
def lstm_ln_backward_kernel(
        p_ws, p_dy_all, p_da_all, p_dc, p_c0, p_ln, p_len, p_resets, p_zo,
        p_dx, p_dhr, p_dhr_all, p_dc_out, p_dc0_in, p_dc0_out,
        s, T, B, H, s_zt, s_zb, s_zu,
        B_CLASS, WS: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_RESETS: tl.constexpr, HAS_ZONEOUT: tl.constexpr, ACC: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """LSTM-LN, backward stage 2 of step s, for BLOCK_B whole rows (the units in
    chunks of BLOCK_H), after gates_backward_kernel (do in da_all, dy in
    dy_all [T, B, H]): the cell norm's backward, with the carried dc (c's
    zoneout split; added to dc0_in into dc0_out where the next step was a reset), the
    gates' backward (di, df, dg into da_all [T, B, 4H]), dc_out [B, H], and the
    two gate layer norms' backward: dx [T, B, 4H] (the gradient of x W_ih^T)
    and dhr (the gradient of h W_hh^T, which multiplies W_hh) into dhr [B, 4H]
    and dhr_all [T, B, 4H].  Zeros at padding positions."""
    o_b, m_b, active, act, t, o_b64, row = step_rows(p_len, s, T, B, HAS_LENGTHS, REVERSE, BLOCK_B)
    row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b64[:, None]
    has_prev = s > 0
    if HAS_RESETS:
        has_prev = (reset_rows(p_resets, t, o_b, active, B)[:, None] == 0) & has_prev
    nr = next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE, HAS_RESETS)
    p_w = p_ws + row * WS
    p_a = p_da_all + row * (4 * H)
    o_j = tl.arange(0, BLOCK_H)
    DA_DTYPE = p_da_all.dtype.element_ty
    rstd_x = tl.load(p_w + 14 * H, mask=act, other=0.0).to(ACC)
    rstd_h = tl.load(p_w + 14 * H + 1, mask=act, other=0.0).to(ACC)
    rstd_c = tl.load(p_w + 14 * H + 2, mask=act, other=0.0).to(ACC)

    # The means of the cell norm's backward (dc^ = dy g_c) ...
    sum_d = tl.zeros([BLOCK_B], ACC)
    sum_dv = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m_u = o_u < H
        m_a = act & m_u[None, :]
        dch = (tl.load(p_dy_all + row * H + o_u[None, :], mask=m_a, other=0.0).to(ACC)
               * load_vector(p_ln + 8 * H, o_u, m_u, True, ACC)[None, :])
        sum_d += tl.sum(dch, axis=1)
        sum_dv += tl.sum(dch * tl.load(p_w + 13 * H + o_u[None, :], mask=m_a, other=0.0).to(ACC),
                         axis=1)
    mean_d = (sum_d / H)[:, None]
    mean_dv = (sum_dv / H)[:, None]
    # ... the gates' backward, and the means of the gate norms' backward ...
    sx_d = tl.zeros([BLOCK_B], ACC)
    sx_dv = tl.zeros([BLOCK_B], ACC)
    sh_d = tl.zeros([BLOCK_B], ACC)
    sh_dv = tl.zeros([BLOCK_B], ACC)
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m_u = o_u < H
        m = m_b[:, None] & m_u[None, :]
        m_a = act & m_u[None, :]
        o_bu = o_b64[:, None] * H + o_u[None, :]
        p_wu = p_w + o_u[None, :]
        dc = tl.load(p_dc + o_bu, mask=m, other=0.0).to(ACC)
        # the gradient of c0 where the next step was a reset
        dc = carry_past_reset(dc, p_dc0_in, p_dc0_out, o_bu, m, nr, HAS_RESETS, ACC)
        ch = tl.load(p_wu + 13 * H, mask=m_a, other=0.0).to(ACC)
        dch = (tl.load(p_dy_all + row * H + o_u[None, :], mask=m_a, other=0.0).to(ACC)
               * load_vector(p_ln + 8 * H, o_u, m_u, True, ACC)[None, :])
        dcl = ln_backward(dch, ch, rstd_c, mean_d, mean_dv)
        if HAS_ZONEOUT:
            m_zc = zoneout_rows(p_zo + H * s_zu, t, o_b, o_u, m_a, s_zt, s_zb, s_zu, ACC)
            dc_zoned = zoneout_to_prev(m_zc, dc)
            dcl += zoneout_to_candidate(m_zc, dc)
        else:
            dcl += dc
        i = tl.load(p_wu, mask=m_a, other=0.0).to(ACC)
        f = tl.load(p_wu + H, mask=m_a, other=0.0).to(ACC)
        g = tl.load(p_wu + 2 * H, mask=m_a, other=0.0).to(ACC)
        c_prev = tl.load(p_ws + row_q * WS + 4 * H + o_u[None, :], mask=m_a & has_prev,
                         other=0.0).to(ACC)
        c_prev = tl.where(has_prev, c_prev, tl.load(p_c0 + o_bu, mask=m, other=0.0).to(ACC))
        di, df, dg, dc_prev = lstm_ln_backward_gates(dcl, i, f, g, c_prev)
        if HAS_ZONEOUT:
            dc_prev += dc_zoned
        tl.store(p_dc_out + o_bu, tl.where(act, dc_prev, dc).to(p_dc_out.dtype.element_ty), mask=m)
        di = tl.where(act, di, 0.0)
        df = tl.where(act, df, 0.0)
        dg = tl.where(act, dg, 0.0)
        do = tl.load(p_a + 3 * H + o_u[None, :], mask=m_a, other=0.0).to(ACC)
        tl.store(p_a + o_u[None, :], di.to(DA_DTYPE), mask=m)
        tl.store(p_a + H + o_u[None, :], df.to(DA_DTYPE), mask=m)
        tl.store(p_a + 2 * H + o_u[None, :], dg.to(DA_DTYPE), mask=m)
        gx0, gx1, gx2, gx3 = load_gate_vectors(p_ln, o_u, m_u, H, 4, True, ACC)
        gh0, gh1, gh2, gh3 = load_gate_vectors(p_ln + 4 * H, o_u, m_u, H, 4, True, ACC)
        sx_d += tl.sum(di * gx0 + df * gx1 + dg * gx2 + do * gx3, axis=1)
        sx_dv += tl.sum(di * gx0 * tl.load(p_wu + 5 * H, mask=m_a, other=0.0).to(ACC)
                        + df * gx1 * tl.load(p_wu + 6 * H, mask=m_a, other=0.0).to(ACC)
                        + dg * gx2 * tl.load(p_wu + 7 * H, mask=m_a, other=0.0).to(ACC)
                        + do * gx3 * tl.load(p_wu + 8 * H, mask=m_a, other=0.0).to(ACC), axis=1)
        sh_d += tl.sum(di * gh0 + df * gh1 + dg * gh2 + do * gh3, axis=1)
        sh_dv += tl.sum(di * gh0 * tl.load(p_wu + 9 * H, mask=m_a, other=0.0).to(ACC)
                        + df * gh1 * tl.load(p_wu + 10 * H, mask=m_a, other=0.0).to(ACC)
                        + dg * gh2 * tl.load(p_wu + 11 * H, mask=m_a, other=0.0).to(ACC)
                        + do * gh3 * tl.load(p_wu + 12 * H, mask=m_a, other=0.0).to(ACC), axis=1)
    mx_d = (sx_d / (4 * H))[:, None]
    mx_dv = (sx_dv / (4 * H))[:, None]
    mh_d = (sh_d / (4 * H))[:, None]
    mh_dv = (sh_dv / (4 * H))[:, None]
    # (da_all is read back by other threads of the program: a block-wide barrier)
    tl.debug_barrier()
    # ... and the gate norms' backward: dx = LN'(da g_ih), dhr = LN'(da g_hh).
    for j0 in range(0, H, BLOCK_H):
        o_u = j0 + o_j
        m_u = o_u < H
        m = m_b[:, None] & m_u[None, :]
        m_a = act & m_u[None, :]
        p_wu = p_w + o_u[None, :]
        o_r = row * (4 * H) + o_u[None, :]
        o_bu = o_b64[:, None] * (4 * H) + o_u[None, :]
        for k in tl.static_range(4):
            da = tl.load(p_a + k * H + o_u[None, :], mask=m_a, other=0.0).to(ACC)
            gx = load_vector(p_ln + k * H, o_u, m_u, True, ACC)[None, :]
            gh = load_vector(p_ln + (4 + k) * H, o_u, m_u, True, ACC)[None, :]
            xh = tl.load(p_wu + (5 + k) * H, mask=m_a, other=0.0).to(ACC)
            hh = tl.load(p_wu + (9 + k) * H, mask=m_a, other=0.0).to(ACC)
            dxr = tl.where(act, ln_backward(da * gx, xh, rstd_x, mx_d, mx_dv), 0.0)
            dhr = tl.where(act, ln_backward(da * gh, hh, rstd_h, mh_d, mh_dv), 0.0)
            tl.store(p_dx + o_r + k * H, dxr.to(p_dx.dtype.element_ty), mask=m)
            tl.store(p_dhr_all + o_r + k * H, dhr.to(p_dhr_all.dtype.element_ty), mask=m)
            tl.store(p_dhr + o_bu + k * H, dhr.to(p_dhr.dtype.element_ty), mask=m)


@triton.autotune(configs=step_configs(), key=["I", "GH", "P", "B_CLASS"])
@triton.jit(do_not_specialize=["B_CLASS"])
def input_grad_kernel(
        p_dx, p_w_ih, p_da, p_w_hh, p_dh, p_gx, p_gh,
        B, I, GH, DA, P,
        B_CLASS, ACC: tl.constexpr, DOT: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The transposed product of the step, one GEMM over the concatenated N:
    ``[grad_x | grad_h] = [dx W_ih | dh + dA W_hh]`` for a tile of rows x
    columns; the first cdiv(I, BLOCK_H) column tiles are grad_x [B, I], the
    rest grad_h [B, P].  dx [B, G*H], dA [B, DA] (DA <= G*H rows of W_hh).
    With I = 0 it finishes the recurrence: grad_h0 = dh + dA_0 W_hh."""
    i_n = tl.program_id(1)
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
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
