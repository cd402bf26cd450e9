"""Stumbles in reference solutions: demonstrations that show a tool error and the recovery from it.

A small policy gives up after its first tool error: in quickstart run 15 every held-out repo and browser episode that
hit one (a read of a file that does not exist, ``str_replace`` without ``new``, a date selected into the time field)
submitted next, because no demonstration it learnt from had ever shown an error. So a share of a family's reference
solutions stumbles the way a policy does, with a call the environment rejects, and then makes the right call. The warm
start trains on such an episode with the stumble's tokens masked (job/cold_start.py ``imitated``): the recovery after
the error message is learnt, the error itself is not.

Whether a task's reference stumbles, and how, is drawn from its id alone, never from the rng that made its values, so
no task changes but for its solution.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

STUMBLE_SHARE = 0.5  # of a family's reference solutions; the others stay straight


def stumble(task_id: str, kinds: Sequence[str]) -> str | None:
    """Which of ``kinds`` the reference solution of ``task_id`` stumbles with, or None (about half of them)."""
    rng = random.Random(f"{task_id}/stumble")
    return rng.choice(list(kinds)) if rng.random() < STUMBLE_SHARE else None
