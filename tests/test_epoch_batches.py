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
