"""gymnasium: every environment (the built-ins and an installed plugin's) is registered under an id, ``check_env``
passes on each in real containers, sampled actions are valid tool calls, and the step that ends an episode returns the
reward ``run_episode`` records for the same actions (both grade through ``score_task``).

Unit tests (no Docker) pin registration, the spaces and what a malformed action becomes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium
import pytest
from agent_fakes import CHAT
from gymnasium.utils.env_checker import check_env
from test_plugins import plugin_installed, plugin_path  # noqa: F401 - fixtures: the example plugin, pip-installed

from sandforge.config import RolloutConfig
from sandforge.environments.base import ObservationText, ToolCallSpace, ToolEnv
from sandforge.environments.gym_registry import GYM_IDS, gym_id, register_environments
from containers import list_run_containers
from sandforge.environments.tools import tool
from sandforge.registry import environment
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.gym_envs import DEFAULT_MAX_OBSERVATION
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall
from sandforge.verifiers.checks import score_task

ROOT = Path(__file__).resolve().parents[1]
HARBOR_TASK = ROOT / "tests" / "data" / "harbor" / "hello-file"
IDS = {**GYM_IDS, "notes": "sandforge/Notes-v0"}  # notes: the example plugin (examples/plugin_env)
# What each id is made with in these tests; the others run their first family's seed 0.
ARGS = {"terminal": {"family": "count_words", "seed": 3}, "harbor": {"task": str(HARBOR_TASK)}}


def make(name: str, request, **kwargs):
    """``gymnasium.make`` of ``name``'s id with the test's arguments (the plugin installed first for ``notes``)."""
    if name == "notes":
        request.getfixturevalue("plugin_installed")
        register_environments()
    return gymnasium.make(IDS[name], **{**ARGS.get(name, {}), **kwargs})


class Counter(ToolEnv):
    """Tools of every argument type, none of which can fail: whether a call ran is the dispatcher's verdict alone."""

    @tool
    def bump(self, by: int, note: str = "", loud: bool = False) -> str:
        """Add to the counter."""
        return f"+{by}"

    @tool
    def scale(self, x: float) -> str:
        """Scale."""
        return str(x)

    @tool
    def shout(self, text: str) -> str:
        """Say it long."""
        return "x" * 10_000 + text

    @tool
    def submit(self) -> str:
        """Finish."""
        self.end_episode()
        return "done"


# --- registration and spaces (no Docker) -----------------------------------------------------------------------------


def test_importing_the_environments_registers_every_built_in_without_importing_them():
    code = ("import sys, gymnasium, sandforge.environments\n"
            "ids = sorted(k for k in gymnasium.registry if k.startswith('sandforge/'))\n"
            "heavy = [m for m in sys.modules if m in ('docker', 'pydantic') or m.endswith('.env')]\n"
            "print(ids, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    ids, heavy = out.rsplit("] [", 1)
    assert set(GYM_IDS.values()) <= set(eval(ids + "]")), out
    assert heavy.strip() == "]", f"registering imported {heavy}"
    spec = gymnasium.spec("sandforge/Terminal-v0")
    assert (spec.entry_point, spec.kwargs) == ("sandforge.rollout.gym_envs:make_env", {"env": "terminal"})


def test_an_installed_plugin_is_registered_by_its_entry_point_name(plugin_installed):  # noqa: F811
    assert register_environments()["notes"] == "sandforge/Notes-v0"
    assert gymnasium.spec("sandforge/Notes-v0").kwargs == {"env": "notes"}
    assert gym_id("my_env-2") == "sandforge/MyEnv2-v0" and gym_id("repo") == "sandforge/Repo-v0"


@pytest.mark.parametrize("name", IDS)
def test_sampled_actions_are_calls_of_the_envs_tools_with_arguments_of_their_types(name, request):
    env = make(name, request, image="unused").unwrapped  # an image tag given: nothing is built or started
    space = env.action_space
    assert isinstance(space, ToolCallSpace) and isinstance(env.observation_space, gymnasium.spaces.Text)
    assert env.observation_space.max_length == max(DEFAULT_MAX_OBSERVATION, len(env.task.instruction))
    assert env.task.instruction in env.observation_space and "ünïcode \x1b[0m\n" in env.observation_space
    space.seed(7)
    samples = [space.sample() for _ in range(300)]
    schemas = {t["name"]: t["parameters"] for t in env.tools}
    assert {s.name for s in samples} == set(schemas)  # every tool gets sampled
    kinds = {"string": str, "integer": int, "number": float, "boolean": bool}
    for s in samples:
        assert s in space, s
        props = schemas[s.name]["properties"]
        assert set(schemas[s.name]["required"]) <= set(s.arguments) <= set(props)
        assert all(type(v) is kinds[props[k]["type"]] for k, v in s.arguments.items()), s
    space.seed(7)
    assert [space.sample() for _ in range(300)] == samples
    assert env.task.solution and all(call in space for call in env.task.solution)


def test_the_action_space_holds_exactly_the_calls_the_env_runs():
    env = Counter()
    env.reset()
    calls = [ToolCall("bump", {"by": 2}), ToolCall("bump", {"by": 2, "note": "n", "loud": True}),
             ToolCall("bump", {}), ToolCall("bump", {"by": "2"}), ToolCall("bump", {"by": True}),
             ToolCall("bump", {"by": 2.0}), ToolCall("bump", {"by": 1, "extra": 1}), ToolCall("scale", {"x": 3}),
             ToolCall("scale", {"x": 0.5}), ToolCall("scale", {"x": False}), ToolCall("nope"),
             ToolCall("bump", [2]), ToolCall("submi")]
    for call in calls:
        assert (call in env.action_space) == env.step(call)[4]["executed"], call
    env.action_space.seed(0)
    for _ in range(50):
        _, _, terminated, _, info = env.step(env.action_space.sample())
        assert info["executed"], info
        if terminated:
            env.reset()


@pytest.mark.parametrize("action", [None, 42, "bash ls", b"\x00", {"name": 3}, {"name": "bump"},
                                    {"name": "bump", "arguments": "by=1"}, ToolCall(["bump"]), ToolCall(None),
                                    ToolCall("bump", None), ToolCall("bump", {"by": float("nan")}),
                                    [ToolCall("submit")]])
def test_a_malformed_action_is_an_error_observation_not_an_exception(action):
    env = Counter()
    env.reset()
    observation, reward, terminated, truncated, info = env.step(action)
    assert observation.startswith("Error: ") and info["executed"] is False and info["error"] in observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.step({"name": "bump", "arguments": {"by": 1}})[0] == "+1"  # the episode goes on; dicts are calls too


def test_observations_are_cut_to_the_observation_space_keeping_head_and_tail():
    env = Counter(max_observation=200)
    env.reset()
    observation = env.step(ToolCall("shout", {"text": "THE END"}))[0]
    assert len(observation) <= 200 and observation in env.observation_space
    assert observation.startswith("xxxx") and observation.endswith("THE END") and "was cut" in observation
    assert Counter().step(ToolCall("shout", {"text": "!"}))[0] == "x" * 10_000 + "!"  # the agent loop cuts its own
    assert DEFAULT_MAX_OBSERVATION == RolloutConfig().max_tool_output


def test_steps_past_max_steps_truncate_and_the_end_is_final():
    env = Counter(max_steps=2)
    env.reset()
    assert env.step(ToolCall("bump", {"by": 1}))[2:4] == (False, False)
    assert env.step(ToolCall("bump", {"by": 1}))[2:4] == (False, True)
    observation, reward, terminated, _, info = env.step(ToolCall("bump", {"by": 1}))
    assert terminated and reward == 0.0 and info["executed"] is False and "episode is over" in observation
    env.reset()
    assert env.step(ToolCall("submit"))[2:4] == (True, False)


def test_make_says_which_id_a_task_belongs_to():
    terminal = environment("terminal").make_task()("write_file", 1)
    with pytest.raises(ValueError, match="is a 'terminal' task: make sandforge/Terminal-v0"):
        gymnasium.make("sandforge/Repo-v0", task=terminal, image="unused")
    with pytest.raises(ValueError, match="Harbor-v0 has no seeded tasks: pass task="):
        gymnasium.make("sandforge/Harbor-v0", image="unused")
    with pytest.raises(ValueError, match="only sandforge/Harbor-v0 takes"):
        gymnasium.make("sandforge/Terminal-v0", task=str(HARBOR_TASK), image="unused")
    two_step = Path(__file__).parent / "data" / "harbor" / "shapes" / "two-step"  # one instruction per gym episode
    with pytest.raises(ValueError, match=r"has 2 steps \(write-notes, sort-notes\): a gymnasium env runs one"):
        gymnasium.make("sandforge/Harbor-v0", task=str(two_step), image="unused")
    env = gymnasium.make("sandforge/Terminal-v0", task=dataclasses.asdict(terminal), image="unused").unwrapped
    assert env.task == terminal and env.score is score_task  # the agent loop's grader, not a copy of it
    assert isinstance(env.observation_space, ObservationText)


# --- in containers ---------------------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.parametrize("name", IDS)
def test_check_env_passes(name, request, run_id, docker_client):
    env = make(name, request, run_id=run_id)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
    finally:
        env.close()
    assert [str(w.message) for w in caught if "gymnasium" in w.filename] == []
    assert list_run_containers(run_id, docker_client) == []


def play(env, calls: list[ToolCall]) -> tuple[list[float], dict]:
    """Step ``calls`` through ``env`` from a reset; the rewards of each step and the last step's info."""
    env.reset(seed=0)
    rewards, info = [], {}
    for i, call in enumerate(calls):
        _, reward, terminated, truncated, info = env.step(call)
        rewards.append(reward)
        assert terminated == (i == len(calls) - 1) and not truncated, (call, info)
    return rewards, info


@pytest.mark.docker
@pytest.mark.parametrize("name", IDS)
def test_the_last_step_returns_the_reward_run_episode_records_for_the_same_actions(name, request, run_id,
                                                                                   docker_client):
    env = make(name, request, run_id=run_id)
    inner = env.unwrapped
    task = inner.task
    limits = EpisodeLimits(max_turns=len(task.solution) + 2, max_context=65536, max_new_tokens=8192,
                           stop_ids=CHAT.stop_ids)
    try:
        for calls, expected in ((task.solution, 1.0), ([ToolCall("submit")], 0.0)):
            rewards, info = play(env, calls)
            # the agent loop, with an env made as a rollout worker makes it (no grader of its own)
            agent_env = type(inner)(task, inner.sandbox_spec, run_id, exec_timeout=inner.exec_timeout,
                                    client=docker_client)
            replayed = dataclasses.replace(task, solution=calls)
            traj = asyncio.run(run_episode(task, agent_env, scripted_policy(replayed, CHAT), CHAT, limits, "g"))
            assert not traj.failed, traj.failure
            made = [(c.name, c.arguments) for t in traj.turns for c in t.tool_calls]
            assert traj.finish_reason == "submit" and made == [(c.name, c.arguments) for c in calls]
            assert rewards == [0.0] * (len(calls) - 1) + [traj.reward.value] and rewards[-1] == expected
            assert info["reward"] == dataclasses.asdict(traj.reward)
    finally:
        env.close()
    assert list_run_containers(run_id, docker_client) == []


@pytest.mark.docker
def test_a_truncated_episode_is_graded_and_bad_calls_in_a_real_sandbox_are_observations(run_id):
    env = gymnasium.make("sandforge/Terminal-v0", family="count_words", seed=3, max_steps=4, run_id=run_id)
    try:
        instruction, _ = env.reset(seed=1)
        assert instruction == env.unwrapped.task.instruction
        bad = [ToolCall("bash", {"command": "echo a\x00b"}), ToolCall("write_file", {"path": "x", "content": "\ud800"})]
        for call in bad:
            observation, reward, terminated, truncated, info = env.step(call)
            assert observation.startswith("Error: ") and (reward, terminated, truncated) == (0.0, False, False)
        observation, *_ = env.step({"name": "bash", "arguments": {"command": env.unwrapped.task.solution[0]
                                                                   .arguments["command"]}})
        assert observation.endswith("[exit code 0]")
        _, reward, terminated, truncated, info = env.step(ToolCall("read_file", {"path": "/workspace/answer.txt"}))
        assert (reward, terminated, truncated) == (1.0, False, True) and info["reward"]["success"] is True
    finally:
        env.close()


@pytest.mark.docker
def test_a_grader_that_fails_gives_zero_and_says_why_as_run_episode_fails_the_episode(run_id, docker_client):
    task = environment("terminal").make_task()("write_file", 2)
    task = dataclasses.replace(task, checks=[{"verifier": "no_such_verifier"}])
    env = gymnasium.make("sandforge/Terminal-v0", task=task, run_id=run_id)
    try:
        env.reset()
        _, reward, terminated, _, info = env.step(ToolCall("submit"))
        assert (reward, terminated) == (0.0, True) and "unknown verifier 'no_such_verifier'" in info["failure"]
        inner = env.unwrapped
        agent_env = type(inner)(task, inner.sandbox_spec, run_id, client=docker_client)
        limits = EpisodeLimits(max_turns=2, max_context=8192, max_new_tokens=512, stop_ids=CHAT.stop_ids)
        traj = asyncio.run(run_episode(task, agent_env, scripted_policy(dataclasses.replace(task, solution=[
            ToolCall("submit")]), CHAT), CHAT, limits, "g"))
        assert traj.failed and traj.reward.value == 0.0 and "unknown verifier 'no_such_verifier'" in traj.failure
    finally:
        env.close()
