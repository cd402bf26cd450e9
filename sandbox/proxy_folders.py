"""The host folders that carry an agent harness's proxy socket into its sandbox: one per sandbox, under
``PROXY_ROOT``, named by the sandbox's episode id (its ``sandforge.episode`` label).

A sandbox removes its own folder when it closes; a worker that died never closes it, so whoever removes a
container by its labels (the reaper, a run's cleanup) removes the folder of that episode too, and the reaper drops
folders that no container claims any more (``stale``)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Iterable

from sandforge.sandbox.spec import PROXY_ROOT

ORPHAN_AGE_S = 600.0  # a folder without a container is left this long: its sandbox may be being created


def make(episode: str) -> str:
    """A new host folder for one sandbox's proxy socket: root's, readable by all (the sandbox's user connects)."""
    path = os.path.join(PROXY_ROOT, episode)
    os.makedirs(PROXY_ROOT, mode=0o755, exist_ok=True)
    os.mkdir(path, 0o755)
    return path


def remove(episode: str | None) -> None:
    """Remove an episode's folder, if it has one (an episode id is a bare name: never a path out of the root)."""
    if episode and os.path.basename(episode) == episode and episode not in (".", ".."):
        shutil.rmtree(os.path.join(PROXY_ROOT, episode), ignore_errors=True)


def stale(claimed: Iterable[str], min_age_s: float = ORPHAN_AGE_S, now: float | None = None) -> list[str]:
    """Episodes whose folder no container claims and that are older than ``min_age_s``."""
    if not os.path.isdir(PROXY_ROOT):
        return []
    claimed, now = set(claimed), time.time() if now is None else now
    out = []
    for name in sorted(os.listdir(PROXY_ROOT)):
        try:
            old = now - os.stat(os.path.join(PROXY_ROOT, name)).st_mtime >= min_age_s
        except OSError:
            continue
        if name not in claimed and old:
            out.append(name)
    return out
