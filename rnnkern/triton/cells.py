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
        RNN              nothing (h_t itself is the output)
"""
import triton
import triton.language as tl

# Cell ids: the values of rnnkern::Cell in csrc/cells.h.
RNN_TANH: tl.constexpr = tl.constexpr(0)
RNN_RELU: tl.constexpr = tl.constexpr(1)
LSTM: tl.constexpr = tl.constexpr(2)
GRU: tl.constexpr = tl.constexpr(3)
GRU_RESET_BEFORE: tl.constexpr = tl.constexpr(4)

CELL_IDS = {"rnn_tanh": 0, "rnn_relu": 1, "lstm": 2, "gru": 3, "gru_reset_before": 4}


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
    c = f * c_prev + i * g
    h = o * tanh(c)
    return i, f, g, o, c, h


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
