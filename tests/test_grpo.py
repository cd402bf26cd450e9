import math

import pytest
import torch

from sandforge.trainer.actor import split_micro_batches
from sandforge.trainer.grpo import group_advantages, grpo_token_losses, k3_kl, sft_token_losses


def test_group_advantages_are_relative_within_each_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    groups = ["a", "a", "a", "a", "b", "b"]
    adv = group_advantages(rewards, groups)
    assert adv[0] > 0 and all(a < 0 for a in adv[1:4])
    assert sum(adv[:4]) == pytest.approx(0.0, abs=1e-9)
    assert adv[4:] == [0.0, 0.0]  # identical rewards: nothing to learn from this group
    # unit scale within a group of mixed rewards
    std = torch.tensor(adv[:4]).std(unbiased=False).item()
    assert std == pytest.approx(1.0, rel=1e-4)


def test_group_advantages_unscaled_is_mean_centred():
    assert group_advantages([2.0, 0.0], ["g", "g"], scale=False) == [1.0, -1.0]


def test_grpo_loss_on_policy_is_minus_advantage_weighted_tokens():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_()
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, stats = grpo_token_losses(lp, lp.detach(), torch.tensor([2.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-4.0)  # ratio 1 on two tokens, advantage 2
    assert stats["clipped"].item() == 0
    loss.backward()
    assert lp.grad[0, 0] == 0  # masked tokens get no gradient
    assert lp.grad[0, 1].item() == pytest.approx(-2.0)


def test_grpo_loss_clips_ratio_in_the_direction_of_the_advantage():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, stats = grpo_token_losses(new, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    # positive advantage: ratio 2 is clipped to 1.2 (no gradient); ratio 0.5 is kept (pessimistic minimum)
    assert loss.item() == pytest.approx(-(1.2 + 0.5))
    assert stats["clipped"].item() == 2  # both tokens differ from their clipped value
    loss.backward()
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-0.5)


def test_k3_kl_is_zero_on_policy_and_positive_off_policy():
    a = torch.log(torch.tensor([0.2, 0.5]))
    assert torch.allclose(k3_kl(a, a), torch.zeros(2))
    assert (k3_kl(a, a + 0.3) > 0).all()


def test_sft_loss_sums_masked_nll():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    loss, _ = sft_token_losses(lp, torch.tensor([[0.0, 1.0, 1.0]]))
    assert loss.item() == pytest.approx(5.0)


def test_micro_batches_cover_every_row_once():
    rows = [{"token_ids": [0] * n} for n in [5, 1, 9, 3, 7]]
    parts = split_micro_batches(rows, 2)
    assert len(parts) == 2
    assert sorted(len(r["token_ids"]) for p in parts for r in p) == [1, 3, 5, 7, 9]
    assert split_micro_batches(rows[:1], 3)[1:] == [[], []]
