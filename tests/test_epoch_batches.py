"""The warm start's batches pass over the demonstrations in epochs (job/cold_start.py ``epoch_batches``)."""

import random
from collections import Counter

from sandforge.job.cold_start import epoch_batches


def test_one_pass_sees_every_demonstration_once():
    batches = epoch_batches(256, 8, 32, random.Random(0))
    seen = Counter(i for b in batches for i in b)
    assert len(batches) == 32 and all(len(b) == 8 for b in batches)
    assert sorted(seen) == list(range(256)) and set(seen.values()) == {1}


def test_epochs_reshuffle_and_no_batch_repeats_an_item():
    batches = epoch_batches(10, 4, 25, random.Random(1))  # 100 draws: 10 epochs, batches straddling them
    assert all(len(set(b)) == len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    assert set(Counter(flat).values()) == {10}
    # no item is drawn a second time before every item was drawn once, at any point of the run
    counts = Counter()
    for i in flat:
        counts[i] += 1
        assert counts[i] - min(counts[j] for j in range(10)) <= 1
    assert flat[:10] != flat[10:20]  # each epoch its own shuffle


def test_fewer_items_than_a_batch_and_none():
    assert all(sorted(b) == [0, 1, 2] for b in epoch_batches(3, 8, 2, random.Random(0)))
    assert epoch_batches(0, 8, 5, random.Random(0)) == []


def test_independent_draws_would_leave_demonstrations_unseen():
    """Why: the old per-step ``rng.sample`` left about a third of a one-pass budget unseen."""
    rng = random.Random(0)
    seen = {i for _ in range(32) for i in rng.sample(range(256), 8)}
    assert len(seen) < 200


def test_demonstrations_come_in_the_order_their_tasks_were_drawn():
    """The replays finish in whatever order the workers end them (longest first starts the long ones early); the
    demonstrations, and so the SFT batches, follow the draw: the same seed gives the same warm start."""
    from types import SimpleNamespace

    from sandforge.config import JobConfig
    from sandforge.job.cold_start import verified_demonstrations
    from sandforge.types import Reward, Task, Trajectory

    tasks = [Task(id=f"t{i}", env="terminal", family="f", seed=i, instruction="") for i in range(6)]

    def collect(drawn, groups, scripted, label):
        out = [Trajectory(task=t, group=g, reward=Reward(1.0, t.id != "t3")) for t, g in zip(drawn, groups)]
        return out[::2][::-1] + out[1::2]  # finished out of order

    printed: list = []
    job = SimpleNamespace(cfg=JobConfig.model_validate({"warmup": {"episodes": 6}}),
                          sampler=SimpleNamespace(sample=lambda n, phase: tasks[:n]), collect=collect,
                          logger=SimpleNamespace(log_trajectories=lambda *a: None),
                          bar=SimpleNamespace(console=SimpleNamespace(print=lambda *a, **k: printed.append(a))))
    demos, tried = verified_demonstrations(job)
    assert [d.task.id for d in demos] == ["t0", "t1", "t2", "t4", "t5"] and tried == 6  # t3 did not verify
