"""Spread kernels: the whole time loop in one launch, spread over the GPU's SMs.

Where the weights do not fit on one SM (:func:`.sequence.fits_on_chip`), the
per-step path launches one kernel per step from Python: 2-5 us of launch
latency per step, for a step whose product may take less.  A spread kernel
launches once: one program per tile of BLOCK_B rows x BLOCK_H units (the
per-step kernels' tiles), every program resident at once (at most one per SM,
:func:`tiles`), each looping over the T steps.  Per step a program runs the
per-step body for its tile (:func:`.step.forward.gates_forward_tile`,
:func:`.step.backward.gates_backward_tile`: one source for the step's math and
its options), then meets the other programs of its batch rows at a grid
barrier, because the next step's product reads the h (backward: the dA) that
every program wrote.  The states ping-pong between two buffers, as on the
per-step path, so one barrier per step is enough: a buffer is written again
only two steps later, after every program has passed the barrier that ends
the step that read it.

The barrier (:func:`grid_barrier`) is a counter per batch tile: after a CTA
barrier (every thread's stores issued), one thread adds 1 with release
semantics at GPU scope, then spins on acquire loads until every program of
the batch tile has arrived; a second CTA barrier lets the other threads go.
Checked in the sm_90 PTX (tests/test_triton.py): ``atom.global.gpu.release``,
``ld.global.gpu.acquire``, and no non-coherent (``.nc``) loads anywhere in the
kernels, so exchanged rows are never read through the read-only path.

Triton has no cooperative launch: co-residency comes from launching at most
one program per SM (the device's SM count; :func:`tiles` returns None, and
the ops take the per-step path, where the tiles would need more).  A launch
sharing the GPU with other kernels waits for SMs they free, never for them.

Under ``TRITON_INTERPRET=1`` the interpreter runs a grid's programs one after
another, so a barrier would wait forever: :func:`launch` runs them as threads
instead, on a deterministic schedule that switches programs where one spins
(:class:`_ConcurrentPrograms`), which lets CI check the barrier's logic on
the CPU: without the barrier, or with one that waits for one program fewer,
the results are wrong in every run, and programs that can never meet are
reported instead of hanging (tests/test_triton.py).

With lengths each row tile runs its own steps (its programs share their rows,
hence their steps and their barriers): the forward up to its longest row and
one more, the backward from its longest row down, so that a packed batch's
tiles of short rows cost their real steps (the wrapper in :mod:`.ops` zeroes
the padding and starts both buffers of each backward pair alike).

Cells: tanh/ReLU RNN, GRU, LSTM, each with lengths, reverse, resets, the
reset state, zoneout and every step's c; the reset-before GRU and the LSTM
projection, whose step runs in two stages (the second reads what every
program's first wrote), with a barrier after each stage.  LSTM-LN's layer
norms reduce whole rows (row kernels on the per-step path): it stays there.
"""
from __future__ import annotations

import inspect
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from .cells import GRU_RESET_BEFORE
from .step.backward import gates_backward_tile, gru_rb_reset_tile, projection_backward_tile
from .step.forward import gates_forward_tile, gru_rb_candidate_tile, projection_forward_tile
from .tiles import sequence_steps
from .tuning import INTERPRET

#: The cells a spread kernel runs (LSTM-LN's layer norms need whole rows: per step).
CELLS = ("rnn_tanh", "rnn_relu", "gru", "gru_reset_before", "lstm")

#: Under the interpreter: the "SMs" a spread grid may use (threads).
INTERPRET_PROGRAMS = 8


@triton.jit
def grid_barrier(p_count, target):
    """Waits until the counter at p_count reaches target, after adding this
    program's arrival: every program of the group adds 1 per step, so after
    step k the group's counter reaches (k + 1) * programs."""
    tl.debug_barrier()  # every thread's stores of this step precede the release
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # the other threads read the exchanged rows after the acquire


@triton.jit(do_not_specialize=["T"])
def forward_spread_kernel(
        p_xproj, p_hs, p_cs, p_w_hh, p_b_ih, p_b_hh, p_w_hr, p_len, p_out, p_ws, p_aux, p_h0,
        p_c0, p_resets, p_zo, p_c_steps, p_count,
        T, B, H, P, s_zt, s_zb, s_zu,
        CELL: tl.constexpr, G: tl.constexpr, WS: tl.constexpr, HAS_B_IH: tl.constexpr,
        HAS_B_HH: tl.constexpr, HAS_PROJ: tl.constexpr, HAS_LENGTHS: tl.constexpr,
        REVERSE: tl.constexpr, TRAIN: tl.constexpr, HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, CELL_STEPS: tl.constexpr, ACC: tl.constexpr,
        DOT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The forward of all T steps for the tile of program (i_b, i_h).

    hs [2, B, P] and cs [2, B, H]: the ping-pong states in the accumulate
    dtype, hs[0] / cs[0] holding h0 / c0; step s reads buffer s % 2 and writes
    the other, so the final states are in buffer T % 2.  p_h0 / p_c0: the
    state a reset restarts from.  count [programs(0)] int32 zeros: the
    barrier counters.  The reset-before GRU and the LSTM projection run their
    step in two stages, the second reading what every program's first wrote
    to aux ([B, 4H] / [B, H], as on the per-step path): a barrier after each
    (the projection's stage on P of the H columns' programs).  The rest as
    gates_forward_kernel."""
    n_h = tl.num_programs(1)
    p_count += tl.program_id(0)
    # With lengths the steps up to the longest of the tile's rows, and one more,
    # where it finishes (its state copied into the other buffer, so that both
    # hold every row's final state); the padding after comes zeroed (ops.py).
    # The programs of a barrier group share their rows, hence their steps.
    T_run = T
    if HAS_LENGTHS:
        o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        T_run = tl.minimum(sequence_steps(p_len, o_b, o_b < B, T, HAS_LENGTHS) + 1, T)
    for s in range(T_run):
        now = tl.cast(s % 2, tl.int64)
        nxt = 1 - now
        size_h = (now * 0 + B) * P  # int64, whatever B and P were specialised to
        size_c = (now * 0 + B) * H
        p_h, p_h_next = p_hs + now * size_h, p_hs + nxt * size_h
        # (x, w_ih: unused placeholders, the single-step op's)
        gates_forward_tile(p_xproj, p_xproj, p_xproj, p_h, p_cs + now * size_c, p_w_hh, p_b_ih,
                           p_b_hh, p_len, p_out, p_h_next, p_cs + nxt * size_c, p_ws, p_aux,
                           p_h0, p_c0, p_resets, p_zo, p_c_steps, s, T, B, 0, H, P, s_zt, s_zb,
                           s_zu, CELL=CELL, G=G, WS=WS, HAS_X=False, HAS_B_IH=HAS_B_IH,
                           HAS_B_HH=HAS_B_HH, HAS_LENGTHS=HAS_LENGTHS, REVERSE=REVERSE,
                           TRAIN=TRAIN, HAS_PROJ=HAS_PROJ, STORE_STATE=True,
                           HAS_RESETS=HAS_RESETS, HAS_ZONEOUT=HAS_ZONEOUT,
                           CELL_STEPS=CELL_STEPS, ACC=ACC, DOT=DOT, BLOCK_B=BLOCK_B,
                           BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K)
        if CELL == GRU_RESET_BEFORE or HAS_PROJ:
            grid_barrier(p_count, (2 * s + 1) * n_h)
            if CELL == GRU_RESET_BEFORE:
                gru_rb_candidate_tile(p_aux, p_h, p_w_hh, p_b_hh, p_len, p_out, p_h_next, p_ws,
                                      p_h0, p_resets, p_zo, s, T, B, H, s_zt, s_zb, s_zu,
                                      HAS_B_HH=HAS_B_HH, HAS_LENGTHS=HAS_LENGTHS,
                                      REVERSE=REVERSE, TRAIN=TRAIN, STORE_STATE=True,
                                      HAS_RESETS=HAS_RESETS, HAS_ZONEOUT=HAS_ZONEOUT, ACC=ACC,
                                      DOT=DOT, BLOCK_B=BLOCK_B, BLOCK_H=BLOCK_H,
                                      BLOCK_K=BLOCK_K)
            else:
                projection_forward_tile(p_aux, p_w_hr, p_h, p_len, p_out, p_h_next, p_h0,
                                        p_resets, p_zo, s, T, B, H, P, s_zt, s_zb, s_zu,
                                        HAS_LENGTHS=HAS_LENGTHS, REVERSE=REVERSE,
                                        HAS_RESETS=HAS_RESETS, HAS_ZONEOUT=HAS_ZONEOUT, ACC=ACC,
                                        DOT=DOT, BLOCK_B=BLOCK_B, BLOCK_H=BLOCK_H,
                                        BLOCK_K=BLOCK_K)
            grid_barrier(p_count, (2 * s + 2) * n_h)
        else:
            grid_barrier(p_count, (s + 1) * n_h)


@triton.jit(do_not_specialize=["T"])
def backward_spread_kernel(
        p_gout, p_dhs, p_das, p_w_hh, p_w_hr, p_dcs, p_ws, p_out, p_h0, p_c0, p_rh, p_rc,
        p_len, p_dx, p_aux, p_aux_all, p_dh_mid, p_dh_tot, p_dh_tot_all, p_resets, p_zo,
        p_dh0s, p_dc0s, p_gc_steps, p_count,
        T, B, H, P, s_zt, s_zb, s_zu,
        CELL: tl.constexpr, G: tl.constexpr, DA: tl.constexpr, WS: tl.constexpr,
        HAS_PROJ: tl.constexpr, HAS_LENGTHS: tl.constexpr, REVERSE: tl.constexpr,
        HAS_RESETS: tl.constexpr,
        HAS_ZONEOUT: tl.constexpr, CELL_STEPS: tl.constexpr, ACC: tl.constexpr,
        DOT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """BPTT over all T steps (s = T-1 down to 0) for the tile of program (i_b, i_h).

    Ping-pong pairs in the accumulate dtype, indexed by k = T-1-s: the carried
    direct gradient dhs [2, B, P] (dhs[0] = grad_h_n) and dcs [2, B, H]
    (dcs[0] = grad_c_n, or zeros with every step's c), and with resets the
    sums of the reset state's gradient dh0s, dc0s (zeros in [0]); step s reads
    k % 2 and writes the other, so the results are in buffer T % 2.  The gate
    gradients dA ping-pong by s: das [2, B, DA*H] (DA = G; 2 for the
    reset-before GRU's [dr, dz]), the one step T-1 reads (das[T % 2]) zeros, so every
    step adds its product.  The start states: h0 / c0 at s = 0, rh / rc (the
    reset state) after.  Two stages per step, as on the per-step path, a
    barrier after each: the LSTM projection's total gradient of h (dh_tot
    [B, P], by P of the H columns' programs) before the gates; the
    reset-before GRU's dn (aux [B, H]) before its reset gate (dh_mid [B, H]
    between them).  The rest as gates_backward_kernel."""
    n_h = tl.num_programs(1)
    p_count += tl.program_id(0)
    # With lengths the steps below the longest of the tile's rows: at the steps
    # before (backwards) no row has started, whose carries then wait in both
    # buffers of each pair, as they come (dA zero, the padding zeroed: ops.py).
    # Barrier targets count from the group's first step (its programs share
    # their rows, hence their steps).
    k0 = T * 0
    if HAS_LENGTHS:
        o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        k0 = T - sequence_steps(p_len, o_b, o_b < B, T, HAS_LENGTHS)
    for k in range(k0, T):
        s = T - 1 - k
        i = k - k0  # the group's steps so far
        now = tl.cast(k % 2, tl.int64)
        nxt = 1 - now
        a_now = tl.cast(s % 2, tl.int64)
        size_h = (now * 0 + B) * P  # int64, whatever B and P were specialised to
        size_c = (now * 0 + B) * H
        size_a = (now * 0 + B) * (DA * H)
        p_dh_in, p_dh_out = p_dhs + now * size_h, p_dhs + nxt * size_h
        p_da_next, p_da_now = p_das + (1 - a_now) * size_a, p_das + a_now * size_a
        p_hs = p_rh
        p_cst = p_rc
        if s == 0:
            p_hs = p_h0
            p_cst = p_c0
        if HAS_PROJ:
            projection_backward_tile(p_gout, p_dh_in, p_da_next, p_w_hh, p_len, p_dh_tot,
                                     p_dh_out, p_dh_tot_all, p_resets, p_zo,
                                     p_dh0s + now * size_h, p_dh0s + nxt * size_h, s, T, B, H, P,
                                     s_zt, s_zb, s_zu, HAS_NEXT=True, HAS_LENGTHS=HAS_LENGTHS,
                                     REVERSE=REVERSE, HAS_RESETS=HAS_RESETS,
                                     HAS_ZONEOUT=HAS_ZONEOUT, ACC=ACC, DOT=DOT,
                                     BLOCK_B=BLOCK_B, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K)
            grid_barrier(p_count, (2 * i + 1) * n_h)
        if CELL == GRU_RESET_BEFORE:
            p_dh_gates = p_dh_mid  # the direct part before stage 2 adds the path through r*h
        else:
            p_dh_gates = p_dh_out
        # (p_gout also stands for what only LSTM-LN reads: ln, da_all)
        gates_backward_tile(p_gout, p_dh_in, p_da_next, p_w_hh, p_dcs + now * size_c, p_ws,
                            p_out, p_hs, p_cst, p_len, p_dh_tot, p_w_hr, p_dx, p_da_now,
                            p_dh_gates, p_dcs + nxt * size_c, p_aux, p_aux_all, p_resets, p_zo,
                            p_gout, p_gout, p_dh0s + now * size_h, p_dh0s + nxt * size_h,
                            p_dc0s + now * size_c, p_dc0s + nxt * size_c, p_gc_steps, s, T, B,
                            H, P, s_zt, s_zb, s_zu, CELL=CELL, G=G, WS=WS, HAS_GOUT=True,
                            HAS_NEXT=True, HAS_LENGTHS=HAS_LENGTHS, REVERSE=REVERSE,
                            HAS_PROJ=HAS_PROJ, HAS_RESETS=HAS_RESETS, HAS_ZONEOUT=HAS_ZONEOUT,
                            CELL_STEPS=CELL_STEPS, ACC=ACC, DOT=DOT, BLOCK_B=BLOCK_B,
                            BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K)
        if CELL == GRU_RESET_BEFORE:
            grid_barrier(p_count, (2 * i + 1) * n_h)
            gru_rb_reset_tile(p_aux, p_w_hh, p_ws, p_out, p_hs, p_len, p_dh_mid, p_dx, p_da_now,
                              p_dh_out, p_aux_all, p_resets, s, T, B, H,
                              HAS_LENGTHS=HAS_LENGTHS, REVERSE=REVERSE, HAS_RESETS=HAS_RESETS,
                              ACC=ACC, DOT=DOT, BLOCK_B=BLOCK_B, BLOCK_H=BLOCK_H,
                              BLOCK_K=BLOCK_K)
        if CELL == GRU_RESET_BEFORE or HAS_PROJ:
            grid_barrier(p_count, (2 * i + 2) * n_h)
        else:
            grid_barrier(p_count, (i + 1) * n_h)


def _programs(device: torch.device) -> int:
    if INTERPRET:
        return INTERPRET_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tiles(cell: str, B: int, H: int, proj: bool, device: torch.device) -> Optional[dict]:
    """The tile sizes of a spread launch for this call on this device, or None
    where it cannot run (:func:`tiles_for`)."""
    return tiles_for(cell, B, H, proj, _programs(device), INTERPRET)


def tiles_for(cell: str, B: int, H: int, proj: bool, programs: int,
              interpret: bool = False) -> Optional[dict]:
    """The tile sizes of a spread launch on a device of ``programs`` SMs, or
    None where it cannot run: LSTM-LN, or more tiles than SMs even at the
    widest unit tile.  The narrowest unit tile whose grid
    fits, so that the recurrent product spreads over as many SMs as it can.
    ``interpret``: the interpreter's tiles (small, so that tests at small
    sizes still take several programs)."""
    if cell not in CELLS:
        return None
    if interpret:
        block_b, widths, block_k, warps = 4, (4, 8, 16, 32, 64, 128), 4, 1
    else:
        block_b = 16 if B <= 16 else 32 if B <= 32 else 64
        widths, block_k, warps = (16, 32, 64, 128), 64, 4
    n_b = triton.cdiv(B, block_b)
    for block_h in widths:
        if n_b * triton.cdiv(H, block_h) <= programs:
            return dict(BLOCK_B=block_b, BLOCK_H=block_h, BLOCK_K=block_k, num_warps=warps)
    return None


def grid(B: int, H: int, blocks: dict) -> tuple:
    return (triton.cdiv(B, blocks["BLOCK_B"]), triton.cdiv(H, blocks["BLOCK_H"]))


def launch(kernel, grid_: tuple, *args, **kwargs) -> None:
    """Launches a spread kernel; under the interpreter, its programs as threads."""
    if not INTERPRET:
        kernel[grid_](*args, **kwargs)
        return
    with _ConcurrentPrograms():
        kernel[grid_](*args, **kwargs)


class _AbortedProgram(Exception):
    """Raised inside the other programs' threads once one has failed."""


class _ConcurrentPrograms:
    """Within this context Triton's interpreter runs each grid's programs as
    threads sharing the arguments' host copies (its "global memory"), so that
    programs can wait for each other, on a deterministic schedule: one program
    runs at a time, in grid order, until it spins, that is until an atomic
    read (an add of 0) returns what its previous one at that address
    returned; then the next live program runs.  A grid barrier thus lets each
    program run to its arrival and the last arrival through at once, and a
    program with no barrier (or one that waits for too few) runs ahead
    without anyone else having run: such a mistake shows in every run, never
    by chance.  When every live program spins without any atomic changing
    memory in between, none can ever go on: the launch fails ("programs never
    meet"), where a GPU would hang.  If a program fails, the others stop at
    their next atomic and the error is raised.

    It relies on three things of Triton's interpreter (3.6 and 3.8): a grid is
    run by ``interpreter.GridExecutor``, which calls its ``fn`` once per
    program after ``interpreter_builder.set_grid_idx`` and copies the results
    back after the last; ``tl.program_id`` reads the builder's ``grid_idx``;
    atomics go through the builder's ``create_atomic_rmw`` / ``_cas``.  The
    executor's ``fn`` becomes a function that starts a thread per program (its
    own grid index, thread-local) and joins them all at the last one, so the
    copy back sees every program's stores.
    """

    _lock = threading.Lock()

    def __enter__(self):
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
        self._lock.acquire()
        self.interpreter = interpreter
        builder = interpreter.interpreter_builder
        self.builder, self.builder_class = builder, type(builder)
        self.executor = interpreter.GridExecutor
        local = threading.local()
        state = dict(turn=0, live=[], idle=0, threads=[], errors=[], abort=False)
        cond = threading.Condition()

        def wait_turn(me):  # with cond held
            while state["turn"] != me and not state["abort"]:
                cond.wait()
            if state["abort"]:
                raise _AbortedProgram()

        def pass_turn(me):  # with cond held: to the next live program after me
            live = state["live"]
            for k in range(1, len(live) + 1):
                if live[(me + k) % len(live)]:
                    state["turn"] = (me + k) % len(live)
                    break
            cond.notify_all()

        def fail(error):  # with cond held
            state["errors"].append(error)
            state["abort"] = True
            cond.notify_all()

        def after_atomic(is_read, ptr, result):
            """Spinning (a read that saw nothing new) hands the turn on."""
            me = local.me
            key = ptr.data.tobytes()
            stale = is_read and local.last.get(key) is not None and \
                bool((local.last[key] == result.data).all())
            if is_read:
                local.last[key] = result.data.copy()
            with cond:
                if state["abort"]:
                    raise _AbortedProgram()
                if not stale:
                    state["idle"] = 0
                    return
                state["idle"] += 1
                if state["idle"] > 2 * sum(state["live"]):
                    fail(RuntimeError(
                        "spread kernel: programs never meet: every program spins at a grid "
                        "barrier and none can arrive (a barrier waiting for more arrivals than "
                        "there are programs?); on a GPU this launch would hang"))
                    raise _AbortedProgram()
                pass_turn(me)
                wait_turn(me)

        class ScheduledBuilder(self.builder_class):
            @property
            def grid_idx(self):
                return local.idx

            @grid_idx.setter
            def grid_idx(self, value):
                local.idx = value

            def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
                result = super().create_atomic_rmw(rmwOp, ptr, val, mask, sem, scope)
                after_atomic(rmwOp == ir.ATOMIC_OP.ADD and not val.data.any(), ptr, result)
                return result

            def create_atomic_cas(self, ptr, cmp, val, sem, scope):
                result = super().create_atomic_cas(ptr, cmp, val, sem, scope)
                after_atomic(False, ptr, result)
                return result

        grid_idx = getattr(builder, "grid_idx", None)
        builder.__class__ = ScheduledBuilder
        builder.grid_idx = grid_idx

        class ScheduledExecutor(self.executor):
            def __init__(self, fn, *a, **k):
                super().__init__(fn, *a, **k)
                program = self.fn

                def start(**args):
                    idx = builder.grid_idx
                    nx, ny, nz = builder.grid_dim
                    me = (idx[0] * ny + idx[1]) * nz + idx[2]
                    if me == 0:
                        state.update(turn=0, live=[True] * (nx * ny * nz), idle=0,
                                     abort=False)

                    def run():
                        local.idx, local.me, local.last = idx, me, {}
                        try:
                            with cond:
                                wait_turn(me)
                            program(**args)
                        except _AbortedProgram:
                            pass  # another program failed first: its error is raised
                        except BaseException as e:  # noqa: BLE001 - re-raised by the launcher
                            with cond:
                                fail(e)
                        finally:
                            with cond:
                                state["live"][me] = False
                                pass_turn(me)

                    thread = threading.Thread(target=run, daemon=True)
                    state["threads"].append(thread)
                    thread.start()
                    if me == nx * ny * nz - 1:  # the last program: wait for them all
                        for thread in state["threads"]:
                            thread.join()
                        state["threads"].clear()
                        if state["errors"]:
                            error = state["errors"][0]
                            state["errors"].clear()
                            raise error

                start.__signature__ = inspect.signature(program)  # read by the executor
                self.fn = start

        interpreter.GridExecutor = ScheduledExecutor
        return self

    def __exit__(self, *exc):
        try:
            self.interpreter.GridExecutor = self.executor
            grid_idx = getattr(self.builder, "grid_idx", None)
            self.builder.__class__ = self.builder_class
            self.builder.grid_idx = grid_idx
        finally:
            self._lock.release()
        return False
