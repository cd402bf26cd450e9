"""What every episode runner shares: the episode's limits, how it fails, how it ends, its turns' sampling seeds, and
for a runner behind the recording proxy, how the proxy's rows become the trajectory and how the proxy and the engine
session are given back.

The three runners are siblings that use this module: sandforge's own agent loop (``agent.py``), an unmodified agent
harness behind the recording proxy (``harness_episode.py``) and a ``verifiers`` environment's episode run by the
library against the same proxy (``vf_episode.py``).
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from dataclasses import dataclass
from typing import Any

from sandforge.config import RolloutConfig
from sandforge.rollout.policy_client import Policy, PolicyError
from sandforge.rollout.tool_calls import ToolHang
from sandforge.types import Reward, SandboxError, Trajectory
from sandforge.verifiers.checks import VerifierError


@dataclass
class EpisodeLimits:
    max_turns: int
    max_context: int
    max_new_tokens: int
    stop_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    episode_timeout: float | None = None  # seconds; None: no limit
    max_tool_calls: int = 8
    max_tool_output: int = 4096  # characters per observation
    tool_grace: float = 60.0  # how long a tool call may outlive the deadline before the episode fails
    end_on_text: bool = False  # a reply of prose alone ends the episode (``rollout.end_on_text``)

    @classmethod
    def from_config(cls, r: RolloutConfig, stop_ids: list[int], tool_grace: float = 60.0) -> EpisodeLimits:
        return cls(max_turns=r.max_turns, max_context=r.max_context, max_new_tokens=r.max_new_tokens,
                   stop_ids=list(stop_ids), temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                   episode_timeout=r.episode_timeout, max_tool_calls=r.max_tool_calls,
                   max_tool_output=r.max_tool_output, tool_grace=tool_grace, end_on_text=r.end_on_text)


def fail(traj: Trajectory, e: Exception) -> None:
    """Mark ``traj`` failed by ``e``, its ``failure`` naming what broke: the sandbox, a verifier, the engine, a tool
    call that hung, or (anything else, a bug) the exception, whose traceback goes in the metadata."""
    traj.failed = True
    if isinstance(e, SandboxError):
        traj.failure = f"sandbox: {e}"
    elif isinstance(e, VerifierError):
        traj.failure = f"verifier: {e}"
    elif isinstance(e, PolicyError):
        traj.failure = str(e)  # "engine: ..."
    elif isinstance(e, ToolHang):
        traj.failure = f"tool: {e}"
    else:
        traj.failure = f"error: {type(e).__name__}: {e}"
        traj.metadata["traceback"] = traceback.format_exc()


def ended(traj: Trajectory, start: float) -> Trajectory:
    """The episode's last word: a failed one ends in "error" and scores 0; both say how long they took."""
    if traj.failed:
        traj.finish_reason = "error"
        if traj.reward is None:
            traj.reward = Reward(value=0.0, success=False, reason=traj.failure)
    traj.metadata["seconds"] = time.monotonic() - start
    return traj


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode's turn: distinct per turn, the same on every run with the same episode seed."""
    return (seed * 1_000_003 + turn * 0x9E3779B97F4A7C15) % 2**63


async def release(proxy: Any, policy: Policy, session: str) -> None:
    """The episode's proxy (rollout/proxy.py ``EpisodeProxy``, or None) closed (nothing more is answered or recorded) and its engine session given back."""
    if proxy is not None:
        proxy.end()
        await proxy.close()
    with contextlib.suppress(Exception):  # the engine evicts the session by itself eventually
        await policy.close_session(session)


def fill_rows(traj: Trajectory, proxy: Any) -> None:
    """The proxy's (an ``EpisodeProxy``'s) rows into the trajectory: the last as its own tokens, the ones before as ``earlier_rows``."""
    rows = copy.deepcopy(proxy.recorder.rows)  # the episode's, as they stand now
    last = rows[-1]
    traj.token_ids, traj.loss_mask, traj.logprobs = last.token_ids, last.loss_mask, last.logprobs
    traj.token_versions, traj.routed_experts = last.token_versions, last.routed_experts
    traj.earlier_rows = rows[:-1]
    traj.turns = copy.deepcopy(proxy.recorder.turns)
    traj.messages = list(proxy.recorder.history)
