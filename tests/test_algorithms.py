"""trainer/algorithms: every advantage, loss and aggregation mode on small examples computed by hand (in comments)."""

import math
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from sandforge.config import TIEBREAK_ALGORITHMS, TrainerConfig
from sandforge.trainer.batches import split_micro_batches
from sandforge.trainer.rank import TrainerRank
from sandforge.trainer.algorithms import (
    ALGORITHMS, MicroBatch, Totals, aggregate, informative_groups, kl_estimate, overlong_penalty, resolve, rl_objective,
    sft_objective, token_advantages,
)
from sandforge.trainer.algorithms import advantages as A
from sandforge.trainer.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss
from sandforge.types import TrainingRow

L2 = math.log(2.0)


def settings(algorithm="grpo", budget=4, **overrides):
    return resolve(TrainerConfig(algorithm=algorithm, **overrides), budget)


def ep(rewards, groups, lengths=None):
    lengths = lengths or [1] * len(rewards)
    return A.Episodes(rewards, groups, [torch.zeros(n, dtype=torch.float64) for n in lengths])


def flat(per_episode):
    return torch.cat(per_episode).tolist()


# ---------------------------------------------------------------- advantages
def test_grpo_advantages_standardise_within_each_group():
    adv, returns = A.grpo(ep([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a"] * 4 + ["b"] * 2))
    # group a: mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330127 -> 0.75 / 0.433 = 1.7320508, -0.25 / 0.433
    assert flat(adv) == pytest.approx([1.7320508, -0.5773503, -0.5773503, -0.5773503, 0.0, 0.0], abs=1e-5)
    assert returns is None


def test_dr_grpo_advantages_are_only_mean_centred():
    adv, _ = A.dr_grpo(ep([2.0, 0.0, 1.0, 0.0, 0.0, 0.0], ["a", "a", "b", "b", "b", "b"]))
    assert flat(adv) == pytest.approx([1.0, -1.0, 0.75, -0.25, -0.25, -0.25])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv, _ = A.rloo(ep([1.0, 0.0, 0.0, 0.0, 5.0], ["a"] * 4 + ["solo"]))
    # 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3; a group of one has no baseline: 0
    assert flat(adv) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0])


def test_reinforce_pp_whitens_token_returns_over_the_batch():
    adv, _ = A.reinforce_pp(ep([1.0, 0.0], ["a", "b"], lengths=[2, 1]))
    # token returns [1, 1] and [0]: mean 2/3, std sqrt(2/9) = 0.4714045 -> (1/3)/0.4714 = 0.7071068, -(2/3)/0.4714
    assert flat(adv) == pytest.approx([0.7071068, 0.7071068, -1.4142136], abs=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    e = ep([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    plain, _ = A.reinforce_pp(e)
    # [1, 0, 1, 1]: mean 0.75, std 0.4330127 -> [0.57735, -1.73205, 0.57735, 0.57735]
    assert flat(plain) == pytest.approx([0.5773503, -1.7320508, 0.5773503, 0.5773503], abs=1e-5)
    based, _ = A.reinforce_pp_baseline(e)
    # group means removed: [0.5, -0.5, 0, 0]; mean 0, std sqrt(0.5 / 4) = 0.3535534 -> [1.41421, -1.41421, 0, 0]
    assert flat(based) == pytest.approx([1.4142136, -1.4142136, 0.0, 0.0], abs=1e-5)


def test_kl_penalty_in_the_reward_enters_token_returns():
    rewards = A.token_rewards(1.0, torch.tensor([0.1, 0.2], dtype=torch.float64))
    assert rewards.tolist() == pytest.approx([-0.1, 0.8])  # -KL on each token, the reward on the last
    assert A.discounted_returns(rewards, 1.0).tolist() == pytest.approx([0.7, 0.8])
    assert A.discounted_returns(rewards, 0.5).tolist() == pytest.approx([0.3, 0.8])  # -0.1 + 0.5 * 0.8
    # sequence-level algorithms subtract the summed penalty: group [1 - 0.3, 0] -> Dr.GRPO [0.35, -0.35]
    e = A.Episodes([1.0, 0.0], ["g", "g"], [torch.tensor([0.1, 0.2], dtype=torch.float64), torch.zeros(1)])
    assert flat(A.dr_grpo(e)[0]) == pytest.approx([0.35, 0.35, -0.35])


def test_gae_by_hand():
    adv, ret = A.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), gamma=1.0, lam=0.5)
    # t2: delta = 1 - 0.5 = 0.5;  t1: delta = 0 + 0.5 - 0.5 = 0, A = 0.5 * 0.5 = 0.25;  t0: A = 0.5 * 0.25 = 0.125
    assert adv.tolist() == pytest.approx([0.125, 0.25, 0.5])
    assert ret.tolist() == pytest.approx([0.625, 0.75, 1.0])
    # lambda 1: A + V is the discounted return; t1: -0.05 + 0.9 * 0.5 = 0.4, t0: -0.05 + 0.9 * 0.4 = 0.31
    adv, ret = A.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), gamma=0.9, lam=1.0)
    assert adv.tolist() == pytest.approx([0.31, 0.4, 0.5])
    assert ret.tolist() == pytest.approx([0.81, 0.9, 1.0])


def test_token_advantages_skip_tool_output_tokens_and_ppo_whitens():
    mask = [0, 1, 1, 0, 1]  # prompt, two policy tokens, a tool-output token, one more policy token
    values = [9.0, 0.5, 0.5, 9.0, 0.5]  # estimates off the mask are never read
    adv, ret = token_advantages(A.ppo, [1.0], ["g"], [mask], values=[values], gamma=1.0, lam=0.5)
    # GAE over the policy tokens only is test_gae_by_hand's: A = [0.125, 0.25, 0.5], returns [0.625, 0.75, 1.0];
    # whitened: mean 0.2916667, std 0.1559024 -> [-1.0690450, -0.2672612, 1.3363062]
    assert adv[0] == pytest.approx([0.0, -1.0690450, -0.2672612, 0.0, 1.3363062], abs=1e-5)
    assert ret[0] == pytest.approx([0.0, 0.625, 0.75, 0.0, 1.0])
    adv, ret = token_advantages(A.dr_grpo, [1.0, 0.0], ["g", "g"], [mask, [0, 1]])
    assert adv == [[0.0, 0.5, 0.5, 0.0, 0.5], [0.0, -0.5]] and ret is None


# ---------------------------------------------------------------- losses
def ratios(*r):
    return torch.log(torch.tensor([list(r)])).requires_grad_(), torch.zeros(1, len(r))


def test_ppo_clip_is_asymmetric_and_pessimistic():
    lp, old = ratios(1.5, 0.5, 1.25, 0.9, 1.5)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 5)
    out = ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # 1.5, A>0: clipped to 1.28; 0.5, A<0: clipped to 0.8 -> -0.8; 1.25 < 1.28 kept; 0.9 inside; 1.5 with A<0 is the
    # pessimistic -1.5 (no clip)
    assert out.per_token[0].tolist() == pytest.approx([-1.28, 0.8, -1.25, 0.9, 1.5])
    assert out.clipped_high[0].tolist() == [True, False, False, False, False]
    assert out.clipped_low[0].tolist() == [False, True, False, False, False]
    out.per_token.sum().backward()
    # d(-rho A)/d logp = -rho A where unclipped, 0 where the clip acted
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.25, 0.9, 1.5])
    symmetric = ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert symmetric.per_token[0, 2].item() == pytest.approx(-1.2)  # 1.25 is clipped without clip-higher


def test_gspo_ratio_is_the_geometric_mean_over_policy_tokens_clipped_per_sequence():
    lp = torch.tensor([[0.1, 0.3, 5.0], [L2, -L2, 0.0]], requires_grad=True)
    old, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [2.0] * 3])
    out = gspo_loss(lp, old, adv, mask, eps_low=0.1, eps_high=0.1)
    # row 0: exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 > 1.1 -> clipped, -1.1 on every token (the masked 5.0 unread)
    # row 1: exp(mean(log 2, -log 2)) = 1 -> -2
    assert out.ratio[:, 0].tolist() == pytest.approx([math.exp(0.2), 1.0])
    assert out.per_token[:, :2].flatten().tolist() == pytest.approx([-1.1, -1.1, -2.0, -2.0])
    assert out.clipped_high[0, :2].all() and not out.clipped_high[1].any()
    s = settings("gspo", clip_eps_low=0.1, clip_eps_high=0.1)
    loss = aggregate(out.per_token, mask, s.loss_agg, Totals(tokens=4, sequences=2))
    assert loss.item() == pytest.approx((-1.1 - 2.0) / 2)  # seq-mean-token-mean: GSPO's mean over sequences
    loss.backward()
    # row 1: d/dlogp_t of -A s / N with s = exp(mean) -> -2 * 1 * (1/2) / 2 = -0.5 per policy token; row 0 clipped
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, -0.5, 0.0])


def test_cispo_gradient_is_the_clipped_weight_times_grad_logprob():
    lp, old = ratios(1.5, 0.5, 1.1)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    out = cispo_loss(lp, old, adv, torch.ones(1, 3), eps_low=0.2, eps_high=0.28)
    # weights clip(1.5) = 1.28, clip(0.5) = 0.8, 1.1; loss value -w A
    assert out.per_token[0].tolist() == pytest.approx([-1.28, -0.8, 2.2])
    assert out.clipped_high[0].tolist() == [True, False, False] and out.clipped_low[0].tolist() == [False, True, False]
    out.per_token.sum().backward()
    # unlike PPO, a clipped token keeps a gradient: -sg(w) A grad(logp)
    assert lp.grad[0].tolist() == pytest.approx([-1.28, -0.8, 2.2])


# ---------------------------------------------------------------- aggregation
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, want", [
    ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
    ("seq-mean-token-mean", 3.0),  # (6 / 3 + 4 / 1) / 2 sequences
    ("seq-mean-token-sum", 1.25),  # (6 + 4) / (2 sequences * L = 4)
])
def test_aggregation_modes(mode, want):
    totals = Totals(tokens=4, sequences=2)
    assert aggregate(PER_TOKEN, MASK, mode, totals, norm_len=4).item() == pytest.approx(want)
    # one sequence per micro-batch, global counts: the shares add up to the same number
    parts = sum(aggregate(PER_TOKEN[i : i + 1], MASK[i : i + 1], mode, totals, norm_len=4) for i in range(2))
    assert parts.item() == pytest.approx(want)


def test_algorithm_defaults_and_overrides():
    assert set(ALGORITHMS) == set(get_args(TrainerConfig.model_fields["algorithm"].annotation))
    grpo = settings("grpo")
    assert grpo.loss_agg == "token-mean" and (grpo.eps_low, grpo.eps_high) == (0.2, 0.2)
    assert settings("dr_grpo").loss_agg == "seq-mean-token-sum"
    dapo = settings("dapo", budget=100)
    assert (dapo.eps_low, dapo.eps_high, dapo.dynamic_sampling, dapo.overlong_buffer) == (0.2, 0.28, True, 20)
    assert settings("dapo", clip_eps_high=0.3, dynamic_sampling=False, overlong_buffer=0).eps_high == 0.3
    assert not settings("dapo", dynamic_sampling=False).dynamic_sampling
    assert settings("grpo", clip_eps=0.1).eps_high == 0.1
    assert settings("ppo").needs_scores and not settings("grpo").needs_scores
    assert settings("grpo", kl_coef=0.1, kl_in="reward").needs_scores


# ---------------------------------------------------------------- KL, TIS and the whole objective
def test_kl_estimators_by_hand():
    logp, logq = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # log r = log(q/p) = -log 2: k1 = log 2, k2 = (log 2)^2 / 2, k3 = (0.5 - 1) + log 2
    assert kl_estimate(logp, logq, "k1").item() == pytest.approx(L2)
    assert kl_estimate(logp, logq, "k2").item() == pytest.approx(0.2402265)
    assert kl_estimate(logp, logq, "k3").item() == pytest.approx(0.1931472)
    for k in ("k1", "k2", "k3"):
        assert kl_estimate(logp, logp, k).item() == 0.0


def micro(trainer_p, engine_p, adv, ref_p=None, **extra):
    lp = torch.log(torch.tensor([trainer_p])).requires_grad_()
    return lp, MicroBatch(lp, torch.log(torch.tensor([engine_p])), torch.tensor([adv]), torch.ones(1, len(adv)),
                          None if ref_p is None else torch.log(torch.tensor([ref_p])), **extra)


def test_tis_weights_the_policy_loss_by_the_capped_engine_trainer_ratio():
    lp, b = micro([0.5, 0.5], [0.2, 0.5], [1.0, 1.0])
    loss, st = rl_objective(b, settings("grpo", tis_cap=2.0), Totals(tokens=2, sequences=1))
    # token 0: 0.5 / 0.2 = 2.5, capped at 2; token 1: 1. Ratio to the trainer's own old log-probs is 1, so the loss
    # is token-mean of -w A = (-2 - 1) / 2
    assert loss.item() == pytest.approx(-1.5)
    assert st.sums["tis/mean"].item() == pytest.approx(1.5) and st.sums["tis/clipped_frac"].item() == pytest.approx(0.5)
    # k3 of KL(engine || trainer): token 0 (2.5 - 1) - log 2.5 = 0.5837093, token 1: 0 -> mean 0.2918546
    assert st.sums["mismatch/kl"].item() == pytest.approx(0.2918546, abs=1e-6)
    assert st.sums["ratio/mean"].item() == pytest.approx(1.0) and st.mins["ratio/min"].item() == pytest.approx(1.0)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -0.5])  # -w A / 2 tokens
    _, b = micro([0.5, 0.5], [0.2, 0.5], [1.0, 1.0])
    loss, st = rl_objective(b, settings("grpo", tis_cap=None), Totals(tokens=2, sequences=1))
    assert loss.item() == pytest.approx(-1.0) and "tis/mean" not in st.sums


def test_kl_entropy_and_value_terms_of_the_objective():
    _, b = micro([0.5], [0.5], [1.0], ref_p=[0.25], entropy=torch.tensor([[1.0]]),
                 values=torch.tensor([[0.5]]), returns=torch.tensor([[1.0]]))
    s = settings("ppo", kl_coef=0.1, entropy_coef=0.01, value_coef=0.5)
    loss, st = rl_objective(b, s, Totals(tokens=1, sequences=1))
    # -A + 0.1 * k3(0.5 || 0.25) - 0.01 * H + 0.5 * 0.5 * (0.5 - 1)^2 = -1 + 0.01931472 - 0.01 + 0.0625
    assert loss.item() == pytest.approx(-1 + 0.01931472 - 0.01 + 0.0625)
    assert st.sums["kl"].item() == pytest.approx(0.1931472) and st.sums["value/loss"].item() == pytest.approx(0.125)
    assert st.sums["loss/policy"].item() == pytest.approx(-1.0) and st.sums["entropy"].item() == pytest.approx(1.0)
    _, b = micro([0.5], [0.5], [1.0], ref_p=[0.25])
    loss, st = rl_objective(b, settings("grpo", kl_coef=0.1, kl_in="reward"), Totals(tokens=1, sequences=1))
    assert loss.item() == pytest.approx(-1.0) and st.sums["kl"].item() == pytest.approx(0.1931472)  # logged only


def test_sft_objective_is_token_mean_nll():
    loss, st = sft_objective(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[0.0, 1.0, 1.0]]), Totals(4, 1))
    assert loss.item() == pytest.approx(5.0 / 4) and st.sums["loss"].item() == pytest.approx(1.25)


# ---------------------------------------------------------------- DAPO
def test_dynamic_sampling_on_reward_keeps_only_groups_with_differing_rewards():
    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5], ["a", "a", "b", "b", "c", "c", "d"]
    assert informative_groups(rewards, [r == 1.0 for r in rewards], groups, on="reward") == {"a"}


# the quickstart's all-fail group: three wrong answers at 0.30 and a capitalised copy at 0.338, nobody right
ALL_FAIL = [0.30, 0.30, 0.30, 0.338]


def test_dynamic_sampling_on_success_drops_an_all_fail_partial_credit_group_and_keeps_one_with_a_success():
    rewards = ALL_FAIL + [1.0, 0.30, 0.30, 0.338] + [1.0] * 4
    successes = [False] * 4 + [True, False, False, False] + [True] * 4
    groups = ["fail"] * 4 + ["one"] * 4 + ["all"] * 4
    assert informative_groups(rewards, successes, groups) == {"one"}  # on success, the default
    assert informative_groups(rewards, successes, groups, on="reward") == {"fail", "one"}  # the old test keeps it
    assert settings("dapo").dynamic_sampling_on == "success"


# ---------------------------------------------------------------- trainer.reward_signal
GROUP_ALGORITHMS = {"grpo": A.grpo, "dr_grpo": A.dr_grpo, "rloo": A.rloo}


def signal_ep(signal, credit, successes, groups, weight=0.1, shaping=None):
    """Episodes as rl_rows builds them: the signal's rewards (plus shaping, e.g. the overlong penalty) and, for
    tiebreak, the partial credit that orders episodes of equal success."""
    rewards = A.signal_rewards(signal, credit, successes)
    rewards = [r + p for r, p in zip(rewards, shaping or [0.0] * len(rewards))]
    tie = A.TieBreak(successes, credit, weight) if signal == "tiebreak" else None
    return A.Episodes(rewards, groups, [torch.zeros(1, dtype=torch.float64) for _ in rewards], tiebreak=tie)


def test_std_normalised_partial_credit_blows_an_all_fail_group_up_to_1_73():
    # why reward_signal exists: 0.30/0.30/0.30/0.338 -> mean 0.3095, std 0.01645 -> -0.577 x 3, +1.732
    adv, _ = A.grpo(signal_ep("reward", ALL_FAIL, [False] * 4, ["g"] * 4))
    assert flat(adv) == pytest.approx([-0.57735] * 3 + [1.73205], abs=1e-3)  # eps 1e-6 against std 0.016


@pytest.mark.parametrize("name", sorted(GROUP_ALGORITHMS))
def test_reward_signal_success_gives_an_all_fail_partial_credit_group_zero_advantage(name):
    fn = GROUP_ALGORITHMS[name]
    adv, _ = fn(signal_ep("success", ALL_FAIL, [False] * 4, ["g"] * 4))
    assert flat(adv) == [0.0] * 4
    # a success among them still stands out, whatever partial credit the failures had
    adv, _ = fn(signal_ep("success", [1.0, 0.30, 0.30, 0.338], [True, False, False, False], ["g"] * 4))
    a = flat(adv)
    assert a[0] > 0 and a[1] == a[2] == a[3] < 0


@pytest.mark.parametrize("name", sorted(GROUP_ALGORITHMS))
def test_tiebreak_orders_an_all_fail_group_by_partial_credit_within_the_weight(name):
    adv, _ = GROUP_ALGORITHMS[name](signal_ep("tiebreak", ALL_FAIL, [False] * 4, ["g"] * 4, weight=0.1))
    a = flat(adv)
    # never divided by the group's std: 0.1 x (credit - 0.3095) = -0.00095 x 3, +0.00285, not -0.577 / +1.732
    assert a == pytest.approx([-0.00095] * 3 + [0.00285], abs=1e-9)
    assert max(map(abs, a)) < 0.1 and a[3] > a[0]
    adv, _ = GROUP_ALGORITHMS[name](signal_ep("tiebreak", [1.0, 0.0, 0.0, 1.0], [False] * 4, ["g"] * 4, weight=0.1))
    assert max(map(abs, flat(adv))) < 0.1  # the widest credit spread there is stays under the weight


@pytest.mark.parametrize("name", sorted(GROUP_ALGORITHMS))
@pytest.mark.parametrize("shaped", [False, True])
def test_tiebreak_never_gives_a_failed_episode_more_advantage_than_a_success_of_its_group(name, shaped):
    rng = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(2, 9, (1,), generator=rng))
        successes = (torch.rand(n, generator=rng) < 0.4).tolist()
        credit = [1.0 if s else float(torch.rand(1, generator=rng)) for s in successes]
        # shaping (the overlong penalty, KL in the reward) can bring a success's signal down to a failure's: partial
        # credit must then not tip the failure over it
        shaping = (-torch.rand(n, generator=rng)).tolist() if shaped else None  # up to overlong_penalty 1
        weight = [0.1, 0.5][trial % 2]
        adv, _ = GROUP_ALGORITHMS[name](signal_ep("tiebreak", credit, successes, ["g"] * n, weight, shaping))
        a = flat(adv)
        wins, fails = [x for x, s in zip(a, successes) if s], [x for x, s in zip(a, successes) if not s]
        if wins and fails:
            assert max(fails) <= min(wins) + 1e-12, (name, successes, credit, shaping, a)
        if not shaped and not wins:
            assert max(map(abs, a)) < weight  # an all-fail group: the tie-break only


def test_tiebreak_orders_failures_inside_a_mixed_group_without_touching_the_success_gap():
    e = signal_ep("tiebreak", [1.0, 0.0, 0.30, 0.338], [True, False, False, False], ["g"] * 4)
    a = flat(A.dr_grpo(e)[0])
    # success signal [1, 0, 0, 0] -> [0.75, -0.25 x 3]; the failures' credit 0, 0.3, 0.338 (mean 0.2127) adds 0.1 x
    # (credit - mean): the success, alone in its class, gets nothing
    assert a == pytest.approx([0.75, -0.25 - 0.02127, -0.25 + 0.00873, -0.25 + 0.01253], abs=1e-5)


def test_reward_signal_tiebreak_needs_an_algorithm_with_one_advantage_per_episode():
    for name, algo in ALGORITHMS.items():
        per_episode = algo.advantages in GROUP_ALGORITHMS.values()
        assert (name in TIEBREAK_ALGORITHMS) == per_episode, name
        if per_episode:
            assert settings(name, reward_signal="tiebreak", tiebreak_weight=0.2).tiebreak_weight == 0.2
        else:
            with pytest.raises(ValueError, match="reward_signal"):
                TrainerConfig(algorithm=name, reward_signal="tiebreak")
    assert settings("grpo").reward_signal == "reward"  # today's behaviour unless a job asks


def test_unended_fails_makes_a_success_that_idled_to_its_turn_limit_a_failure():
    """Run 7 of the quickstart: its policy stopped calling submit after the one call that solved a terminal or slack
    task, idled to the turn limit, and was graded a success all the same; those idle turns were reinforced until
    notion's three-call answers stopped after their first call (held-out 3 of 32 -> 0)."""
    successes, credit = [True, True, True, True], [1.0, 1.0, 1.0, 1.0]
    finish = ["submit", "max_turns", "submit", "timeout"]
    assert A.trained_successes(successes, finish, unended_fails=False) == successes
    trained = A.trained_successes(successes, finish, unended_fails=True)
    assert trained == [True, False, True, False]
    assert A.trained_successes([True, False], ["text", "submit"], True) == [True, False]  # prose ends it too
    assert A.trained_successes([True, True], ["context", "error"], True) == [False, False]
    for name, fn in GROUP_ALGORITHMS.items():
        before = flat(fn(signal_ep("tiebreak", credit, successes, ["g"] * 4))[0])
        assert before == [0.0] * 4, name  # all succeeded alike: nothing tells submitting from idling
        after = flat(fn(signal_ep("tiebreak", credit, trained, ["g"] * 4))[0])
        assert after[0] == after[2] > 0 > after[1] == after[3], name


def test_unended_fails_reads_success_so_it_refuses_the_reward_signal():
    assert settings("grpo", reward_signal="tiebreak", unended_fails=True).unended_fails
    assert not settings("grpo").unended_fails  # graded as it stands unless a job asks
    with pytest.raises(ValueError, match="unended_fails"):
        TrainerConfig(reward_signal="reward", unended_fails=True)


def test_the_job_trains_on_the_successes_unended_fails_gives():
    """RLJob.rl_rows: in a group where every episode succeeded, the one cut at its turn limit gets a negative advantage
    on each of its tokens with unended_fails, none without."""
    from sandforge.config import JobConfig
    from sandforge.job.rl_job import RLJob
    from sandforge.types import Reward, Task, Trajectory

    def episode(finish):
        task = Task(id="t", env="terminal", family="f", seed=0, instruction="")
        return Trajectory(task=task, group="0/t", reward=Reward(1.0, True), finish_reason=finish,
                          token_ids=[5, 6, 7, 8], loss_mask=[0, 1, 1, 1], logprobs=[0.0] * 4)

    job = RLJob.__new__(RLJob)
    ok = [episode("submit"), episode("max_turns"), episode("submit"), episode("submit")]
    for unended_fails in (False, True):
        job.cfg = JobConfig.model_validate({"trainer": {"reward_signal": "tiebreak", "unended_fails": unended_fails}})
        job.settings = resolve(job.cfg.trainer, 4)
        rows, _ = job.rl_rows(ok)
        cut = [a for a, m in zip(rows[1].advantages, rows[1].loss_mask) if m]
        if unended_fails:
            submitted = [a for r in (rows[0], rows[2], rows[3]) for a, m in zip(r.advantages, r.loss_mask) if m]
            assert all(a < 0 for a in cut) and all(a > 0 for a in submitted)
            assert job.successes(ok) == [True, False, True, True]  # what dynamic sampling reads too
        else:
            assert cut == [0.0] * 3


def test_overlong_penalty_by_hand():
    # budget 100, buffer 20: free up to 80 tokens, then linear to -1 at 100
    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 90, 100, 120)] == pytest.approx([0, 0, -0.5, -1, -1])
    assert overlong_penalty(95, 100, 20, factor=2.0) == pytest.approx(-1.5)
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off


# ---------------------------------------------------------------- through the trainer's own micro-batch code
class TinyLM(torch.nn.Module):
    """The policy interface at toy size: each position sees the mean embedding of its prefix."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)

    def forward(self, ids, attention_mask=None, return_hidden=False, logits_at=None):
        x = self.embed(ids)
        h = torch.tanh(x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[:, None])
        logits = self.head(h if logits_at is None else h[:, logits_at])
        return SimpleNamespace(logits=logits, aux_loss=torch.zeros(()), hidden=h if return_hidden else None)


class Engine(torch.nn.Module):
    """Stands in for the DeepSpeed engine: calls through to ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def fake_rank(model, s, head=None, temperature=1.0):
    """What ``TrainerRank._micro_batch_loss`` reads from its rank, without DeepSpeed or torch.distributed."""
    import copy

    from sandforge.trainer.rank import TrainerRank

    rank = SimpleNamespace(engine=Engine(model), reference=copy.deepcopy(model), settings=s, value_head=head,
                           cfg=TrainerConfig(), temperature=temperature, device=torch.device("cpu"), trunk=None)
    rank.layout = TrainerRank.layout.__get__(rank)  # the tiny model has no pack_align: one row per sequence
    return rank


def rows_for(n=5):
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        length = 5 + 2 * i
        ids = torch.randint(1, 32, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        mask[3] = 0  # a tool-output token in the middle
        rows.append(TrainingRow(token_ids=ids, loss_mask=mask,
                                logprobs=(torch.randn(length, generator=g) * 0.1 - 3).tolist(),
                                advantages=[float(i % 3 - 1)] * length,
                                returns=torch.rand(length, generator=g).tolist()))
    return rows


@pytest.mark.parametrize("algorithm, loss_agg", [
    ("grpo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("grpo", "seq-mean-token-sum"), ("gspo", None),
    ("cispo", None), ("ppo", None),
])
def test_one_or_three_micro_batches_give_the_same_gradient(algorithm, loss_agg):
    model = TinyLM()
    s = settings(algorithm, budget=16, loss_agg=loss_agg, kl_coef=0.05, entropy_coef=0.01, tis_cap=1.05)
    head = torch.nn.Linear(16, 1) if s.algorithm.value_head else None
    rank = fake_rank(model, s, head, temperature=0.7)
    with torch.no_grad():
        for p in model.parameters():  # move the policy away from its reference, so the KL term has a gradient
            p.add_(torch.randn_like(p) * 0.1)
    rows = rows_for()
    totals = Totals(tokens=sum(sum(r.loss_mask) for r in rows), sequences=len(rows))
    params = list(model.parameters()) + (list(head.parameters()) if head else [])
    grads, losses = [], []
    for n in (1, 3):
        for p in params:
            p.grad = None
        total = 0.0
        for part in split_micro_batches(rows, n):
            loss, _, _ = TrainerRank._micro_batch_loss(rank, part, totals, "rl")
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # a mean of micro-batch means would not agree
    wrong = sum(TrainerRank._micro_batch_loss(rank, part, Totals(sum(sum(r.loss_mask) for r in part), len(part)),
                                              "rl")[0].item() for part in split_micro_batches(rows, 3)) / 3
    assert wrong != pytest.approx(losses[0], rel=1e-3)


def test_token_scores_entropy_and_hidden_line_up_with_the_logprobs():
    from sandforge.models.sampling import token_logprobs, token_scores

    from sandforge.models.k3.model import K3Config, K3Model

    torch.manual_seed(0)
    model = K3Model(K3Config(vocab_size=32, d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16, q_latent=16,
                             kv_latent=8, kda_low_rank=8, n_experts=4)).eval()
    ids, attn = torch.tensor([[1, 5, 7, 9], [2, 4, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        s = token_scores(model, ids, attn, temperature=0.5, entropy=True, hidden=True)
        lp, _ = token_logprobs(model, ids, attn, temperature=0.5)
        out = model(ids, attention_mask=attn, return_hidden=True)
    assert torch.equal(s.logprobs, lp)
    p = torch.softmax(out.logits[0, 1] / 0.5, -1)  # token 2 is predicted at position 1
    assert s.entropy[0, 2].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-5)
    assert torch.equal(s.hidden[0, 2], out.hidden[0, 1])
    assert s.entropy[:, 0].eq(0).all() and s.entropy[1, 2:].eq(0).all() and s.hidden[1, 2:].eq(0).all()
    graded = token_scores(model, ids, attn, temperature=0.5, entropy=True)
    metric = token_scores(model, ids, attn, temperature=0.5, entropy="metric")  # no grad: nothing kept for backward
    assert graded.entropy.requires_grad and not metric.entropy.requires_grad and metric.logprobs.requires_grad
    assert torch.allclose(metric.entropy, s.entropy) and torch.allclose(graded.entropy.detach(), s.entropy)


def test_micro_batches_cover_every_row_once():
    rows = [TrainingRow(token_ids=[0] * n, loss_mask=[1] * n) for n in [5, 1, 9, 3, 7]]
    parts = split_micro_batches(rows, 2)
    assert len(parts) == 2
    assert sorted(len(r.token_ids) for p in parts for r in p) == [1, 3, 5, 7, 9]
    assert split_micro_batches(rows[:1], 3)[1:] == [[], []]


def test_padded_micro_batches_take_runs_of_similar_length():
    rows = [TrainingRow(token_ids=[0] * n, loss_mask=[1] * n) for n in (100, 2400, 300, 2300, 500, 900, 120, 2200)]
    parts = split_micro_batches(rows, 3, padded=True)
    assert [[len(r.token_ids) for r in p] for p in parts] == [[2400, 2300, 2200], [900, 500, 300], [120, 100]]
    padded = sum(len(p) * max(len(r.token_ids) for r in p) for p in parts)
    dealt = sum(len(p) * max(len(r.token_ids) for r in p) for p in split_micro_batches(rows, 3))
    assert padded < 0.6 * dealt  # the forward's slots: 10.1k instead of 18.5k
    assert split_micro_batches(rows[:1], 3, padded=True)[1:] == [[], []]
