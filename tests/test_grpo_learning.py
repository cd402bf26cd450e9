"""GRPO learns: a tiny K3 policy, sampled through ``generate``, is rewarded for spelling a fixed token sequence and
trained with the trainer's own micro-batch loss (advantages, clipped surrogate, TIS, aggregation) and AdamW."""

from dataclasses import replace

import pytest
import torch

from sandforge.config import TrainerConfig
from sandforge.models.sampling import SamplingParams
from sandforge.engine.naive import generate_batch_naive
from sandforge.models.k3.model import K3Config, K3Model
from sandforge.trainer.rank import TrainerRank
from sandforge.trainer.algorithms import Totals, resolve, token_advantages
from sandforge.types import TrainingRow
from test_algorithms import fake_rank

TARGET = [5, 9, 3]
PROMPT = [1]


def reward(tokens: list[int]) -> float:
    """Share of positions that hold the target token: a dense signal a random policy (1/16 per token) rarely gets."""
    return sum(a == b for a, b in zip(tokens, TARGET)) / len(TARGET)


@pytest.fixture
def one_thread():
    """Small ops on a shared machine: one thread avoids spinning worker threads that only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_grpo_raises_the_mean_reward(one_thread):
    torch.manual_seed(0)
    model = K3Model(K3Config(vocab_size=16, d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16, q_latent=16,
                             kv_latent=8, kda_low_rank=8, n_experts=4))
    settings = resolve(TrainerConfig(algorithm="grpo"), len(TARGET))
    rank = fake_rank(model, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params, generator = SamplingParams(max_new_tokens=len(TARGET), temperature=1.0), torch.Generator().manual_seed(0)
    group_size, tasks = 8, 2
    means = []
    for _ in range(40):
        samples = generate_batch_naive(model, [PROMPT] * (group_size * tasks), params, generator)
        rewards = [reward(s.token_ids) for s in samples]
        means.append(sum(rewards) / len(rewards))
        rows = [TrainingRow(token_ids=PROMPT + s.token_ids, loss_mask=[0] + [1] * len(s.token_ids),
                            logprobs=[0.0] + s.logprobs) for s in samples]
        groups = [f"{i // group_size}" for i in range(len(rows))]
        adv, _ = token_advantages(settings.algorithm.advantages, rewards, groups, [r.loss_mask for r in rows])
        rows = [replace(row, advantages=a) for row, a in zip(rows, adv)]
        model.train()
        optimizer.zero_grad()
        totals = Totals(tokens=sum(sum(r.loss_mask) for r in rows), sequences=len(rows))
        loss, _, _ = TrainerRank._micro_batch_loss(rank, rows, totals, "rl")
        loss.backward()
        optimizer.step()
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert last > first + 0.5, (first, last, means)  # seed 0: about 0.05 -> 0.97
