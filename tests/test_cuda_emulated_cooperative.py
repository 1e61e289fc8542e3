"""Cooperative grids on the emulated CUDA device: the ground a persistent kernel
(W_hh resident across the SMs, one grid barrier per step) will stand on.

A cooperative launch (RNNKERN_LAUNCH_COOPERATIVE) runs every block of the grid
at once as fibers; cooperative_groups::this_grid().sync() holds every thread of
the grid; each block has its own dynamic shared memory (RNNKERN_DYNAMIC_SHARED);
the launch is refused, as cudaLaunchCooperativeKernel refuses it, when the grid
exceeds what the device model holds at once.  The test kernel
(csrc/cuda_emu/grid_exchange.cuh) passes values between blocks at every step;
its faults are the mutation checks: the grid barrier removed, a read one step
early, a block exiting while the others wait, each caught.  Under
ThreadSanitizer (.ci/cuda_emulation.sh) the fault-free cases must give no
report: the grid barrier's happens-before is what orders the exchange.
"""
from __future__ import annotations


import pytest
import torch

from conftest import generator, require_cuda_emulation

require_cuda_emulation()

from rnnkern import cuda_emulated  # noqa: E402

SUCCESS, INVALID_VALUE, TOO_LARGE = 0, 1, 720  # cudaError_t (driver_types.h)
NO_FAULT, NO_GRID_BARRIER, READ_ONE_STEP_EARLY, LAST_BLOCK_EXITS = range(4)


@pytest.fixture(autouse=True)
def device_model():
    """Each test starts from the H100 model (132 SMs, 64 registers) and the forward order."""
    cuda_emulated.set_device_model(132, 64)
    cuda_emulated.set_schedule("forward", 0)
    yield
    cuda_emulated.set_device_model(132, 64)
    cuda_emulated.set_schedule("forward", 0)


def reference(w, x0, shift, steps):
    x = x0.double()
    idx = (torch.arange(x.numel()) + shift) % x.numel()
    for _ in range(steps):
        x = w.double() * x[idx] + x
    return x


def inputs(n, seed):
    g = generator(seed)
    return torch.rand(n, generator=g) - 0.5, torch.rand(n, generator=g) * 2 - 1


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle"])
@pytest.mark.parametrize("blocks, threads, per_block, shift, steps",
                         [(4, 32, 32, 37, 5), (3, 64, 40, 1, 4), (6, 16, 48, 100, 3), (2, 96, 7, 13, 6)])
def test_cooperative_exchange_matches_the_reference(order, blocks, threads, per_block, shift, steps):
    cuda_emulated.set_schedule(order, 7)
    w, x0 = inputs(blocks * per_block, seed=blocks * 100 + steps)
    before = cuda_emulated.launches()
    code, out = cuda_emulated.grid_exchange(w, x0, blocks, threads, shift, steps)
    assert code == SUCCESS and cuda_emulated.launches() == before + 1
    torch.testing.assert_close(out.double(), reference(w, x0, shift, steps), rtol=1e-5, atol=1e-5)


def test_cooperative_dynamic_shared_memory_beyond_48k_needs_the_opt_in():
    """Each block's weights live in its own dynamic shared memory: 13,000 floats (52 KiB)
    per block need cudaFuncSetAttribute first, as on hardware."""
    blocks, per_block = 3, 13000
    w, x0 = inputs(blocks * per_block, seed=3)
    code, _ = cuda_emulated.grid_exchange(w, x0, blocks, 128, 5, 2, opt_in=False)
    assert code == INVALID_VALUE
    code, out = cuda_emulated.grid_exchange(w, x0, blocks, 128, 5, 2)
    assert code == SUCCESS
    torch.testing.assert_close(out.double(), reference(w, x0, 5, 2), rtol=1e-5, atol=1e-5)
    # 227 KiB (58,112 floats) is sm_90's most for one block; beyond it the opt-in itself fails.
    w, x0 = inputs(58112 + 1, seed=4)
    assert cuda_emulated.grid_exchange(w[:58112], x0[:58112], 1, 128, 5, 1)[0] == SUCCESS
    assert cuda_emulated.grid_exchange(w, x0, 1, 128, 5, 1)[0] == INVALID_VALUE


def test_cooperative_occupancy_model_is_sm90s():
    # 32-thread blocks, no shared memory: 32 blocks per SM (the block limit).
    assert cuda_emulated.grid_exchange_blocks(32, 1) == 32 * 132
    # 1024 threads x 64 registers fill the 64K register file: 1 per SM; at 32 registers
    # the thread limit binds, 2 per SM (2048 threads).
    assert cuda_emulated.grid_exchange_blocks(1024, 1) == 1 * 132
    # 64 KiB + 1 KiB reserved: 3 per SM (228 KiB).
    assert cuda_emulated.grid_exchange_blocks(64, 16384) == 3 * 132
    cuda_emulated.set_device_model(132, 32)
    assert cuda_emulated.grid_exchange_blocks(1024, 1) == 2 * 132
    # 255 registers x 256 threads: 8 warps x 8192 registers fill the 64K file once.
    cuda_emulated.set_device_model(4, 255)
    assert cuda_emulated.multiprocessors() == 4
    assert cuda_emulated.grid_exchange_blocks(256, 1) == 1 * 4


def test_cooperative_launch_too_large_for_the_device_is_refused():
    cuda_emulated.set_device_model(2, 255)  # 256 threads: 1 block per SM, 2 in all
    w, x0 = inputs(3 * 8, seed=5)
    before = cuda_emulated.launches()
    code, _ = cuda_emulated.grid_exchange(w, x0, 3, 256, 1, 2)
    assert code == TOO_LARGE and cuda_emulated.launches() == before  # nothing ran
    code, out = cuda_emulated.grid_exchange(w[:16], x0[:16], 2, 256, 1, 2)
    assert code == SUCCESS
    torch.testing.assert_close(out.double(), reference(w[:16], x0[:16], 1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fault", [NO_GRID_BARRIER, READ_ONE_STEP_EARLY])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_mutation_a_missing_or_early_exchange_gives_a_wrong_answer(fault, order):
    cuda_emulated.set_schedule(order, 0)
    w, x0 = inputs(4 * 16, seed=11)
    code, out = cuda_emulated.grid_exchange(w, x0, 4, 16, 21, 4, fault=fault)
    assert code == SUCCESS
    good = reference(w, x0, 21, 4)
    assert not torch.allclose(out.double(), good, rtol=1e-3, atol=1e-3, equal_nan=False)


def test_mutation_a_block_exiting_at_the_grid_barrier_is_an_error():
    w, x0 = inputs(3 * 8, seed=13)
    with pytest.raises(RuntimeError, match=r"divergent barrier.*exited while .*grid\.sync\(\).*hangs"):
        cuda_emulated.grid_exchange(w, x0, 3, 8, 1, 3, fault=LAST_BLOCK_EXITS)
    # The emulator is usable afterwards.
    assert cuda_emulated.grid_exchange(w, x0, 3, 8, 1, 3)[0] == SUCCESS


def test_grid_sync_outside_a_cooperative_launch_is_an_error():
    w, x0 = inputs(2 * 8, seed=17)
    with pytest.raises(RuntimeError, match=r"grid\.sync\(\) at .*grid_exchange\.cuh.*not cooperative"):
        cuda_emulated.grid_exchange(w, x0, 2, 8, 1, 2, cooperative=False)


def test_cooperative_grid_larger_than_the_emulator_runs_is_a_clear_error():
    w, x0 = inputs(17 * 1, seed=19)
    with pytest.raises(RuntimeError, match="emulator runs at most 16384"):
        cuda_emulated.grid_exchange(w, x0, 17, 1024, 1, 1)


def test_an_earlier_launch_error_is_not_reported_as_the_next_ops():
    """A refused cooperative launch leaves its error pending, as the CUDA runtime does; the
    next rnnkern op clears what it did not cause before its own launches, so it runs and
    reports only its own errors."""
    from conftest import recurrence_inputs, run_recurrence
    cuda_emulated.set_device_model(1, 255)
    w, x0 = inputs(2 * 8, seed=23)
    assert cuda_emulated.grid_exchange(w, x0, 2, 256, 1, 1)[0] == TOO_LARGE
    run_recurrence("cuda_emulated", "lstm", recurrence_inputs("lstm", 3, 2, 5))
