"""An unmodified agent harness in a real sandbox, its model calls through the episode's recording proxy
(rollout/harness_episode.py): the bash-loop harness solves a repo task against a backend that replays a known
solution, a no-op backend scores 0, and the sandbox reaches nothing but its own proxy."""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict

import pytest
from seeded import repo_task, straight

from sandforge.config import JobConfig
from sandforge.sandbox.images import build_images, layered_images
from sandforge.rollout.harnesses import find_harness
from sandforge.sandbox.spec import PROXY_ROOT
from sandforge.rollout.worker import RolloutWorker, WorkerSetup
from sandforge.types import GenerateRequest, Message, Sample, ToolCall, Trajectory

pytestmark = pytest.mark.docker


class ReplayBackend:
    """The engine behind the proxy: answers each episode's request i with ``commands[i]`` (a bash command, or None
    for a reply without a tool call), rendered in the worker's chat format; keeps each request's prompt as text.
    ``tool`` and ``arg``: the harness's shell tool and its command's argument. A request that declares no such tool
    (OpenCode's title for the conversation, asked beside it) is answered with text and takes no command."""

    def __init__(self, commands: list[str | None], tool: str = "bash", arg: str = "command"):
        self.commands, self.tool, self.arg = list(commands), tool, arg
        self.left: dict[str, list] = {}  # per episode (engine session)
        self.chat = None
        self.prompts: list[str] = []

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        prompt = self.chat.tokenizer.decode(request.prompt_ids)
        self.prompts.append(prompt)
        left = self.left.setdefault(request.session_id, list(self.commands))
        command = left.pop(0) if left and f"{self.tool}(" in prompt else None  # declared as the chat format does
        calls = [ToolCall(self.tool, {self.arg: command})] if command else []
        ids = self.chat.render_assistant(Message(role="assistant", content="" if calls else "done", tool_calls=calls))
        return [Sample(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", version=1)]

    async def close_session(self, session_id: str) -> None:
        pass


def run(backend: ReplayBackend, tasks, run_id, docker_client, harness: str = "bash-loop", context: int = 8192,
        memory: str = "512m", **agent) -> list[Trajectory]:
    images = build_images(["repo"], client=docker_client, show_progress=False)
    job = JobConfig.model_validate({"environments": [{"name": "repo"}], "sandbox": {"warm_pool": 0, "memory": memory},
                                    "rollout": {"episode_timeout": 180, "max_context": context},
                                    "agent": {"harness": harness, **agent}})
    folder = find_harness(harness, job.agent.options).image_folder()
    if folder is not None:  # as the driver does: the harness installed on top of the env's image
        images = layered_images(docker_client, images, folder, harness)
    setup = WorkerSetup(run_id=run_id, engine="unused", images={"repo": images["repo"]}, labels={},
                        environments=tuple(job.environments), rollout=job.rollout, sandbox=job.sandbox,
                        model=job.model, agent=job.agent)
    worker = RolloutWorker(0, setup, engine=backend)
    backend.chat = worker.chat
    try:
        out = asyncio.run(worker.run_episodes([asdict(t) for t in tasks], [f"g{i}" for i in range(len(tasks))], 1))
    finally:
        worker.close()
    return [Trajectory.from_dict(d) for d in out]


def fix_commands(task) -> list[str | None]:
    """The task's reference solution (read, then str_replace) as the bash a harness would run."""
    read, edit = (c.arguments for c in straight(task).solution[:2])  # without a stumble (environments/recovery.py)
    replace = (f"python3 - <<'EOF'\nimport pathlib\np = pathlib.Path({edit['path']!r})\n"
               f"p.write_text(p.read_text().replace({edit['old']!r}, {edit['new']!r}, 1))\nEOF")
    return [f"cat {read['path']}", replace, None]


def _proxy_folders() -> set[str]:
    return set(os.listdir(PROXY_ROOT)) if os.path.isdir(PROXY_ROOT) else set()


def test_bash_loop_solves_a_repo_task_through_the_proxy_and_a_no_op_scores_0(run_id, docker_client):
    before = _proxy_folders()  # the host's: other runs' (a killed worker's, until the reaper's sweep) may be there
    task = repo_task("wrong_operator", 3)
    backend = ReplayBackend(fix_commands(task))
    solved, = run(backend, [task], run_id, docker_client)
    assert not solved.failed, solved.failure
    assert (solved.reward.value, solved.reward.success) == (1.0, True), solved.reward.reason
    assert solved.metadata["harness"] == "bash-loop" and solved.metadata["harness_exit_code"] == 0
    assert solved.finish_reason == "submit" and len(solved.turns) == 3 and not solved.earlier_rows
    # the file's text came back to the policy as the tool's result, appended to its one row
    assert "def nine" in backend.prompts[1] and backend.prompts[2].startswith(backend.prompts[1])
    assert solved.response_tokens == sum(t.generated_tokens for t in solved.turns)

    idle, = run(ReplayBackend([None]), [task], run_id, docker_client)
    assert not idle.failed, idle.failure
    assert (idle.reward.value, idle.reward.success) == (0.0, False)
    assert _proxy_folders() <= before  # every folder this test's sandboxes had went with them


def test_mini_swe_agent_unmodified_solves_a_repo_task_through_the_proxy_and_a_no_op_scores_0(run_id, docker_client):
    """mini-swe-agent 2.4.6 from PyPI, as published, in the repo image: its litellm client talks to the proxy through
    the loopback forwarder, its bash tool runs the replayed fix, and it submits the way it does."""
    task = repo_task("wrong_operator", 3)
    backend = ReplayBackend([*fix_commands(task)[:2], "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])
    solved, = run(backend, [task], run_id, docker_client, harness="mini-swe-agent")
    assert not solved.failed, solved.failure
    assert (solved.reward.value, solved.reward.success) == (1.0, True), (solved.reward.reason,
                                                                          solved.metadata.get("harness_output"))
    assert solved.metadata["harness"] == "mini-swe-agent"
    assert solved.metadata["harness_exit_code"] == 0, (solved.finish_reason, solved.metadata["harness_output"])
    assert len(solved.turns) == 3 and not solved.earlier_rows  # every reply called a tool: its history grew as sent
    assert "def nine" in backend.prompts[1]  # its tool result, as mini-swe-agent words it, reached the policy
    assert solved.response_tokens == sum(t.generated_tokens for t in solved.turns)

    idle, = run(ReplayBackend([]), [task], run_id, docker_client, harness="mini-swe-agent", max_requests=3)
    assert not idle.failed, idle.failure
    assert (idle.reward.value, idle.reward.success) == (0.0, False)


@pytest.mark.slow
@pytest.mark.parametrize("harness, tool, arg", [("claude-code", "Bash", "command"), ("codex", "exec_command", "cmd"),
                                                ("opencode", "bash", "command")])
def test_a_coding_cli_unmodified_solves_a_repo_task_through_the_proxy_and_a_no_op_scores_0(
        run_id, docker_client, harness, tool, arg):
    """Claude Code (Anthropic's Messages API), Codex (OpenAI's Responses API) and OpenCode (chat completions), their
    native binaries from the npm registry layered on the repo image: each runs the replayed fix with its own shell
    tool, and stops when the policy answers without a call. Their system prompts and tool schemas run to thousands
    or tens of thousands of tokens."""
    task = repo_task("wrong_operator", 3)
    backend = ReplayBackend(fix_commands(task), tool=tool, arg=arg)
    solved, = run(backend, [task], run_id, docker_client, harness=harness, context=200_000, memory="2g")
    assert not solved.failed, solved.failure
    assert (solved.reward.value, solved.reward.success) == (1.0, True), (solved.reward.reason,
                                                                          solved.metadata.get("harness_output"))
    assert solved.metadata["harness"] == harness
    assert solved.metadata["harness_exit_code"] == 0, (solved.finish_reason, solved.metadata["harness_output"])
    titled = harness == "opencode"  # OpenCode also asks the model for the conversation's title: a row of its own
    assert len(solved.turns) == 3 + titled and len(solved.earlier_rows) == titled  # each turn given back as sent
    assert any("def nine" in p for p in backend.prompts)  # the file it read, as the CLI words a tool result
    assert solved.response_tokens == sum(t.generated_tokens for t in solved.turns)  # the engine's tokens, no others

    idle, = run(ReplayBackend([], tool=tool, arg=arg), [task], run_id, docker_client, harness=harness,
                context=200_000, memory="2g")  # the CLIs' own runtimes take hundreds of MB
    assert not idle.failed, idle.failure
    assert (idle.reward.value, idle.reward.success) == (0.0, False)
    assert "service_stopped" not in idle.reward.zero_causes  # the forwarder stopped with the CLI: no policy service


def test_mini_swe_agent_solves_a_harbor_task_folder_through_the_proxy(run_id, docker_client):
    """A Harbor task folder (tests/data/harbor/hello-file, an image without Python), its image layered with
    mini-swe-agent by the driver's own image build, graded by its test.sh: the replayed solve.sh scores 1."""
    from sandforge.job.fleet.lifecycle import build_job_images
    from sandforge.job.task_sampler import TaskSampler

    folder = os.path.join(os.path.dirname(__file__), "data", "harbor", "hello-file")
    job = JobConfig.model_validate({"environments": [{"name": "harbor", "tasks": folder, "harbor_mode": "hardened"}],
                                    "sandbox": {"warm_pool": 0},
                                    "rollout": {"episode_timeout": 180, "max_context": 8192},
                                    "agent": {"harness": "mini-swe-agent"}})
    images = build_job_images(job)
    task, = TaskSampler(job.environments, 0).sources[0].tasks
    solve = open(os.path.join(folder, "solution", "solve.sh")).read()
    backend = ReplayBackend([solve, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])
    setup = WorkerSetup(run_id=run_id, engine="unused", images=images, labels={},
                        environments=tuple(job.environments), rollout=job.rollout, sandbox=job.sandbox,
                        model=job.model, agent=job.agent)
    worker = RolloutWorker(0, setup, engine=backend)
    backend.chat = worker.chat
    try:
        out = asyncio.run(worker.run_episodes([asdict(task)], ["g"], 1))
    finally:
        worker.close()
    traj = Trajectory.from_dict(out[0])
    assert not traj.failed, traj.failure
    assert (traj.reward.value, traj.reward.success) == (1.0, True), (traj.reward.reason,
                                                                      traj.metadata.get("harness_output"))
    assert traj.metadata["harness_exit_code"] == 0 and len(traj.turns) == 2


PROBE = r"""ls -A /run/sandforge-proxy; touch /run/sandforge-proxy/x; rm -f /run/sandforge-proxy/proxy.sock
python3 - <<'EOF'
import socket
for host, port in [("1.1.1.1", 80), ("172.17.0.1", 2375), ("10.0.0.1", 80), ("::1", 22)]:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.settimeout(2)
    print("connect", host, s.connect_ex((host, port)))
import http.client, os
c = http.client.HTTPConnection("127.0.0.1", 8391)
c.request("POST", "/v1/chat/completions", body="{}", headers={"Authorization": "Bearer not-the-token"})
print("wrong token", c.getresponse().status)
EOF"""


def test_the_sandbox_reaches_nothing_but_its_own_proxy(run_id, docker_client):
    tasks = [repo_task("wrong_operator", 3), repo_task("wrong_operator", 4)]
    backend = ReplayBackend([PROBE, None])
    trajs = run(backend, tasks, run_id, docker_client)
    assert [t.failed for t in trajs] == [False, False], [t.failure for t in trajs]
    probes = [p for p in backend.prompts if "wrong token" in p]
    assert len(probes) == 2  # one per episode, each seen by the policy
    for seen in probes:
        out = seen[seen.index("proxy.sock") :]
        assert "Read-only file system" in out  # neither a file nor a new socket goes in, the socket stays
        assert "wrong token 401" in out  # its own proxy wants its own episode's token
        connects = [line for line in out.splitlines() if line.startswith("connect ")]
        assert len(connects) == 4 and not any(line.endswith(" 0") for line in connects), connects  # network none
    # each episode's rows hold its own two generations only
    assert [t.response_tokens for t in trajs] == [sum(x.generated_tokens for x in t.turns) for t in trajs]
    assert all(len(t.turns) == 2 for t in trajs)


@pytest.mark.slow
@pytest.mark.parametrize("config, context", [("bash-loop", 4096), ("mini-swe-agent", 8192)])
def test_a_harness_trains_smollm2_for_a_step_on_its_recorded_rows(tmp_path, config, context):
    """configs/bash-loop.yaml and configs/mini-swe-agent.yaml, shortened: the harness in real repo sandboxes (mini-swe-
    agent unmodified, from its wheelhouse layer), the real engine with SmolLM2 behind the proxy, and one RL step on
    the rows it recorded."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from pulled_models import pulled

    pulled("smollm2-135m")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "rollout.tasks_per_step=1", "rollout.group_size=2", "agent.max_requests=2",
                 "rollout.max_new_tokens=48", f"rollout.max_context={context}", "logging.wandb.mode=disabled",
                 f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", f"configs/{config}.yaml", *overrides],
                          cwd=root, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any(r["failed"] for r in rows), [r["failure"] for r in rows]
    for r in rows:
        assert r["metadata"]["harness"] == config and r["turns"]
        generated = sum(t["generated_tokens"] for t in r["turns"])
        masked = sum(r["loss_mask"]) + sum(sum(x["loss_mask"]) for x in r["earlier_rows"])
        assert generated == masked > 0  # every token the engine produced, in the rows, once
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["phase"] == "rl"]
    assert [m["step"] for m in rl] == [0] and rl[0]["policy/version"] == 1


def test_a_harness_that_exits_97_is_graded_not_failed(run_id, docker_client):
    """#56: start.sh's status 97 meant "the forwarder never started" and failed the episode (out of the gradient);
    the policy could append `exit 97` to start.sh (its user's file, read by bash as it runs) or end its harness so, on
    any task, and two such episodes stopped the job. The runtime files are root's and read-only to the policy now, and
    once the policy has made a request (the forwarder demonstrably worked), whatever the harness exits with is graded:
    the fix plus an `exit 97` still scores 1, the attack alone 0."""
    task = repo_task("wrong_operator", 3)
    append = "echo 'exit 97' >> /tmp/.sandforge-harness/start.sh; echo appended"
    kill = "kill -9 $PPID; exit 97"
    fixed, = run(ReplayBackend([*fix_commands(task)[:2], append, kill]), [task], run_id, docker_client)
    assert not fixed.failed, fixed.failure
    assert (fixed.reward.value, fixed.reward.success) == (1.0, True), fixed.reward.reason
    alone, = run(ReplayBackend([append, kill]), [task], run_id, docker_client)
    assert not alone.failed, alone.failure
    assert alone.reward.value == 0.0
