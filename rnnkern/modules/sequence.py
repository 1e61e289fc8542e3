"""The sequence modules RNN, GRU and LSTM: argument handling, packing and the
layer stack (one :func:`rnnkern.ops.run_recurrence` call per layer and direction
on the input projection of the whole sequence; one fused step for a one-step
call)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .. import auto, ops, reference
from .common import (UNSUPPORTED, _any_autocast, _autocast_dtype, _cast, _check_supported,
                     _current, _dtype_mismatch, _first_weight, _flat_weights, _fx_leaf_call,
                     _indexed_pair, _no_torch_nn_twin, _plain_weights, _promote, _RnnkernOptions,
                     _runs_torch_nn_forward, _well_formed_state)

# ------------------------------------------------------ sequence modules ----

#: Reset masks up to this many entries, on the CPU, are read on the host
#: (``_RecurrentMixin._check_resets``).
_HOST_MASK_SIZE = 256


_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack


def _ahead(ahead: Optional[list]) -> dict:
    """The ``ahead`` keyword of ops.run_recurrence where one is given: the
    plain calls keep their form."""
    return {} if ahead is None else {"ahead": ahead}


def _run_directions_at_once(calls: list) -> list:
    """A bidirectional layer's two recurrences (``(call, records)`` pairs,
    _run_layers_cast) at once, each on one of two threads
    (ops.run_concurrently).  One that records a graph node runs there below
    autograd, under no_grad (no node, no saved tensor on that thread); then
    this thread makes the nodes, one direction after the other, from the
    outputs computed (ops.recorded_ahead): the graph, the order of what is
    saved (torch.utils.checkpoint's hooks count it) and every gradient's order
    of summation are those of one direction after the other.  (Nodes made on
    the other thread would take their sequence numbers, the backward's order
    among nodes ready at once, from that thread's counter: a tensor fed by both
    directions and something else, x beside a residual path, summed its three
    gradients in another order.)"""
    ahead = [[] if records else None for _, records in calls]

    def on_thread(i: int):
        call = calls[i][0]
        if ahead[i] is None:
            return call

        def run():
            with torch.no_grad():
                return call(ahead[i])
        return run

    first = ops.run_concurrently(on_thread(0), on_thread(1))
    if ahead[0] is None and ahead[1] is None:
        return list(first)
    with ops.recorded_ahead([e for lst in ahead if lst for e in lst]):
        results = [first[i] if ahead[i] is None else calls[i][0]() for i in range(2)]
    if ahead[0] is None or ahead[1] is None or not torch.is_grad_enabled() \
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return results
    return _BackwardsAtOnce.join(results)


class _BackwardsAtOnce(torch.autograd.Function):
    """The identity on a bidirectional layer's two recurrences' outputs (out,
    h_n and c_n of each) whose backward runs the two recurrences' backward at
    once, one on each of two threads (ops.backward_recurrences_at_once), just
    before the engine calls their nodes -- one after the other, on one thread,
    where the directions ran at once in the forward (_run_directions_at_once).
    Every gradient the two nodes receive passes through here (nothing else
    reads their outputs), so it knows them all; each node's call then returns
    the result computed for its very gradient tensors (csrc/autograd.h): the
    bits, and the graph's order, of the nodes run one after the other.  Not
    with create_graph (the nodes then record their own graph), saved-tensor
    hooks (whose unpacking, torch.utils.checkpoint's recomputation included,
    belongs on the engine's thread), or where the engine will not run both
    nodes (torch.autograd.grad with inputs before one of them)."""

    @staticmethod
    def join(results: list) -> list:
        """``results``: the two directions' (out, h_n, c_n or None)."""
        joined = iter(_BackwardsAtOnce.apply(*(t for r in results for t in r if t is not None)))
        return [tuple(None if t is None else next(joined) for t in r) for r in results]

    @staticmethod
    def forward(ctx, *outputs: Tensor):
        ctx.set_materialize_grads(False)
        # Each direction's out: its node (saved, so that the graph's release
        # frees it), and the order of its outputs' gradients.
        ctx.n = len(outputs) // 2
        ctx.save_for_backward(outputs[0], outputs[ctx.n])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        heads = ctx.saved_tensors
        if not torch.is_grad_enabled() and all(torch._C._will_engine_execute_node(h.grad_fn)
                                               for h in heads):
            ops.backward_recurrences_at_once(heads[0], grads[:n], heads[1], grads[n:])
        return grads


def _on_host(mask: Tensor) -> bool:
    """Whether a mask's values are read on the host: small, on the CPU, eager."""
    return (mask.device.type == "cpu" and mask.numel() <= _HOST_MASK_SIZE
            and not torch.compiler.is_compiling() and not ops._transformed(mask))


class _Packing(NamedTuple):
    """Where each row of a packed batch lives in the time-major padded tensor."""
    time: Tensor   # [N] step of each packed row
    batch: Tensor  # [N] column of each packed row


def _packing_from_batch_sizes(batch_sizes: Tensor, rows: int, device) -> _Packing:
    """Rows of a PackedSequence (sorted by length) -> positions in [T, B]."""
    return _Packing(*reference.rows_of_batch_sizes(batch_sizes, rows, device))


def _flat_positions(packing: _Packing, B: int) -> Tensor:
    """Each packed row's position in the grid seen as [T * B, F]: rows move by
    index_select / index_copy_ on it, a row copy each, where indexing [T, B]
    with two index tensors steps element by element (the gradient's gather of a
    [100, 232, 512] grid: 6 ms against 1)."""
    return packing.time * B + packing.batch


def _rows_to_grid(rows: Tensor, packing: _Packing, T: int, B: int) -> Tensor:
    """Packed rows [N, F] -> the time-major grid [T, B, F], zeros at the padding
    (which the kernels skip but the reference recomputation behind second
    derivatives reads); on the CPU from rnnkern's buffer cache (csrc/ops.cpp's
    grid_zeros: a fresh grid's page faults were a packed call's largest
    cost).  In place into the fresh zeros (an out-of-place copy would write the
    whole grid once more: for a mostly-padding grid its largest cost), and into
    a [T * B, F] tensor that is not a view (in place on a view, autograd would
    clone the whole grid's gradient), except under torch.func transforms, whose
    batched rows cannot be written into a plain tensor."""
    F_ = rows.size(-1)
    if ops._transformed(rows):
        return rows.new_zeros((T, B, F_)).index_put((packing.time, packing.batch), rows)
    if rows.device.type == "cpu" and not torch.compiler.is_compiling():
        grid = torch.ops.rnnkern.grid_zeros(rows.detach(), (T * B, F_))
    else:
        grid = rows.new_zeros((T * B, F_))
    return grid.index_copy_(0, _flat_positions(packing, B), rows).view(T, B, F_)


class _GridToRows(torch.autograd.Function):
    """grid[time, batch] whose backward scatters into :func:`_rows_to_grid`'s
    cached zeros: indexing's own backward builds a fresh zero grid, whose page
    faults cost a packed call more than the scatter (LSTM H=128, 232 rows,
    longest 100: 7 ms of a 70 ms forward + backward).  The backward is
    itself differentiable (index_copy_), so double backward holds."""

    @staticmethod
    def forward(grid: Tensor, time: Tensor, batch: Tensor) -> Tensor:
        return _gather_rows(grid, _Packing(time, batch))

    @staticmethod
    def setup_context(ctx, inputs, output):
        grid, ctx.time, ctx.batch = inputs
        ctx.T, ctx.B = grid.size(0), grid.size(1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _rows_to_grid(grad, _Packing(ctx.time, ctx.batch), ctx.T, ctx.B), None, None


def _gather_rows(grid: Tensor, packing: _Packing) -> Tensor:
    return grid.reshape(-1, grid.size(-1)).index_select(0, _flat_positions(packing, grid.size(1)))


def _grid_to_rows(grid: Tensor, packing: _Packing) -> Tensor:
    """The packed rows of a time-major grid [T, B, F] -> [N, F]; through
    _GridToRows where its gradient will be needed on the CPU (torch.func
    transforms and forward-mode AD index directly)."""
    if ops._transformed(grid):
        return grid[packing.time, packing.batch]
    if (grid.device.type == "cpu" and grid.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        return _GridToRows.apply(grid, packing.time, packing.batch)
    return _gather_rows(grid, packing)


def _pack_by_lengths(lengths: Tensor, T: int, device):
    """The packed batch torch.nn makes of a padded one with ``lengths``
    (``pack_padded_sequence(x, lengths, enforce_sorted=False)``: the same sort
    call, so the same order; zero lengths simply contribute no rows): its
    batch_sizes, sorted_indices, and where its rows lie in the padded [T, B]."""
    sorted_lengths, sorted_indices = torch.sort(lengths, descending=True)
    batch_sizes = (sorted_lengths.unsqueeze(0) > torch.arange(T).unsqueeze(1)).sum(1)
    time, column = _packing_from_batch_sizes(batch_sizes, int(sorted_lengths.sum()), "cpu")
    return batch_sizes, sorted_indices, _Packing(time.to(device), sorted_indices[column].to(device))


def _packing_of_padded(lengths: Tensor, T: int, device) -> _Packing:
    """The rows torch.nn sees for a padded batch with ``lengths`` (_pack_by_lengths)."""
    return _pack_by_lengths(lengths, T, device)[2]


def _check_lengths(lengths, T: int, B: int, name: str) -> Tensor:
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.size(0) != B:
        raise ValueError(f"{name}: expected lengths of shape [{B}] (one per sequence), got {list(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer lengths, got {lengths.dtype}")
    lengths = lengths.to(device="cpu", dtype=torch.int64)
    # Value checks read the data: eager only (the CPU and CUDA ops check again
    # inside; under torch.compile they are the only check).
    if not torch.compiler.is_compiling() and B and (int(lengths.min()) < 0 or int(lengths.max()) > T):
        raise ValueError(f"{name}: lengths must lie in [0, {T}] (the sequence length), got "
                         f"{lengths.tolist()}")
    return lengths


def _sorting_saves_steps(lengths: Tensor) -> bool:
    """Whether a padded batch with these ``lengths`` (CPU int64) costs clearly
    more than its real steps as it stands.  Each step's products take the rows
    up to the last one still running (reference.live_rows), so the batch costs
    their sum: its real steps when sorted longest first.  Sorting (a pack) pays
    for its two copies when that sum exceeds the real steps by a tenth;
    torch.nn packs for the same reason.  Zero lengths cannot be packed."""
    n = lengths.tolist()
    if not n or min(n) < 1:
        return False
    return sum(reference.live_rows(n, max(n))) * 10 > sum(n) * 11


class _RecurrentMixin(_RnnkernOptions):
    """forward() shared by RNN, GRU, LSTM and LayerNormLSTM (the torch.nn base,
    ``nn.RNNBase`` or one of its subclasses, provides the rest)."""

    #: LayerNormLSTM: the names of each (layer, direction)'s layer-norm
    #: parameters (ln_ih_weight, ln_hh_weight, ln_cell_weight, ln_cell_bias).
    _ln_names: Optional[list] = None

    @property
    def cell(self) -> str:
        """The rnnkern cell this module runs."""
        if self.mode == "LSTM":
            return "lstm"
        if self.mode == "GRU":
            return "gru" if self.reset_after else "gru_reset_before"
        return "rnn_tanh" if self.mode == "RNN_TANH" else "rnn_relu"

    def _layer_weights(self, D: int) -> list:
        """(w_ih, w_hh, b_ih, b_hh, w_hr) of each (layer, direction): each
        weight's current attribute (torch.func.functional_call and
        parametrizations replace them), by the names torch.nn keeps in
        ``_flat_weights_names``, read once per call as torch.nn reads them
        (common._flat_weights).  Order per layer and direction: w_ih, w_hh[,
        b_ih, b_hh][, w_hr]."""
        flat = _flat_weights(self)
        n = len(flat) // (self.num_layers * D)
        groups = []
        for i in range(0, len(flat), n):
            if self.bias:
                w_ih, w_hh, b_ih, b_hh = flat[i:i + 4]
                w_hr = flat[i + 4] if n == 5 else None
            else:
                w_ih, w_hh = flat[i:i + 2]
                b_ih = b_hh = None
                w_hr = flat[i + 2] if n == 3 else None
            groups.append((w_ih, w_hh, b_ih, b_hh, w_hr))
        return groups

    def _layer_ln(self) -> list:
        """LayerNormLSTM: the ``ln`` argument of each (layer, direction)'s op,
        ``[g_ih (4H), g_hh (4H), g_c (H), beta_c (H)]``, from the parameters'
        current attributes."""
        return [torch.cat(_current(self, names)) for names in self._ln_names]

    def _run_dtype_under_autocast(self, device: torch.device, weight: Tensor) -> Optional[torch.dtype]:
        """The dtype autocast runs this call in (None: autocast is off for it).
        On CUDA, torch.nn's RNN/GRU/LSTM run cuDNN in float16 whatever the
        autocast dtype (ATen's autocast wrapper of the cuDNN RNN casts to half;
        seen on an H100: bfloat16 autocast gives float16 results): so do these,
        as drop-ins.  The LayerNorm LSTM, which torch.nn has not, uses the
        autocast dtype."""
        dtype = _autocast_dtype(device.type, weight)
        if dtype is not None and device.type == "cuda" and self._has_torch_nn_twin \
                and torch.backends.cudnn.enabled:
            return torch.float16
        return dtype

    def _torch_nn_lacks(self, lengths: Optional[Tensor], resets: Optional[Tensor]) -> Optional[str]:
        """What of this module or call torch.nn cannot run (None: it can)."""
        return (None if self._has_torch_nn_twin else "LayerNorm LSTM") \
            or ("reset_after=False" if self.cell == "gru_reset_before" else None) \
            or ("resets=" if resets is not None else None) \
            or ("lengths=" if lengths is not None else None) \
            or ("zoneout=" if self.zoneout > 0 else None)

    def _auto_choice(self, input, hx=None, lengths: Optional[Tensor] = None,
                     resets: Optional[Tensor] = None) -> auto.Choice:
        """What ``backend="auto"`` runs for this call, and why (rnnkern/auto.py):
        torch.nn's forward (the base class's) or rnnkern's kernels.

        The module keeps its last choice with what the call brought to it
        (``key``: the input's shape, dtype, device and requires_grad, the
        weights' dtype and requires_grad, grad mode, thread count, whether
        lengths= and resets= came, the table and CPU-class functions), and
        reuses it while that is the same: a one-step call in a loop (an RL
        rollout) paid 8-25 us for the choice, up to a fifth of the call (Zen 3,
        LSTM B=1).  The module's own options drop it when set (__setattr__).
        Each read costs ~0.3 us inside a one-step forward (cold caches after
        the kernel), so the key is built inline, of as few reads as that.  Not
        kept: calls under autocast, torch.compile, forward-mode AD or torch.func."""
        key = None
        if not (torch.compiler.is_compiling() or _any_autocast()
                or _peek_interpreter_stack() is not None or forward_ad._current_level >= 0):
            if isinstance(input, Tensor):
                data, size = input, input.shape
            elif isinstance(input, PackedSequence):
                data = input.data
                steps = input.batch_sizes.numel()  # (T and B: the rows' total is no size of the call)
                size = (steps, int(input.batch_sizes[0]) if steps else 0, data.size(-1))
            else:
                data = None
            if data is not None:
                weight = _first_weight(self)
                key = (size, data.dtype, data.device, data.requires_grad, weight.dtype,
                       weight.requires_grad, torch.is_grad_enabled(), torch.get_num_threads(),
                       lengths is None, resets is None, auto.table, auto._this_cpu_class)
                kept = self.__dict__.get("_auto_kept")
                if kept is not None and kept[0] == key:
                    return kept[1]
        choice = self._choose_afresh(input, hx, lengths, resets)
        if key is not None:
            # (In the instance's __dict__, not through nn.Module.__setattr__;
            # __getstate__ leaves it out of pickles and copies.)
            self.__dict__["_auto_kept"] = (key, choice)
        return choice

    def __setattr__(self, name, value):
        # An option or parameter set anew (zoneout, batch_first, a weight, ...)
        # may change auto's choice: the kept one goes.
        self.__dict__.pop("_auto_kept", None)
        super().__setattr__(name, value)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_auto_kept", None)
        return state

    def _choose_afresh(self, input, hx, lengths: Optional[Tensor],
                       resets: Optional[Tensor]) -> auto.Choice:
        """``_auto_choice`` without the memo."""
        data = input.data if isinstance(input, PackedSequence) else input
        if torch.compiler.is_compiling():
            return auto.Choice(ops.resolve_backend("auto", data.device),
                               "torch.compile captures rnnkern's ops")
        parts = () if hx is None else (hx if isinstance(hx, (tuple, list)) else (hx,))
        if ops._transformed(data, *parts):
            return auto.Choice(ops.resolve_backend("auto", data.device),
                               "forward-mode AD and torch.func transforms run rnnkern's "
                               "reference formulation (torch.nn's modules do not batch)")
        lacks = self._torch_nn_lacks(lengths, resets)
        weight = _first_weight(self)
        device = data.device
        backend = ops.resolve_backend("auto", device)
        autocast = _any_autocast()
        dtype = (self._run_dtype_under_autocast(device, weight) if autocast else None) or data.dtype
        if isinstance(input, PackedSequence):
            T, B = input.batch_sizes.numel(), int(input.batch_sizes[0]) if input.batch_sizes.numel() else 0
        elif data.dim() == 3:
            T, B = (data.size(1), data.size(0)) if self.batch_first else (data.size(0), data.size(1))
        else:
            T, B = data.size(0), 1
        training = torch.is_grad_enabled() and (data.requires_grad or weight.requires_grad)
        return auto.choose(cell=self.cell, device=device, dtype=dtype, B=B, H=self.hidden_size,
                           T=T, training=training, torch_lacks=lacks, rnnkern_backend=backend,
                           proj_size=self.proj_size, directions=2 if self.bidirectional else 1)

    def _zoneout_width(self) -> int:
        """Units of a zoneout mask row: h's (P) then c's (H) for LSTMs, H otherwise."""
        if self.mode != "LSTM":
            return self.hidden_size
        return (self.proj_size or self.hidden_size) + self.hidden_size

    # ---- the layer stack

    def _run_layers(self, x: Tensor, hx, lengths: Optional[Tensor], packing: Optional[_Packing],
                    resets: Optional[Tensor] = None, reset_state=None,
                    reset_is_hx: bool = False, backend: Optional[str] = None,
                    cell_steps: bool = False, x_rows: Optional[Tensor] = None):
        """x [T, B, I] time-major, hx: (h0[, c0]) of shape [L*D, B, *], lengths [B]
        or None, resets [T, B] bool (checked) or None, reset_state like hx (checked)
        or None (zeros; ``reset_is_hx``: hx is those zeros, so the kernels' own
        rule, restarting from h0, is the modules') -> output [T, B, D*P],
        (h_n[, c_n]).  On the CPU backend x may be the rows of a packed batch
        [N, I] instead, lengths sorted longest first (_forward_packed): the
        output is then [N, D*P] likewise.  ``packing``
        (variable lengths only) says which rows torch.nn would see packed:
        dropout draws its mask over them, in that order, as torch.nn does.
        ``backend``: the backend to run (default the module's; ``auto``'s choice).
        ``cell_steps`` (one-layer, one-direction LSTM without projection; for
        rnnkern.integrations.torchrl): c_n is then the cell state after every
        step, [1, T, B, H] (the op's cell_steps).  ``x_rows``: x's packed rows
        (``x[packing.time, packing.batch]``, a PackedSequence's data) where the
        caller has them: the first layer's projection over the real rows reads
        them instead of gathering them back from the grid."""
        dtype = None
        if _any_autocast():
            dtype = self._run_dtype_under_autocast(x.device, _first_weight(self))
        if dtype is not None:
            # Every tensor below is cast to dtype explicitly, and autocast is off
            # while they run: it would recast the input projection (a linear) to
            # its own dtype, which differs from dtype on CUDA (bfloat16 autocast,
            # float16 run) and would then meet float16 weights in the kernels.
            with torch.autocast(x.device.type, enabled=False):
                return self._run_layers_cast(dtype, x, hx, lengths, packing, resets, reset_state,
                                             reset_is_hx, backend, cell_steps, x_rows)
        return self._run_layers_cast(None, x, hx, lengths, packing, resets, reset_state, reset_is_hx,
                                     backend, cell_steps, x_rows)

    def _run_layers_cast(self, dtype: Optional[torch.dtype], x: Tensor, hx,
                         lengths: Optional[Tensor], packing: Optional[_Packing],
                         resets: Optional[Tensor], reset_state, reset_is_hx: bool,
                         backend: Optional[str] = None, cell_steps: bool = False,
                         x_rows: Optional[Tensor] = None):
        """:meth:`_run_layers` in ``dtype`` (None: the tensors' own), autocast off."""
        lstm = self.mode == "LSTM"
        D = 2 if self.bidirectional else 1
        if cell_steps and not (self.cell == "lstm" and self.num_layers == 1 and D == 1
                               and self.proj_size == 0):
            raise ValueError(f"{type(self).__name__}: cell_steps needs a one-layer, "
                             f"one-direction LSTM without projection")
        backend = ops.resolve_backend(backend or self.backend, x.device)
        name = type(self).__name__
        weights = self._layer_weights(D)
        cell = self.cell
        lns = self._layer_ln() if cell == "lstm_ln" else None
        packed = lengths is not None
        result_dtypes = None
        if dtype is not None:
            result_dtypes = self._autocast_result_dtypes(x, hx, dtype, packed)
            x, hx = x.to(dtype), tuple(h.to(dtype) for h in hx)
            x_rows = None if x_rows is None else x_rows.to(dtype)
            if reset_state is not None:
                reset_state = tuple(h.to(dtype) for h in reset_state)
            weights = [tuple(_cast(w, dtype) for w in ws) for ws in weights]
            if lns is not None:
                lns = [ln.to(dtype) for ln in lns]
        p = self.zoneout
        _check_supported(name, backend, cell, x.dtype, proj=self.proj_size > 0, lengths=packed,
                         resets=resets is not None, zoneout=p > 0)
        h0 = hx[0]
        c0 = hx[1] if lstm else None
        # The state a reset step starts from: reset_state, else zeros -- which,
        # without hx, are h0's very tensors (the op's own rule then: a reset
        # restarts from h0).
        if reset_state is None and resets is not None and not reset_is_hx:
            reset_state = tuple(torch.zeros_like(h) for h in hx)
        r0 = None if reset_state is None else reset_state[0]
        rc0 = reset_state[1] if lstm and reset_state is not None else None
        # One step (a streaming or token-by-token call): the fused step op, x W_ih^T
        # inside, instead of an input projection and a recurrence of one step --
        # one op call instead of two, which is most of such a call's cost.
        if x.size(0) == 1 and not packed and not p and self.proj_size == 0 and not cell_steps:
            x, hidden = self._one_step_layers(backend, x, h0, c0, weights, lns, D,
                                              None if reset_is_hx else resets, r0, rc0)
            if result_dtypes is not None:
                x = x.to(result_dtypes[0])
                hidden = tuple(h.to(dt) for h, dt in zip(hidden, result_dtypes[1:]))
            return x, hidden
        # Per direction, the resets the op sees: a boundary before position t+1
        # makes the reverse direction's step at t start afresh (not at a row's
        # last position: the boundary there lies past its end).
        step_resets = (resets, None)
        if resets is not None and D == 2:
            rev = torch.cat((resets[1:], resets.new_zeros((1, resets.size(1)))))
            if lengths is not None:
                nxt = torch.arange(1, rev.size(0) + 1, device=rev.device).unsqueeze(1)
                rev = rev & (nxt < lengths.to(rev.device).unsqueeze(0))
            step_resets = (resets, rev)
        zoneout = None
        if p:
            T, B = x.size(0), x.size(1)
            Z = self._zoneout_width()
            if not self.training:  # the expectation: one [Z] vector, broadcast
                zoneout = torch.full((Z,), p, dtype=x.dtype, device=x.device).expand(T, B, Z)
        steps = {"cell_steps": True} if cell_steps else {}  # (the plain calls keep their form)
        at_once = D == 2 and self._directions_at_once(backend, x, hx, weights, reset_state, lns)

        # A plain float32 inference call: each layer's projection inside its
        # recurrence (ops.run_recurrence_from_input).
        from_input = (not packed and not p and resets is None and lns is None and not cell_steps
                      and self.proj_size == 0
                      and ops.from_input_applies(backend, cell, x, h0, c0, weights))

        def recurrence(layer: int, d: int, x: Tensor, zoneout: Optional[Tensor]):
            """A direction's recurrence as a call, with whether it records a
            graph node; its inputs made here, on this thread: the projection
            and the states' rows."""
            idx = layer * D + d
            w_ih, w_hh, b_ih, b_hh, w_hr = weights[idx]
            h, c = h0[idx], c0[idx] if lstm else None
            if from_input:  # (inference)
                return (lambda: ops.run_recurrence_from_input(cell, x, w_ih, h, c, w_hh, b_ih, b_hh,
                                                              d == 1)), False
            xproj = self._input_projection(x, w_ih, backend, packing, x_rows if layer == 0 else None)
            ln = None if lns is None else lns[idx]
            if step_resets[d] is None or reset_is_hx:
                r = rc = None

                def call(ahead: Optional[list] = None):
                    return ops.run_recurrence(backend, cell, xproj, h, c, w_hh, b_ih, b_hh, w_hr,
                                              lengths, d == 1, step_resets[d], zoneout, ln,
                                              **steps, **_ahead(ahead))
            else:
                r, rc = r0[idx], rc0[idx] if lstm else None

                def call(ahead: Optional[list] = None):
                    return ops.run_recurrence_with_reset_state(
                        backend, cell, xproj, h, c, w_hh, b_ih, b_hh, w_hr, lengths, d == 1,
                        step_resets[d], zoneout, ln, r, rc, **steps, **_ahead(ahead))
            return call, ops._needs_grad(xproj, h, c, w_hh, b_ih, b_hh, w_hr, ln, r, rc)

        h_n, c_n = [], []
        for layer in range(self.num_layers):
            masks = [zoneout] * D
            if p and self.training:  # a fresh Bernoulli mask per layer and direction, in order
                masks = [x.new_empty((T, B, Z)).bernoulli_(p) for _ in range(D)]
            if at_once:
                results = _run_directions_at_once([recurrence(layer, d, x, masks[d])
                                                   for d in range(D)])
            else:
                results = [recurrence(layer, d, x, masks[d])[0]() for d in range(D)]
            outputs = []
            for out, h, c in results:
                outputs.append(out)
                h_n.append(h)
                if lstm:
                    c_n.append(c)
            x = torch.cat(outputs, dim=-1) if D == 2 else outputs[0]
            if self.dropout > 0 and self.training and layer + 1 < self.num_layers:
                x = self._dropout(x, packing)
        stack = torch.stack if len(h_n) > 1 else (lambda hs: hs[0].unsqueeze(0))
        hidden = (stack(h_n), stack(c_n)) if lstm else (stack(h_n),)
        if result_dtypes is not None:
            x = x.to(result_dtypes[0])
            hidden = tuple(h.to(dt) for h, dt in zip(hidden, result_dtypes[1:]))
        return x, hidden

    def _directions_at_once(self, backend: str, x: Tensor, hx, weights, reset_state, lns=None) -> bool:
        """Whether a bidirectional layer runs its two directions at once
        (ops.run_concurrently, each direction on one thread): on the CPU
        backend, where that uses the threads better than one direction after
        the other -- two threads, or a recurrence that would run on one thread
        anyway (a small batch: ops.cpu_recurrence_threads) -- with work enough
        per direction; in inference, and in training (their kernels at once,
        their graph nodes made afterwards on this thread:
        _run_directions_at_once; and their backward at once, _BackwardsAtOnce);
        eagerly (no compile, trace,
        torch.func transform, forward-mode AD or Python mode: they keep state
        of their own per thread, or would see the two directions' ops
        interleaved).  The same bits either way."""
        if backend != "cpu" or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return False
        threads = torch.get_num_threads()
        if threads < 2:
            return False
        tensors = [x, *hx, *(w for ws in weights for w in ws if w is not None),
                   *(reset_state or ()), *(lns or ())]
        if _peek_interpreter_stack() is not None or forward_ad._current_level >= 0 \
                or torch._C._is_torch_function_mode_enabled() \
                or torch._C._len_torch_dispatch_stack() > 0 \
                or any(type(t) is not Tensor and type(t) is not nn.Parameter for t in tensors):
            return False
        rows = x.size(0) if x.dim() == 2 else x.size(0) * x.size(1)  # (packed rows: [N, I])
        B, H, P = hx[0].size(1), self.hidden_size, self.proj_size or self.hidden_size
        if not ops.concurrent_directions_pay(rows, reference._GATES[self.cell], H, P):
            return False
        return threads == 2 or ops.cpu_recurrence_threads(self.cell, B, H, P, x.element_size()) == 1

    def _one_step_forward(self, input: Tensor, hx, backend: str, resets: Optional[Tensor] = None):
        """The forward of the commonest one-step call (streaming inference, an
        RL rollout's action step) as one op, or None for any other call: the
        full forward then runs it, or raises its error.  The call: batched input
        of one step, hx None or of the right shapes and the input's dtype, the
        input of the weights' dtype, no option torch.nn lacks (zoneout,
        LayerNorm) and no projection, no dropout to draw, eager, without
        autocast, forward-mode AD or torch.func; ``resets`` None or a
        well-formed mask that restarts from zeros (_one_step_restart).  Then
        nothing of the full forward's set-up changes the result, and its Python
        (checks, layouts, the layer loop: ~30 us, against a 5 us op for a small
        RNN on a Zen 3 core) would make the call as slow as torch.nn's.  The
        same op and bits as the full forward's one-step path (_one_step_layers)."""
        shape = input.shape
        batch_first = self.batch_first
        if len(shape) != 3 or shape[1 if batch_first else 0] != 1 or shape[2] != self.input_size \
                or self.zoneout or self.proj_size or self._ln_names is not None:
            return None
        L = self.num_layers
        if (self.dropout and self.training and L > 1) or torch.compiler.is_compiling() \
                or _any_autocast() or _peek_interpreter_stack() is not None \
                or forward_ad._current_level >= 0:
            return None
        # (Weights that are not plain parameters go to the full forward, which
        # reads them as torch.nn does: read here too, they would be read twice.)
        flat = _plain_weights(self)
        dtype = input.dtype
        if flat is None or flat[0].dtype != dtype:
            return None
        state = (L * 2 if self.bidirectional else L, shape[0 if batch_first else 1], self.hidden_size)
        lstm = self.mode == "LSTM"
        if hx is None:
            h0 = input.new_zeros(state)
            c0 = input.new_zeros(state) if lstm else None
        else:
            parts = _well_formed_state(hx, lstm, state, dtype)
            if parts is None:
                return None
            h0, c0 = parts
        if resets is not None:
            restart = self._one_step_restart(resets, state[1], input)
            if restart is False:
                return None
            if restart is not None and hx is not None:  # (from None: zeros already)
                h0 = torch.where(restart, 0.0, h0)
                c0 = torch.where(restart, 0.0, c0) if lstm else None
        if input.is_cpu and (backend == "cpu" or backend == "auto"):
            backend = "cpu"  # (resolve_backend's common case, without building input.device)
        else:
            backend = ops.resolve_backend(backend, input.device)
            if backend == "reference":
                return None
        if UNSUPPORTED[backend]:  # (a backend lacking an option: the full forward checks it)
            return None
        out, h_n, c_n = ops.run_layers_step(backend, self.cell, input, h0, c0, flat, L,
                                            self.bidirectional, batch_first)
        return out, ((h_n, c_n) if lstm else h_n)

    def _from_input_forward(self, input: Tensor, hx, backend: str):
        """The forward of a plain inference call of a one-direction stack in
        float32 on the CPU -- what rnnkern::recurrence_from_input runs
        (ops.from_input_applies) -- as that op layer after layer, or None for
        any other call: the full forward then runs it, or raises its error.
        The call: batched input of more than one step, hx None or well formed
        (common._well_formed_state) on the CPU, no option torch.nn lacks and no
        projection, no dropout to draw, eager, without autocast, forward-mode
        AD or torch.func, nothing that needs a gradient.  The full forward's
        Python (checks, layouts, the layer loop: ~30 us on a Zen 4 core) was as
        long as the op itself for a streaming chunk (LSTM H=64, 8 steps: 48 us
        a call against the op's 20).  The same ops on the same tensors as the
        full forward's from_input path (_run_layers_cast), so the same bits."""
        shape = input.shape
        if len(shape) != 3 or self.bidirectional or shape[2] != self.input_size \
                or self.zoneout or self.proj_size or self._ln_names is not None:
            return None
        batch_first = self.batch_first
        L = self.num_layers
        if shape[1 if batch_first else 0] < 2 or shape[0 if batch_first else 1] < 1 \
                or shape[2] < 1 or input.dtype != torch.float32 or not input.is_cpu \
                or (backend != "cpu" and backend != "auto") \
                or (self.dropout and self.training and L > 1) or _any_autocast():
            return None
        flat = _plain_weights(self)
        if flat is None or flat[0].dtype != torch.float32 or not flat[0].is_cpu:
            return None
        B, H = shape[0 if batch_first else 1], self.hidden_size
        lstm = self.mode == "LSTM"
        if hx is None:
            # One block of zeros for every layer's h0 and c0 (the op only reads them).
            zeros = input.new_zeros((B, H))
            h0 = c0 = None
        else:
            parts = _well_formed_state(hx, lstm, (L, B, H), torch.float32)
            if parts is None or not parts[0].is_cpu or (lstm and not parts[1].is_cpu):
                return None
            zeros = None
            h0, c0 = parts
        if not ops.from_input_applies("cpu", self.cell, input, h0 if zeros is None else zeros,
                                      c0, (flat,)):
            return None
        x = input.transpose(0, 1) if batch_first else input
        n = len(flat) // L  # (w_ih, w_hh[, b_ih, b_hh]) per layer
        h_n, c_n = [], []
        for layer in range(L):
            w = flat[layer * n:(layer + 1) * n]
            if zeros is None:
                h0_l, c0_l = h0[layer], (c0[layer] if lstm else None)
            else:
                h0_l, c0_l = zeros, (zeros if lstm else None)
            x, h, c = ops.run_recurrence_from_input(
                self.cell, x, w[0], h0_l, c0_l, w[1],
                w[2] if n == 4 else None, w[3] if n == 4 else None, False)
            h_n.append(h)
            c_n.append(c)
        stack = torch.stack if L > 1 else (lambda hs: hs[0].unsqueeze(0))
        out = x.transpose(0, 1) if batch_first else x
        return out, ((stack(h_n), stack(c_n)) if lstm else stack(h_n))

    def _one_step_restart(self, resets, B: int, input: Tensor):
        """For _one_step_forward, a one-step call's ``resets`` (the reset state
        zeros): the rows that restart, as a [1, B, 1] bool mask over the state;
        None where no row does (the plain call); False where the full forward
        must take the call (it checks the mask and raises, or reads it on the
        device): anything but a small CPU mask of CPU input, bool, uint8 or
        floating, shaped [1, B] ([B, 1] with batch_first) with or without a
        trailing 1, holding 0 and 1; and bidirectional modules, whose reverse
        direction keeps hx at its start.  What an RL rollout's action step
        brings (sb3-contrib's float ``episode_starts``): its full forward cost
        twice the plain call's (_check_resets, the layer loop in Python)."""
        # (_on_host's test, less what _one_step_forward has ruled out: compile, torch.func.)
        if not isinstance(resets, Tensor) or self.bidirectional or not input.is_cpu \
                or not resets.is_cpu or resets.numel() > _HOST_MASK_SIZE:
            return False
        dtype = resets.dtype
        if not (dtype == torch.bool or dtype == torch.uint8 or dtype.is_floating_point):
            return False
        want = (B, 1) if self.batch_first else (1, B)
        if resets.shape != want and resets.shape != want + (1,):
            return False
        values = resets.reshape(-1).tolist()
        if not set(values) <= {0, 1}:
            return False
        if not any(values):
            return None
        restart = resets.reshape(1, B, 1)
        return restart if dtype == torch.bool else restart.bool()  # (0 and 1 only: != 0)

    def _one_step_layers(self, backend: str, x: Tensor, h0: Tensor, c0: Optional[Tensor],
                         weights: list, lns: Optional[list], D: int, resets: Optional[Tensor],
                         r0: Optional[Tensor], rc0: Optional[Tensor]):
        """:meth:`_run_layers_cast` for x of one step [1, B, I]: the layers and
        directions by the fused step op.  ``resets`` [1, B] (None: no reset, or
        hx is the reset state) makes the forward direction start from the reset
        state (r0, rc0) in the rows it marks."""
        cell = self.cell
        lstm = c0 is not None
        dropout = self.dropout > 0 and self.training and self.num_layers > 1
        if resets is None and lns is None and not dropout and backend != "reference":
            flat = [w for ws in weights for w in ws[:4] if w is not None]
            if not ops._transformed(x, h0, c0, *flat):
                out, h_n, c_n = ops.run_layers_step(backend, cell, x, h0, c0, flat,
                                                    self.num_layers, D == 2, False)
                return out, ((h_n, c_n) if lstm else (h_n,))
        # Resets, LayerNorm gains or dropout between the layers; the reference
        # and torch.func's transforms: the layers step by step here.
        restart = None if resets is None else resets[0].unsqueeze(1)
        h_n, c_n = [], []
        x = x[0]
        for layer in range(self.num_layers):
            outputs = []
            for d in range(D):
                idx = layer * D + d
                w_ih, w_hh, b_ih, b_hh, _ = weights[idx]
                h_in, c_in = h0[idx], c0[idx] if lstm else None
                if restart is not None and d == 0:
                    h_in = torch.where(restart, r0[idx], h_in)
                    c_in = torch.where(restart, rc0[idx], c_in) if lstm else None
                h, c = ops.run_step(backend, cell, x, h_in, c_in, w_ih, w_hh, b_ih, b_hh,
                                    None if lns is None else lns[idx])
                outputs.append(h)
                h_n.append(h)
                if lstm:
                    c_n.append(c)
            x = torch.cat(outputs, dim=-1) if D == 2 else outputs[0]
            if dropout and layer + 1 < self.num_layers:
                x = self._dropout(x, None)
        out = x.unsqueeze(0)
        if len(h_n) == 1:
            # h_n apart from the output, as on every other path (an in-place
            # edit of one must not show in the other)
            hidden = (out.clone(), c_n[0].unsqueeze(0)) if lstm else (out.clone(),)
        else:
            hidden = (torch.stack(h_n), torch.stack(c_n)) if lstm else (torch.stack(h_n),)
        return out, hidden

    @staticmethod
    def _input_projection(x: Tensor, w_ih: Tensor, backend: str, packing: Optional[_Packing],
                          x_rows: Optional[Tensor] = None) -> Tensor:
        """``x W_ih^T`` for every position of the [T, B] grid the kernels read: with
        variable lengths and more than a fifth of the grid padding (a packed batch
        of a few long and many short sequences), over the real rows alone, scattered
        into a zero grid, so that the projection and its gradients cost the real
        steps, as the kernels' steps do (they skip finished rows).  ``x_rows``: the
        real rows of x where the caller has them (else gathered from x)."""
        if x.dim() == 2:  # packed rows (_run_layers)
            return ops.input_projection(x.unsqueeze(0), w_ih, backend).squeeze(0)
        T, B = x.size(0), x.size(1)
        # (Not under torch.compile: the real rows' count is data-dependent there.)
        if packing is None or torch.compiler.is_compiling() or packing.time.numel() * 5 >= T * B * 4:
            return ops.input_projection(x, w_ih, backend)
        # squeeze, not [0]: indexing's backward would build a zero [1, N, G*H]
        # to copy the gradient into.
        if x_rows is None:
            x_rows = _grid_to_rows(x, packing)
        rows = ops.input_projection(x_rows.unsqueeze(0), w_ih, backend).squeeze(0)
        return _rows_to_grid(rows, packing, T, B)

    def _dropout(self, x: Tensor, packing: Optional[_Packing]) -> Tensor:
        """Dropout between layers with torch.nn's RNG use: one mask over the
        layer's output, drawn over the packed rows when lengths vary (torch.nn
        drops out PackedSequence.data), so a seeded run draws the same masks."""
        if packing is None:
            return F.dropout(x, self.dropout, training=True)
        rows = F.dropout(_grid_to_rows(x, packing), self.dropout, training=True)
        return _rows_to_grid(rows, packing, x.size(0), x.size(1))

    def _autocast_result_dtypes(self, x: Tensor, hx, dtype: torch.dtype, packed: bool):
        """The dtypes returned under autocast for (output, h_n[, c_n]): rnnkern's
        rule (docs/modules.md, "torch.autocast"), the same on every CPU.

        On CUDA, torch.nn runs cuDNN wholly in the autocast dtype.  On the CPU,
        torch.nn's ATen path autocasts only its matrix products, and a float32
        state mixed into the pointwise math promotes the result: RNN stays in the
        autocast dtype; GRU follows h0; a packed or projected LSTM's c follows c0
        and h follows c (or stays in the autocast dtype with a projection, whose
        product is autocast).  An unpacked LSTM without projection returns the
        autocast dtype, as torch.nn's oneDNN path does where the CPU supports it
        (with AVX-512; elsewhere torch.nn's result depends on the input)."""
        if x.device.type != "cpu" or self.mode in ("RNN_TANH", "RNN_RELU"):
            return (dtype,) * (1 + len(hx))
        if self.mode == "GRU":
            h = _promote(dtype, hx[0].dtype)
            return h, h
        if not packed and self.proj_size == 0:
            return dtype, dtype, dtype
        c = _promote(dtype, hx[1].dtype)
        h = dtype if self.proj_size > 0 else c
        return h, h, c

    # ---- argument handling

    def _state_sizes(self):
        D = 2 if self.bidirectional else 1
        P = self.proj_size if self.proj_size > 0 else self.hidden_size
        return self.num_layers * D, P

    def _zeros_hidden(self, batch: int, like: Tensor):
        LD, P = self._state_sizes()
        h = torch.zeros(LD, batch, P, dtype=like.dtype, device=like.device)
        if self.mode != "LSTM":
            return (h,)
        return (h, torch.zeros(LD, batch, self.hidden_size, dtype=like.dtype, device=like.device))

    def _as_torch_nn_indexes(self, hx, makes_pair: bool):
        """An LSTM's hx as torch.nn's forward indexes it (hx[0], hx[1]) before
        aten sees it: an IndexError where there is no second state; where
        torch.nn makes its own pair of it (``makes_pair``: an unbatched call, a
        PackedSequence with a permutation) a stacked [2, L*D, ...] tensor works,
        as does a longer tuple (its first two states), and code relying on it
        must keep working; a batched tensor's states must be 3-D
        (RuntimeError), then aten refuses the tensor itself (TypeError, in
        _hx_parts).  torch.nn's exception types, messages saying what was
        expected."""
        if self.mode != "LSTM" or not isinstance(hx, (Tensor, tuple, list)):
            return hx
        pair = _indexed_pair(hx, type(self).__name__, "(h_0, c_0)")
        if makes_pair:
            return pair
        if isinstance(hx, Tensor) and hx.dim() != 4:
            raise RuntimeError(f"For batched 3-D input, hx and cx should also be 3-D but got "
                               f"({hx.dim() - 1}-D, {hx.dim() - 1}-D) tensors")
        return hx

    def _hx_parts(self, hx) -> tuple:
        """hx as a tuple of tensors, its type checked."""
        name = type(self).__name__
        if self.mode == "LSTM":
            if not isinstance(hx, (tuple, list)):  # (torch.nn: an IndexError from indexing it)
                raise TypeError(f"{name}: hx must be a tuple (h_0, c_0) of two tensors, got "
                                f"{type(hx).__name__}")
            if len(hx) != 2:  # torch.nn: aten's RuntimeError (or an IndexError for one)
                raise RuntimeError(f"{name}: lstm expects two hidden states: hx must be a tuple "
                                   f"(h_0, c_0) of two tensors, got {len(hx)}")
            parts = tuple(hx)
        else:
            parts = (hx,)
        for i, h in enumerate(parts):
            if not isinstance(h, Tensor):
                label = f"hx[{i}]" if self.mode == "LSTM" else "hx"
                raise TypeError(f"{name}: {label} must be a Tensor, got {type(h).__name__}")
        return parts

    def _check_hidden(self, parts, batch: int, input: Tensor) -> None:
        """torch.nn's hidden-state checks (same messages), plus the dtype."""
        LD, P = self._state_sizes()
        if self.mode == "LSTM":
            self.check_hidden_size(parts[0], (LD, batch, P), "Expected hidden[0] size {}, got {}")
            self.check_hidden_size(parts[1], (LD, batch, self.hidden_size),
                                   "Expected hidden[1] size {}, got {}")
        else:
            self.check_hidden_size(parts[0], (LD, batch, P))
        if not _any_autocast():
            for i, h in enumerate(parts):
                if h.dtype != input.dtype:
                    label = f"hx[{i}]" if self.mode == "LSTM" else "hx"
                    raise _dtype_mismatch(type(self).__name__, label, h.dtype, "input", input.dtype)

    def _reset_parts(self, reset_state, B: int, batched: bool, input: Tensor) -> tuple:
        """``reset_state`` as (h[, c]) of shape [L*D, B, *], checked as hx is (the
        same form: a tensor, or (h, c) for the LSTMs), errors naming it."""
        name = type(self).__name__
        LD, P = self._state_sizes()
        lstm = self.mode == "LSTM"
        if lstm and (not isinstance(reset_state, (tuple, list)) or len(reset_state) != 2):
            raise TypeError(f"{name}: reset_state must be a tuple (h, c) of two tensors, like hx; "
                            f"got {type(reset_state).__name__}")
        parts = tuple(reset_state) if lstm else (reset_state,)
        widths = (P, self.hidden_size) if lstm else (P,)
        for i, (h, width) in enumerate(zip(parts, widths)):
            label = f"reset_state[{i}]" if lstm else "reset_state"
            if not isinstance(h, Tensor):
                raise TypeError(f"{name}: {label} must be a Tensor, got {type(h).__name__}")
            want = [LD, B, width] if batched else [LD, width]
            if list(h.shape) != want:
                raise ValueError(f"{name}: expected {label} of shape {want} (hx's), got "
                                 f"{list(h.shape)}")
            if h.device != input.device:
                raise ValueError(f"{name}: expected {label} on {input.device} (the input's "
                                 f"device), got {h.device}")
            if not _any_autocast() and h.dtype != input.dtype:
                raise _dtype_mismatch(name, label, h.dtype, "input", input.dtype)
        return parts if batched else tuple(h.unsqueeze(1) for h in parts)

    # ---- forward

    def _check_resets(self, resets, T: int, B: int, batched: bool, device,
                      keep_empty: bool = True) -> Optional[Tensor]:
        """``resets`` as the ops take it: [T, B] bool, time-major, contiguous, on
        the input's device; None where it resets nothing and ``keep_empty`` is
        False (known on the host only: see below).  Accepted as RL libraries
        keep their episode starts: bool, uint8 or floating 0/1 (sb3-contrib's ``episode_starts`` are float),
        laid out [T, B], [B, T] with batch_first, [T] for unbatched input, each
        also with a trailing 1 (torchrl's ``is_init`` is [B, T, 1]).  Errors name
        the argument and what was expected."""
        name = type(self).__name__
        if not batched:
            layout, shape = "[T]", [T]
        elif self.batch_first:
            layout, shape = "[B, T] (batch_first)", [B, T]
        else:
            layout, shape = "[T, B]", [T, B]
        if not isinstance(resets, Tensor):
            raise TypeError(f"{name}: expected resets to be a Tensor of shape {layout} = "
                            f"{shape} (or with a trailing 1), got {type(resets).__name__}")
        if list(resets.shape) not in (shape, shape + [1]):
            raise ValueError(f"{name}: expected resets of shape {layout} = {shape} (or "
                             f"{shape + [1]}), got {list(resets.shape)}")
        if not (resets.dtype in (torch.bool, torch.uint8) or resets.dtype.is_floating_point):
            raise TypeError(f"{name}: expected resets of dtype torch.bool, torch.uint8 or a "
                            f"floating dtype holding 0 and 1, got {resets.dtype}")
        if resets.device != device:
            raise ValueError(f"{name}: expected resets on {device} (the input's device), got "
                             f"{resets.device}")
        if list(resets.shape) != shape:
            resets = resets.squeeze(-1)
        # A value other than 0 and 1 is not a mask (a probability, a count):
        # refused rather than read as "nonzero".  The check reads the data, so
        # eager only (as the lengths check).  A small mask on the CPU (an RL
        # rollout's step: one row per environment) is read on the host, where
        # the tensor ops of the check cost more than the step itself (17 of ~100
        # us).  One that resets nothing is then dropped where the reset state is
        # zeros (``keep_empty`` False): the call without resets, one op and no
        # masked start (an RL rollout's step without a new episode: 44 against
        # 82 us, LSTM B=1 H=64).  No backend needs to support an option that
        # does nothing.
        if _on_host(resets):
            values = resets.reshape(-1).tolist()
            if not set(values) <= {0, 1}:
                bad = next(v for v in values if v != 0 and v != 1)
                raise ValueError(f"{name}: resets must hold only 0 and 1 (a {resets.dtype} mask), "
                                 f"got {bad}")
            if not keep_empty and not any(values):
                return None
        elif resets.dtype != torch.bool and not torch.compiler.is_compiling() \
                and bool(((resets != 0) & (resets != 1)).any()):
            bad = resets[(resets != 0) & (resets != 1)][0].item()
            raise ValueError(f"{name}: resets must hold only 0 and 1 (a {resets.dtype} mask), "
                             f"got {bad}")
        if resets.dtype != torch.bool:
            resets = resets != 0
        if not batched:
            return resets.unsqueeze(1)
        return resets.t().contiguous() if self.batch_first else resets.contiguous()

    def forward(self, input, hx=None, *unset, lengths: Optional[Tensor] = None,
                resets: Optional[Tensor] = None, reset_state=None):
        """As torch.nn's forward.  ``lengths`` ([B] integers) marks the valid steps
        of each sequence of a padded batch: later steps leave the state alone and
        output zeros, and the reverse direction starts at each sequence's end --
        what torch.nn computes on ``pack_padded_sequence(input, lengths,
        enforce_sorted=False)``, without packing.

        ``resets`` (a bool, uint8 or 0/1 float mask; [T, B], [B, T] with
        batch_first, [T] for unbatched input, each with or without a trailing 1;
        for a PackedSequence the padded [T, B] / [B, T] in the original batch
        order): where ``resets[t, b]``, the state entering the step at position t
        of sequence b is the reset state's row b -- ``reset_state`` (the form of
        hx; it may require grad: a learned initial state), zeros without it --
        h and c, in every layer, at every position including 0 (where it
        replaces hx), as RL libraries mask their state with ``(1 - start)``.  hx
        stays the state entering position 0.  A reverse direction restarts at
        the step before each boundary, so the episodes on either side of it
        never see each other."""
        # ``unset``: torch's TorchScript-based ONNX exporter (torch.onnx.export,
        # dynamo=False) calls a bare module's forward with every parameter its
        # signature has a default for, keyword-only ones included, as
        # positional arguments (_decide_input_format): here forward(input,
        # None, None, None, None).  Those trailing Nones are taken; anything
        # else past hx is refused as Python refuses it for torch.nn's forward.
        if any(u is not None for u in unset):
            raise TypeError(f"{type(self).__name__}.forward() takes from 2 to 3 positional arguments "
                            f"but {3 + len(unset)} were given")
        if _runs_torch_nn_forward():
            if reset_state is not None:
                raise _no_torch_nn_twin(f"{type(self).__name__}.forward(reset_state=...)",
                                        "has no resets")
            return self._traced_forward(input, hx, lengths, resets)
        traced = _fx_leaf_call(self, _RecurrentMixin.forward, input,
                               (input,) if hx is None else (input, hx),
                               dict(lengths=lengths, resets=resets, reset_state=reset_state))
        if traced is not None:
            return traced
        if resets is None:
            reset_state = None  # (nothing restarts: it would change nothing)
        if not isinstance(input, (Tensor, PackedSequence)):
            raise TypeError(f"{type(self).__name__}: expected input to be a Tensor or a PackedSequence, "
                            f"got {type(input).__name__}")
        if isinstance(input, Tensor) and input.dim() not in (2, 3):
            # (Before auto's choice, which reads the input's sizes.)  torch.nn's words,
            # "tensor" in RNN's alone.
            raise ValueError(f"{type(self).__name__}: Expected input to be 2D or 3D, got {input.dim()}D "
                             f"{'tensor ' if self.mode.startswith('RNN_') else ''}instead")
        # (Under torch.compile the checks fold to False: compiled code captures rnnkern's ops.)
        backend = self.backend  # auto's choice of rnnkern backend replaces it below (on a GPU: cuda or triton)
        # (A call with lengths= or resets=, or of a module with an option
        # torch.nn lacks (LayerNorm, reset_after=False, zoneout), needs no
        # choice: it runs rnnkern's default backend, which _run_layers resolves
        # "auto" to -- what the choice would say.  An RL rollout's step with
        # resets= feels every microsecond, and a kept choice costs 2-5.)
        if self.backend == "auto" and lengths is None and resets is None \
                and self._has_torch_nn_twin and self.reset_after and not self.zoneout:
            choice = self._auto_choice(input, hx)
            if choice.uses_torch:
                return self._torch_nn_forward(input, hx)
            backend = choice.implementation
        if lengths is None and reset_state is None and type(input) is Tensor:
            result = self._one_step_forward(input, hx, backend, resets)
            if result is None and resets is None:
                result = self._from_input_forward(input, hx, backend)
            if result is not None:
                return result
        name = type(self).__name__
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError(f"{name}: lengths= is for padded input; a PackedSequence carries its own")
            return self._forward_packed(input, hx, resets, reset_state, backend)
        user_hx, user_resets, user_reset_state = hx, resets, reset_state

        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            if lengths is not None:
                raise ValueError(f"{name}: lengths= needs batched (3-D) input")
            input = input.unsqueeze(batch_dim)
        B = input.size(batch_dim)
        if reset_state is not None:
            reset_state = self._reset_parts(reset_state, B, batched, input)
        hx_zeros = hx is None
        if hx is None:
            hx = self._zeros_hidden(B, input)
            self.check_input(input, None)
        else:
            hx = self._as_torch_nn_indexes(hx, makes_pair=not batched)
            parts = self._hx_parts(hx)
            want = 3 if batched else 2
            if any(h.dim() != want for h in parts):
                kind = "batched 3-D" if batched else "unbatched 2-D"
                if self.mode == "LSTM":
                    got = f"({parts[0].dim()}-D, {parts[1].dim()}-D) tensors"
                    raise RuntimeError(f"For {kind} input, hx and cx should also be {want}-D but got {got}")
                raise RuntimeError(f"For {kind} input, hx should also be {want}-D but got "
                                   f"{parts[0].dim()}-D tensor")
            if not batched:
                parts = tuple(h.unsqueeze(1) for h in parts)
            self.check_input(input, None)
            self._check_hidden(parts, B, input)
            hx = parts
        if self.batch_first:
            input = input.transpose(0, 1)
        T = input.size(0)
        if T == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        if lengths is not None:
            lengths = _check_lengths(lengths, T, B, name)
            if not torch.compiler.is_compiling() and not (self.zoneout and self.training) \
                    and not ops._transformed(input) and _sorting_saves_steps(lengths):
                # Unsorted lengths run as the packed batch torch.nn would make
                # of them (sorted longest first): its real steps, on the CPU as
                # rows without a grid.  The same numbers (packed rows equal the
                # grid bit for bit) and dropout in torch.nn's order either way;
                # zoneout's masks are drawn per grid position, so a training
                # call with zoneout keeps its batch order.  (Under torch.func
                # the reference runs: nothing to save.)  The rows move by
                # _grid_to_rows / _rows_to_grid: pad_packed_sequence's backward
                # copies the whole grid once per step.
                batch_sizes, order, packing = _pack_by_lengths(lengths, T, input.device)
                packed = PackedSequence(_grid_to_rows(input, packing), batch_sizes,
                                        order.to(input.device))
                out, hidden = self._forward_packed(packed, user_hx, user_resets,
                                                   user_reset_state, backend)
                out = _rows_to_grid(out.data, packing, T, B)
                return (out.transpose(0, 1) if self.batch_first else out), hidden
        if resets is not None:
            resets = self._check_resets(resets, T, B, batched, input.device,
                                        keep_empty=reset_state is not None)
        packing = None
        if lengths is not None:
            dropout = self.dropout > 0 and self.training and self.num_layers > 1
            if not torch.compiler.is_compiling() and (dropout or int(lengths.sum()) * 5 < T * B * 4):
                # Where the real rows lie: dropout draws over them as torch.nn
                # does, and a grid mostly padding projects them alone (see
                # _input_projection).  Their count is data-dependent: eager
                # only; under torch.compile dropout draws over the padded tensor
                # (its random stream differs from eager's anyway).
                packing = _packing_of_padded(lengths, T, input.device)
        out, hidden = self._run_layers(input, hx, lengths, packing, resets, reset_state,
                                       reset_is_hx=hx_zeros and reset_state is None, backend=backend)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(batch_dim)
            hidden = tuple(h.squeeze(1) for h in hidden)
        return out, (hidden if self.mode == "LSTM" else hidden[0])

    def _traced_forward(self, input, hx, lengths: Optional[Tensor], resets: Optional[Tensor]):
        """torch.nn's forward, for torch.jit.trace and ONNX export; ``lengths=``
        becomes the PackedSequence torch.nn computes the same numbers on."""
        if resets is not None:
            raise _no_torch_nn_twin(f"{type(self).__name__}.forward(resets=...)", "has no resets")
        if lengths is None:
            return self._torch_nn_forward(input, hx)
        name = type(self).__name__
        if not isinstance(input, Tensor) or input.dim() != 3:
            raise ValueError(f"{name}: lengths= needs batched (3-D) input")
        T = input.size(1 if self.batch_first else 0)
        lengths = _check_lengths(lengths, T, input.size(0 if self.batch_first else 1), name)
        packed = pack_padded_sequence(input, lengths, batch_first=self.batch_first,
                                      enforce_sorted=False)
        out, hidden = self._torch_nn_forward(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=T)
        return out, hidden

    def _forward_packed(self, input: PackedSequence, hx, resets: Optional[Tensor], reset_state,
                        backend: Optional[str] = None):
        """A PackedSequence runs as one length-sorted batch with per-sequence lengths
        (one kernel call per layer and direction, padding never computed): on the
        CPU backend as its rows, elsewhere padded.
        ``resets`` comes padded in the original batch order and is sorted here."""
        name = type(self).__name__
        data, batch_sizes, sorted_indices, unsorted_indices = input
        self.check_input(data, batch_sizes)
        T, N = batch_sizes.numel(), data.size(0)
        if not torch.compiler.is_compiling() and int(batch_sizes.sum()) != N:
            raise RuntimeError(f"{name}: PackedSequence data has {N} rows but its batch_sizes "
                               f"sum to {int(batch_sizes.sum())}")
        # The batch size, from shapes where possible (a data-dependent size
        # would break a torch.compile graph): the permutation of an unsorted
        # pack, else hx under compile, else the first batch size.
        if sorted_indices is not None:
            B = sorted_indices.numel()
        elif hx is not None and torch.compiler.is_compiling():
            B = self._hx_parts(hx)[0].size(1)
        else:
            B = int(batch_sizes[0])
        if reset_state is not None:
            reset_state = self._reset_parts(reset_state, B, True, data)
            reset_state = self.permute_hidden(
                reset_state if self.mode == "LSTM" else reset_state[0], sorted_indices)
            reset_state = tuple(reset_state) if self.mode == "LSTM" else (reset_state,)
        hx_zeros = hx is None
        if hx is None:
            hx = self._zeros_hidden(B, data)
        else:
            if sorted_indices is not None:  # (else torch.nn hands hx to aten as it is)
                hx = self._as_torch_nn_indexes(hx, makes_pair=True)
            parts = self._hx_parts(hx)
            self._check_hidden(parts, B, data)
            hx = self.permute_hidden(hx, sorted_indices)
            hx = tuple(hx) if self.mode == "LSTM" else (hx,)
        if resets is not None:
            resets = self._check_resets(resets, T, B, True, data.device,
                                        keep_empty=reset_state is not None)
            if resets is not None and sorted_indices is not None:
                resets = resets[:, sorted_indices]
        # Sequence b of the sorted pack has as many steps as batch sizes above b.
        lengths = (batch_sizes.unsqueeze(1) > torch.arange(B).unsqueeze(0)).sum(0)
        reset_is_hx = hx_zeros and reset_state is None
        if (ops.resolve_backend(backend or self.backend, data.device) == "cpu" and resets is None
                and not self.zoneout and not torch.compiler.is_compiling()):
            # The CPU kernels take the packed rows themselves (csrc/checks.h,
            # packed_rows): no [T, B] grid to fill, scatter into and gather
            # from, whose padding cost a batch of skewed lengths more than its
            # real steps.  (Resets and zoneout are read per grid position.)
            out_data, hidden = self._run_layers(data, hx, lengths, None, resets, reset_state,
                                                reset_is_hx=reset_is_hx, backend=backend)
        else:
            packing = _packing_from_batch_sizes(batch_sizes, N, data.device)
            padded = _rows_to_grid(data, packing, T, B)
            out, hidden = self._run_layers(padded, hx, lengths, packing, resets, reset_state,
                                           reset_is_hx=reset_is_hx, backend=backend, x_rows=data)
            out_data = _grid_to_rows(out, packing)
        hidden = hidden if self.mode == "LSTM" else hidden[0]
        return (PackedSequence(out_data, batch_sizes, sorted_indices, unsorted_indices),
                self.permute_hidden(hidden, unsorted_indices))


class RNN(_RecurrentMixin, nn.RNN):
    """Drop-in for :class:`torch.nn.RNN` (tanh or ReLU), plus ``backend=`` and
    ``zoneout=``."""

    def __init__(self, *args, backend: str = "auto", zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)


class GRU(_RecurrentMixin, nn.GRU):
    """Drop-in for :class:`torch.nn.GRU`, plus ``backend=``, ``reset_after=`` and
    ``zoneout=``."""

    def __init__(self, *args, backend: str = "auto", reset_after: bool = True,
                 zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, reset_after, zoneout)


class LSTM(_RecurrentMixin, nn.LSTM):
    """Drop-in for :class:`torch.nn.LSTM` (with ``proj_size``), plus ``backend=``
    and ``zoneout=`` (on h and c)."""

    def __init__(self, *args, backend: str = "auto", zoneout: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_rnnkern(backend, zoneout=zoneout)
