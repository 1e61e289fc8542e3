"""What every per-step kernel shares: the tile a program owns at loop step s
(its rows, units and time positions), the start states a backward step reads,
and the stores of the state the next step starts from (forward) or of the
carry that crosses a reset into the gradient of h0 / c0 (backward)."""
import triton
import triton.language as tl

from ..tiles import next_reset_rows, positions, previous_position, reset_rows


@triton.jit
def step_tile(p_len, s, T, B, N, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
              BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile of program (i_b, i_n) at loop step s: rows o_b [BLOCK_B] and
    columns o_n [BLOCK_N] of N (units, or the P outputs of a projection), their
    masks m_b, m_n and m (both), each row's ``active`` flag and time position t
    (:func:`.tiles.positions`), act = active as a column, the rows as int64
    and ``row``, the rows of the [T, B, *] tensors at the positions."""
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_b, m_n = o_b < B, o_n < N
    m = m_b[:, None] & m_n[None, :]
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    return o_b, o_n, m_b, m_n, m, active, active[:, None], t, o_b64, row


@triton.jit
def step_rows(p_len, s, T, B, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
              BLOCK_B: tl.constexpr):
    """The rows of a row kernel's program at loop step s (whole rows, the units
    in a loop): as :func:`step_tile` without the columns."""
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    active, t = positions(p_len, o_b, m_b, s, T, HAS_LENGTHS, REVERSE)
    o_b64 = o_b.to(tl.int64)
    row = t.to(tl.int64)[:, None] * B + o_b64[:, None]
    return o_b, m_b, active, active[:, None], t, o_b64, row


@triton.jit
def next_resets(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS: tl.constexpr,
                REVERSE: tl.constexpr, HAS_RESETS: tl.constexpr):
    """[BLOCK_B, 1] bool: the rows whose next step starts from the reset state
    (h0 / c0 unless given; :func:`.tiles.next_reset_rows`); no row without resets (then unused: every
    use sits under HAS_RESETS)."""
    if HAS_RESETS:
        nr = next_reset_rows(p_resets, p_len, o_b, m_b, s, T, B, HAS_LENGTHS, REVERSE)[:, None]
    else:
        nr = (o_b < 0)[:, None]
    return nr


@triton.jit
def start_state_rows(p_resets, t, o_b, o_b64, active, m_act, s, B, REVERSE: tl.constexpr,
                     HAS_RESETS: tl.constexpr):
    """Where an active row's step started from, for a backward step: ``row_q``,
    the rows of the [T, B, *] tensors one position earlier, read where m_q; h0
    (c0) where m_0 -- at the first step and, with resets, at a reset."""
    row_q = previous_position(t, s, REVERSE).to(tl.int64)[:, None] * B + o_b64[:, None]
    m_q = m_act & (s > 0)
    m_0 = m_act & (s == 0)
    if HAS_RESETS:
        rs = reset_rows(p_resets, t, o_b, active, B)[:, None]
        m_q = m_q & (rs == 0)
        m_0 = m_0 | (m_act & rs)
    return row_q, m_q, m_0


@triton.jit
def store_next_state(p_next, offs, m, act, new, prev, p_start, nr, HAS_RESETS: tl.constexpr,
                     ACC: tl.constexpr):
    """Stores the state the next step starts from: ``new`` for an active row,
    ``prev`` for a finished one (it keeps its state), and the start state
    (p_start: h0 / c0) where the next step is a reset (nr)."""
    nxt = tl.where(act, new, prev)
    if HAS_RESETS:
        nxt = tl.where(nr, tl.load(p_start + offs, mask=m, other=0.0).to(ACC), nxt)
    tl.store(p_next + offs, nxt.to(p_next.dtype.element_ty), mask=m)


@triton.jit
def carry_past_reset(d, p_sum_in, p_sum_out, offs, m, nr, HAS_RESETS: tl.constexpr,
                     ACC: tl.constexpr):
    """The backward's carry of rows whose next step was a reset is the gradient
    of h0 (c0): added to the running sum (read from p_sum_in, written to
    p_sum_out, every element) and not carried on.  Returns the carry."""
    if HAS_RESETS:
        total = tl.load(p_sum_in + offs, mask=m, other=0.0).to(ACC)
        tl.store(p_sum_out + offs, (total + tl.where(nr, d, 0.0)).to(p_sum_out.dtype.element_ty),
                 mask=m)
        d = tl.where(nr, 0.0, d)
    return d
