"""Emulated trainer time: trajectories trimmed for the model, the cost model's time charged for
their full lengths, the backward's inside autograd."""

from __future__ import annotations

import pytest
import torch

from tide_megatron.core.trajectory import Trajectory
from tide_megatron.emulation.trainer_time import TrainerDeviceTime
from tide_megatron.sim.loader import load_hardware_model
from tide_megatron.trainer.payload import micro_batch_of


@pytest.fixture(scope="module")
def cost():
    return load_hardware_model("h100_sxm", "qwen2_5_7b")


def _traj(n, index=0):
    return Trajectory.from_tokens(list(range(n)), [0.0] * (n // 2) + [1.0] * (n - n // 2), [-1.0] * n,
                                  advantage=0.5, index=index)


def test_a_micro_batch_holds_the_trimmed_tails_and_the_full_lengths(cost):
    clock = TrainerDeviceTime(cost, dilation=0.0, keep_tokens=4)
    mb = micro_batch_of([_traj(100), _traj(3, 1)], device_time=clock)
    assert mb.lengths == [4, 3] and mb.modelled_lengths == [100, 3]
    assert mb.token_ids[0, :4].tolist() == [96, 97, 98, 99]  # its last tokens: the answer the loss needs
    assert mb.num_loss_tokens == 3 + 2  # a trimmed trajectory's first token leaves the loss


def test_time_is_the_cost_models_for_each_trajectory_at_its_own_length(cost):
    clock = TrainerDeviceTime(cost, dilation=0.0)
    fwd = clock.pass_s([1000, 3000], backward=False)
    assert fwd == pytest.approx(cost.train_s(1000, 1000, False, 1) + cost.train_s(3000, 3000, False, 1))
    assert fwd < cost.train_s(4000, 4000, False, 1)  # packed: no attention across trajectories
    assert clock.pass_s([1000], backward=True) == pytest.approx(3 * clock.pass_s([1000], backward=False))


def test_the_backward_is_charged_when_autograd_reaches_it(cost):
    clock = TrainerDeviceTime(cost, dilation=0.0)
    x = torch.ones(3, requires_grad=True)
    clock.forward([2000], since=0.0)
    after_forward = clock.device_s
    y = clock.backward_after(x * 2, [2000])
    assert clock.device_s == after_forward  # nothing yet
    y.sum().backward()
    assert clock.device_s - after_forward == pytest.approx(2 * clock.pass_s([2000], backward=False))
    assert x.grad.tolist() == [2.0, 2.0, 2.0]  # the gradient passes unchanged


def test_the_full_lengths_survive_a_move_and_are_what_ra2p_counts(cost):
    mb = micro_batch_of([_traj(100), _traj(50, 1)], device_time=TrainerDeviceTime(cost, dilation=0.0))
    moved = mb.to("cpu")
    assert moved.modelled_lengths == [100, 50] and moved.num_tokens == 150 and moved.lengths == [8, 8]


def test_a_role_change_moves_state_in_the_cost_models_time(cost):
    """What the simulator charges a rank joining the trainer, and sync's switch each way."""
    clock = TrainerDeviceTime(cost, dilation=0.0)
    clock.state_move("actor", 8, since=0.0)
    assert clock.device_s == pytest.approx(cost.colocate_switch_s(8))
    clock.state_move("ref", 8, since=0.0)
    assert clock.device_s - cost.colocate_switch_s(8) == pytest.approx(cost.swap_s(0, cost.ref_state_bytes_per_gpu))
    with pytest.raises(ValueError, match="expected 'actor' or 'ref'"):
        clock.state_move("optimizer", 8, since=0.0)
