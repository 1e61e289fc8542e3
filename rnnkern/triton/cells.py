"""Gate math of every cell for the Triton kernels: the Triton twin of csrc/cells.h.

Every formula the Triton kernels use lives here, once; the kernels in
:mod:`.sequence` and :mod:`.step` only move blocks and call these functions.
Names, argument order and results follow csrc/cells.h one to one, so the two
can be read side by side.  All functions work elementwise on blocks in the
accumulate dtype (float32, or float64 for float64 inputs).

Conventions (csrc/cells.h, torch.nn's):
  * gate order  RNN: (a)   LSTM: (i, f, g, o)   GRU: (r, z, n);
  * workspace saved per unit and step for the backward:
        LSTM             i, f, g, o, c
        GRU reset-after  r, z, n, hn      (hn = W_hn h + b_hn)
        GRU reset-before r, z, n
        RNN              nothing (h_t itself is the output); with zoneout the
                         candidate h~_t (the output is blended)
        LSTM-LN          i, f, g, o, c, x^ (4 blocks), h^ (4 blocks), c^, then
                         3 per row: rstd of x W_ih^T, of h W_hh^T, of c~
    where c is the cell state the step ends with (after zoneout); the LSTMs'
    backward recomputes their candidate c~ = f c_{t-1} + i g (lstm_candidate).
"""
import triton
import triton.language as tl

# Cell ids: the values of rnnkern::Cell in csrc/cells.h.
RNN_TANH: tl.constexpr = tl.constexpr(0)
RNN_RELU: tl.constexpr = tl.constexpr(1)
LSTM: tl.constexpr = tl.constexpr(2)
GRU: tl.constexpr = tl.constexpr(3)
GRU_RESET_BEFORE: tl.constexpr = tl.constexpr(4)
LSTM_LN: tl.constexpr = tl.constexpr(5)

CELL_IDS = {"rnn_tanh": 0, "rnn_relu": 1, "lstm": 2, "gru": 3, "gru_reset_before": 4, "lstm_ln": 5}

#: Layer norm's epsilon of LSTM-LN (csrc/cells.h kLayerNormEps, rnnkern.reference.LN_EPS).
LN_EPS: tl.constexpr = tl.constexpr(1e-5)


# ------------------------------------------------------ elementary functions ----

@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    # From exp (libdevice's tanh is not available under the interpreter); the
    # form in |x| never overflows and keeps the sign exact.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def relu(x):
    # x where x > 0 else 0; NaN propagates (as torch.relu).
    return tl.where(x < 0, 0.0, x)


@triton.jit
def relu_grad(dy, y):
    # torch's relu backward: grad where result > 0, else 0 (a NaN result passes grad).
    return tl.where(y <= 0, 0.0, dy)


@triton.jit
def sigmoid_backward(dy, y):
    # d sigmoid(a) / da through y = sigmoid(a), times the incoming grad.
    return dy * y * (1.0 - y)


@triton.jit
def tanh_backward(dy, y):
    return dy * (1.0 - y * y)


# ---------------------------------------------------------------------- RNN ----

@triton.jit
def rnn_forward(pre, RELU: tl.constexpr):
    """h = phi(xproj + hproj), pre = xproj + hproj."""
    if RELU:
        h = relu(pre)
    else:
        h = tanh(pre)
    return h


@triton.jit
def rnn_backward(dh, h, RELU: tl.constexpr):
    """Gradient of the pre-activation from dh and the output h."""
    if RELU:
        d = relu_grad(dh, h)
    else:
        d = tanh_backward(dh, h)
    return d


# --------------------------------------------------------------------- LSTM ----

@triton.jit
def lstm_forward(pi, pf, pg, po, c_prev):
    """p*: the gate pre-activations xproj + hproj.  Returns i, f, g, o, c and the
    unprojected h = o * tanh(c)."""
    i = sigmoid(pi)
    f = sigmoid(pf)
    g = tanh(pg)
    o = sigmoid(po)
    c = lstm_candidate(i, f, g, c_prev)
    h = o * tanh(c)
    return i, f, g, o, c, h


@triton.jit
def lstm_candidate(i, f, g, c_prev):
    """The new cell state before zoneout (LstmUnit::candidate); the backward of a
    zoned-out step recomputes it from the saved gates."""
    return f * c_prev + i * g


@triton.jit
def lstm_backward(dh, dc, i, f, g, o, c, c_prev):
    """dh: gradient of the unprojected h_t; dc: gradient of c_t from step t+1.
    Returns the pre-activation gradients di, df, dg, do and dc_prev."""
    tc = tanh(c)
    dc_total = dc + tanh_backward(dh * o, tc)
    di = sigmoid_backward(dc_total * g, i)
    df = sigmoid_backward(dc_total * c_prev, f)
    dg = tanh_backward(dc_total * i, g)
    do = sigmoid_backward(dh * tc, o)
    dc_prev = dc_total * f
    return di, df, dg, do, dc_prev


@triton.jit
def lstm_hidden(o, c):
    """The unprojected h = o * tanh(c), recomputed by the backward for dW_hr."""
    return o * tanh(c)


# -------------------------------------------------------- GRU, reset after ----

@triton.jit
def gru_forward(xr, xz, xn, hr, hz, hn, h_prev):
    """x*: input projections (with b_ih); h*: recurrent projections (with b_hh).
    Returns r, z, n, h."""
    r = sigmoid(xr + hr)
    z = sigmoid(xz + hz)
    n = tanh(xn + r * hn)
    h = (1.0 - z) * n + z * h_prev
    return r, z, n, h


@triton.jit
def gru_backward(dh, r, z, n, hn, h_prev):
    """Returns dr, dz (pre-activation grads, the same for the x and h parts), dxn,
    dhn and the direct part of dh_prev (W_hh^T [dr, dz, dhn] is added by a GEMM)."""
    dn = tanh_backward(dh * (1.0 - z), n)
    dz = sigmoid_backward(dh * (h_prev - n), z)
    dr = sigmoid_backward(dn * hn, r)
    dxn = dn
    dhn = dn * r
    dh_prev = dh * z
    return dr, dz, dxn, dhn, dh_prev


# ------------------------------------------------------- GRU, reset before ----
# Two stages per step, because the reset gate acts before the recurrent GEMM
# of the candidate:  (1) r, z from [xr + hr, xz + hz];  rh = r * h_prev
#                    (2) n = tanh(xn + hn) with hn = W_hn rh + b_hn.

@triton.jit
def gru_rb_gates(xr, xz, hr, hz, h_prev):
    """Stage 1: returns r, z and rh = r * h_prev."""
    r = sigmoid(xr + hr)
    z = sigmoid(xz + hz)
    rh = r * h_prev
    return r, z, rh


@triton.jit
def gru_rb_candidate(xn, hn, z, h_prev):
    """Stage 2: returns n and h."""
    n = tanh(xn + hn)
    h = (1.0 - z) * n + z * h_prev
    return n, h


@triton.jit
def gru_rb_backward_candidate(dh, z, n, h_prev):
    """Backward stage 1: returns dz, dn (the pre-activation grad of n, for both
    xn and hn) and the direct part of dh_prev."""
    dz = sigmoid_backward(dh * (h_prev - n), z)
    dn = tanh_backward(dh * (1.0 - z), n)
    dh_prev = dh * z
    return dz, dn, dh_prev


@triton.jit
def gru_rb_backward_reset(drh, r, h_prev):
    """Backward stage 2, from drh = W_hn^T dn: returns dr and the part of dh_prev
    through rh = r * h_prev."""
    dr = sigmoid_backward(drh * h_prev, r)
    dh_prev = drh * r
    return dr, dh_prev


# ------------------------------------------------------------------ zoneout ----
# The state a step ends with, per unit: h_t = m h_{t-1} + (1 - m) h~_t (and c
# alike), m the mask value (0 or 1 in training, the probability in
# evaluation).  Its gradient d splits into m d for the previous state and
# (1 - m) d for the candidate.  (csrc/cells.h: Zoneout)

@triton.jit
def zoneout_forward(m, prev, cand):
    return cand + m * (prev - cand)


@triton.jit
def zoneout_to_prev(m, d):
    return m * d


@triton.jit
def zoneout_to_candidate(m, d):
    return (1.0 - m) * d


# --------------------------------------------------------------- layer norm ----
# Per element, given its row's statistics (the kernels reduce over the row
# their own way): v^ = (v - mean) * rstd, and the backward
# dv = rstd * (dv^ - mean(dv^) - v^ * mean(dv^ * v^)), means over the row.
# No affine part here.  (csrc/cells.h: LayerNorm)

@triton.jit
def ln_rstd(variance):
    return 1.0 / tl.sqrt(variance + LN_EPS)


@triton.jit
def ln_normalize(v, mean, rstd):
    return (v - mean) * rstd


@triton.jit
def ln_backward(dvhat, vhat, rstd, mean_dvhat, mean_dvhat_vhat):
    return rstd * (dvhat - mean_dvhat - vhat * mean_dvhat_vhat)


# ------------------------------------------------------------------ LSTM-LN ----
# Per unit, between the row reductions of the three layer norms
# (csrc/cells.h: LstmLnUnit):
#   gates:  a_k = x^_k g_ih_k + h^_k g_hh_k + b_k  (k = i, f, g, o), then the
#           LSTM's activations (lstm_gates) and candidate c~ (before zoneout);
#   output: h~ = o tanh(c^ g_c + beta_c), c^ the normalised c~.

@triton.jit
def lstm_ln_pre_activation(xhat, hhat, g_ih, g_hh, b):
    return xhat * g_ih + hhat * g_hh + b


@triton.jit
def lstm_gates(pi, pf, pg, po):
    """The LSTM's activated gates i, f, g, o from their pre-activations."""
    return sigmoid(pi), sigmoid(pf), tanh(pg), sigmoid(po)


@triton.jit
def lstm_ln_output(o, chat, g_c, beta_c):
    return o * tanh(chat * g_c + beta_c)


@triton.jit
def lstm_ln_backward_output(dh, o, chat, g_c, beta_c):
    """dh: gradient of h~ (after zoneout's split).  Returns do (pre-activation
    gradient of o), dchat (into the cell layer norm's backward) and dy, the
    gradient of c^ g_c + beta_c (d beta_c; d g_c = dy c^)."""
    ty = tanh(chat * g_c + beta_c)
    do = sigmoid_backward(dh * ty, o)
    dy = tanh_backward(dh * o, ty)
    dchat = dy * g_c
    return do, dchat, dy


@triton.jit
def lstm_ln_backward_gates(dc, i, f, g, c_prev):
    """dc: the whole gradient of c~ (from the cell layer norm and from step t+1).
    Returns the pre-activation gradients di, df, dg and the gradient of c_{t-1}."""
    di = sigmoid_backward(dc * g, i)
    df = sigmoid_backward(dc * c_prev, f)
    dg = tanh_backward(dc * i, g)
    dc_prev = dc * f
    return di, df, dg, dc_prev
