"""The repo environment: generated buggy packages, their tools, and whole episodes graded by the repo_tests verifier.

Reference solutions replayed through the real agent loop score 1, an agent that only submits scores 0, and the same
seed gives the same task and the same scores.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from pathlib import Path
import seeded
from seeded import repo_task as make_task

from sandforge.environments.repo.env import RepoEnv
from sandforge.environments.repo.functions import FUNCTIONS
from sandforge.environments.repo.tasks import FAMILIES, _renamed, _variables
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import build_images
from containers import list_run_containers
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import Task, ToolCall
from sandforge.verifiers.checks import score_task

CHAT = ChatFormat(ByteTokenizer())


@pytest.fixture(scope="module")
def repo_spec(docker_client) -> SandboxSpec:
    return SandboxSpec(image=build_images(["repo"], client=docker_client, show_progress=False)["repo"])


# --- tasks, no Docker ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tasks_are_deterministic_and_split_apart(family):
    assert make_task(family, 17) == make_task(family, 17)
    assert len({repr(make_task(family, s).setup) for s in range(20)}) > 15
    train, held = make_task(family, 5), make_task(family, 5, "heldout")
    assert train.id == f"repo/{family}/5" and held.id == f"repo/{family}/heldout/5"
    assert (train.env, train.family, train.split, held.split) == ("repo", family, "train", "heldout")
    train_names = set().union(*(_names(make_task(family, seed)) for seed in range(200)))
    for seed in range(30):  # held-out repositories never show a train package, module, function or parameter name
        held_names = _names(make_task(family, seed, "heldout"))
        assert held_names and not held_names & train_names


def _names(task: Task) -> set[str]:
    """Every name a repository defines: its package, module files, functions and their parameters."""
    files = task.setup["files"]
    names = {path.split("/")[-1].removesuffix(".py") for path in files if path.endswith(".py")}
    for text in files.values():
        for fn, params in re.findall(r"^def (\w+)\(([^)]*)\)", text, re.M):
            names |= {fn, *(p.strip() for p in params.split(","))}
    return (names | {task.checks[0]["package"]}) - {"", "__init__", "same", "got", "want"} - {
        n for n in names if n.startswith("test_")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_task_holds_one_bug_its_fix_and_tests_kept_apart(family):
    for seed in range(10):
        task = make_task(family, seed)
        (check,) = task.checks
        files, hidden = task.setup["files"], check["hidden_tests"]
        read, fix, submit = straight(task)
        assert submit == ToolCall("submit") and fix.name == "str_replace"
        # the module is named in the report and read before the line the policy has just seen is replaced
        assert read == ToolCall("read_file", {"path": fix.arguments["path"]}) and read.arguments["path"] in \
            task.instruction
        assert files[fix.arguments["path"]].count(fix.arguments["old"]) == 1  # the edit the policy must make
        assert check["files"] == files and not set(hidden) & set(files)  # hidden tests are never set up
        assert check["fail_to_pass"] and check["pass_to_pass"]
        assert not set(check["fail_to_pass"]) & set(check["pass_to_pass"])
        # the bug shows in a visible test, and at least one hidden test catches it too
        assert any("_hidden.py::" not in t for t in check["fail_to_pass"])
        assert any("_hidden.py::" in t for t in check["fail_to_pass"])
        for test_id in check["fail_to_pass"] + check["pass_to_pass"]:
            path, name = test_id.split("::")
            assert f"def {name}():" in {**files, **hidden}[path]
        assert "Bug report" in task.instruction and "should return" in task.instruction
        assert task.setup["commands"] and "git init" in task.setup["commands"][0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_function_with_the_bug_kind_is_drawn_and_generates(family):
    # the generator checks each drawn bug against inputs that expose it; this makes every template face that check
    fixes = {_unnamed(straight(make_task(family, seed))[1].arguments["new"]) for seed in range(150)}
    templates = {_unnamed(_renamed(f, ["p"] * len(_variables(f))).bugs[family][0])
                 for f in FUNCTIONS if family in f.bugs}
    assert fixes == templates and len(templates) == sum(family in f.bugs for f in FUNCTIONS)


def _unnamed(line: str) -> str:
    """A fix line with its generated names (syllable words; ``p`` for a template's parameters) made ``X``."""
    return re.sub(r"\b(?:p|(?:[bdfgklmnprstvz][aeiou])+)\b", "X", line)


def test_tests_compare_types_not_just_equality():
    from sandforge.environments.repo.tasks import same

    class Anything:
        def __eq__(self, other):
            return True

    class Int(int):
        def __eq__(self, other):
            return True

    assert same([1, [2.0, "a"]], [1, [2.0, "a"]]) and not same(2, 2.0) and not same(True, 1)
    assert not same(Anything(), 3) and not same(Int(5), 3) and not same([Anything()], [3])


def test_unknown_family_and_split_are_explained():
    with pytest.raises(ValueError, match="unknown repo task family 'typo'.*off_by_one"):
        make_task("typo", 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_task("off_by_one", 1, "test")


def test_tools_are_the_swe_agent_set():
    env = RepoEnv(make_task("off_by_one", 1), SandboxSpec(image="unused"), "r")
    assert sorted(t["name"] for t in env.tools) == ["bash", "read_file", "run_tests", "str_replace", "submit"]


# --- episodes in real containers ----------------------------------------------------------------------------------


def _limits() -> EpisodeLimits:
    return EpisodeLimits(max_turns=6, max_context=1 << 16, max_new_tokens=4096, stop_ids=CHAT.stop_ids)


def straight(task: Task) -> list[ToolCall]:
    """The reference solution without its stumble (environments/recovery.py): read, fix, submit."""
    return seeded.straight(task).solution


def test_about_half_the_references_stumble_once_and_then_go_straight():
    """A stumble (environments/recovery.py) is one call the environment rejects, put just before the call it gets
    wrong: a read of the module's name outside its package, or the fix without ``new``."""
    kinds = []
    for seed in range(60):
        task = make_task("wrong_operator", seed)
        calls, plain = task.solution, straight(task)
        assert len(plain) == 3 and len(calls) - len(plain) in (0, 1)
        if len(calls) == 4:
            (extra,) = [c for c in calls if c not in plain]
            at = calls.index(extra)
            assert calls[at + 1].name == extra.name and calls[at + 1] in plain  # then the right call of that tool
            kinds.append("wrong_path" if extra.name == "read_file" else "missing_new")
    assert 15 <= len(kinds) <= 45 and set(kinds) == {"wrong_path", "missing_new"}
    assert make_task("wrong_operator", 3, "heldout").solution == make_task("wrong_operator", 3, "heldout").solution


def _play(task: Task, spec: SandboxSpec, run_id: str, client) -> tuple:
    """One episode through the real agent loop with the task's solution replayed as model output."""
    env = RepoEnv(task, spec, run_id, client=client)
    traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, _limits(), "g"))
    assert not traj.failed, traj.failure
    return traj.reward, [obs for turn in traj.turns for obs in turn.observations]


@pytest.mark.docker
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_scores_one_doing_nothing_zero_and_runs_repeat(family, repo_spec, run_id, docker_client):
    task = make_task(family, 7)
    solved, observations = _play(task, repo_spec, run_id, docker_client)
    assert (solved.value, solved.success) == (1.0, True), solved.reason
    read, edited, submitted = observations[-3:]  # after a stumble's error, if its reference has one
    assert read == task.setup["files"][straight(task)[0].arguments["path"]]  # the module, in full, before the edit
    assert edited.startswith("edited ") and submitted == "submitted"
    assert solved.breakdown["repo_tests:0/fail_to_pass"] == 1.0

    idle = replace(task, solution=[ToolCall("submit")])
    nothing, _ = _play(idle, repo_spec, run_id, docker_client)
    assert (nothing.value, nothing.success) == (0.0, False)
    assert nothing.breakdown["repo_tests:0/fail_to_pass"] == 0.0
    assert nothing.breakdown["repo_tests:0/pass_to_pass"] == 1.0  # the rest of the package was never broken
    assert task.checks[0]["fail_to_pass"][0] in nothing.reason

    again = make_task(family, 7)
    assert again == task
    assert _play(again, repo_spec, run_id, docker_client)[0] == solved
    assert list_run_containers(run_id, docker_client) == []  # episode and grading containers are all gone


@pytest.mark.docker
def test_a_stumbling_reference_is_rejected_once_still_scores_one_and_its_stumble_is_not_imitated(
        repo_spec, run_id, docker_client):
    """Each kind of stumble is an error observation in the real sandbox, the episode still verifies, and the warm
    start's rows (job/cold_start.py ``imitated``) train on every reply but the stumble's."""
    from sandforge.job.cold_start import imitated

    seen = set()
    for seed in range(40):
        task = make_task("wrong_operator", seed)
        kind = next((c.name for c in task.solution if c not in straight(task)), None)
        if kind is None or kind in seen:
            continue
        seen.add(kind)
        env = RepoEnv(task, repo_spec, run_id, client=docker_client)
        traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, _limits(), "g"))
        assert not traj.failed and traj.reward.success, (task.id, traj.reward)
        erred = [t for t in traj.turns if t.tool_errors]
        assert len(erred) == 1 and erred[0].observations[0].startswith("Error:"), [t.observations for t in traj.turns]
        taught = imitated(traj).loss_mask
        for turn in traj.turns:
            span = taught[turn.prompt_tokens: turn.prompt_tokens + turn.generated_tokens]
            assert span == [0 if turn is erred[0] else 1] * turn.generated_tokens
        assert sum(taught) == sum(traj.loss_mask) - erred[0].generated_tokens
    assert seen == {"read_file", "str_replace"}


@pytest.mark.docker
def test_str_replace_and_run_tests_in_the_sandbox(repo_spec, run_id, docker_client):
    task = make_task("wrong_operator", 2)
    fix = straight(task)[1].arguments
    env = RepoEnv(task, repo_spec, run_id, client=docker_client)
    try:
        obs, info = env.reset()
        assert obs == task.instruction and info["task_id"] == task.id
        visible_failure = task.checks[0]["fail_to_pass"][0].split("::")[1]
        before = env.step(ToolCall("run_tests"))[0]
        assert f"FAILED {task.checks[0]['fail_to_pass'][0]}" in before and "1 failed" in before
        assert "hidden" not in before  # run_tests sees the visible tests only

        missing = env.step(ToolCall("str_replace", {"path": fix["path"], "old": "no such text", "new": "x"}))
        assert missing[0].startswith("Error: str_replace: old does not occur") and not missing[4]["executed"]
        twice = env.step(ToolCall("str_replace", {"path": fix["path"], "old": "def ", "new": "def  "}))
        assert "occurs" in twice[0] and "times" in twice[0] and twice[0].startswith("Error:")
        nofile = env.step(ToolCall("str_replace", {"path": "nope.py", "old": "a", "new": "b"}))
        assert nofile[0] == "Error: str_replace: no such file: nope.py"
        assert env.step(ToolCall("write_file", {"path": "x", "content": "y"}))[0].startswith("Error: unknown tool")

        edited = env.step(ToolCall("str_replace", fix))[0]
        assert edited.startswith(f"edited {fix['path']} at line ")
        source = env.step(ToolCall("read_file", {"path": fix["path"]}))[0]
        assert fix["new"] in source and fix["old"] not in source
        after = env.step(ToolCall("run_tests"))[0]
        assert "failed" not in after and " passed" in after and visible_failure not in after
        assert env.step(ToolCall("submit"))[2] is True
        assert score_task(env.sandbox, task).success
    finally:
        env.close()


@pytest.mark.docker
def test_setup_leaves_one_commit_of_the_buggy_base(repo_spec, run_id, docker_client):
    task = make_task("wrong_condition", 4)
    env = RepoEnv(task, repo_spec, run_id, client=docker_client)
    try:
        env.reset()
        git = env.step(ToolCall("bash", {"command": "git rev-list --all | wc -l; git for-each-ref | wc -l; "
                                                    "git reflog | wc -l; git status --porcelain | wc -l"}))[0]
        assert git.split() == ["1", "1", "0", "0", "[exit", "code", "0]"]  # one commit, one ref, no reflog, clean
        for path, content in task.setup["files"].items():
            assert env.sandbox.read_file(path) == content
    finally:
        env.close()


@pytest.mark.docker
@pytest.mark.slow
def test_configs_repo_yaml_trains_one_step(tmp_path, repo_spec):
    out = tmp_path / "run"
    small = ["trainer.steps=1", "warmup.steps=0", "rollout.workers=1", "rollout.concurrency=2",
             "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=16",
             "logging.wandb.mode=disabled", f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/repo.yaml", *small],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0] and rl[0]["episodes/count"] == 2
    assert rl[0]["episodes/failed"] == 0
    episodes = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and all(e["task"]["env"] == "repo" for e in episodes)
    assert all("repo_tests:0/fail_to_pass" in e["reward"]["breakdown"] for e in episodes)  # graded by repo_tests
