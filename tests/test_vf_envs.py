"""verifiers environments (PyPI ``verifiers`` 0.4, verifiers.v1) run by sandforge: the real library runs each episode
(its chat program, its interception server, the environment's own user and rubric) and its model calls reach a
scripted engine through sandforge's recording proxy. The environments are examples/verifiers_envs/, written against
the library as its own examples are; scripts/test.sh installs them."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import threading
from difflib import SequenceMatcher
from pathlib import Path

import pytest
from agent_fakes import CHAT, limits

from sandforge.environments.task_sources import TaskSourceError
from sandforge.environments.vf.library import vf
from sandforge.environments.vf import chat_harness
from sandforge.environments.vf.tasks import HARNESS, REFERENCE_HARNESS, load_env, load_tasks, task_list
from sandforge.rollout.policy_client import PolicyError
from sandforge.rollout.proxy import ProxyBudget
from sandforge.rollout.vf_episode import VerifiersEnvs, agent_limits, run_vf_episode
from sandforge.types import GenerateRequest, Message, Sample

for _name in ("reverse_words", "guess_number"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"pip install ./examples/verifiers_envs/{_name} (scripts/test.sh does)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
USER = re.compile(r"<\|user\|>(.*?)<\|end\|>", re.DOTALL)


def reply_to(conversation: list[str]) -> str:
    """The scripted policy, a function of the user messages so far (the same for sandforge and for vf-eval):
    reverses a word with one letter wrong when it starts with 'k' (a near miss), and searches for a number by halves."""
    last = conversation[-1]
    if "thinking of a number" in conversation[0]:
        low, high = 1, int(re.search(r"from 1 to (\d+)", conversation[0]).group(1))
        guess = (low + high) // 2
        for said in conversation[1:]:
            if said.startswith("Higher"):
                low = guess + 1
            elif said.startswith("Lower"):
                high = guess - 1
            guess = (low + high) // 2
        return f"I guess <guess>{guess}</guess>"
    word = last.strip()[::-1]
    if last.startswith("k"):
        word = word[:-1] + "x"
    return f"<reversed_text>{word}</reversed_text>"


class ScriptedEngine:
    """The engine behind the proxy: reads the rendered prompt's user messages and replies by ``reply_to``."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.requests: list[GenerateRequest] = []
        self.replies: list[list[int]] = []

    async def generate(self, request: GenerateRequest) -> Sample:
        self.requests.append(request)
        if self.fail:
            raise PolicyError("engine: gone")
        said = USER.findall(CHAT.tokenizer.decode(request.prompt_ids))
        ids = CHAT.render_assistant(Message(role="assistant", content=reply_to(said)))
        self.replies.append(ids)
        return Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", version=3)

    async def close_session(self, session_id: str) -> None:
        pass


def run(tasks, engine, budget=ProxyBudget(10, 10_000), harness=HARNESS, **limit):
    async def main():
        envs = VerifiersEnvs(agent_limits(limits(**limit), budget), harness=harness)
        try:
            return [await run_vf_episode(t, envs, engine, CHAT, limits(**limit), budget, f"g{i}", version=3)
                    for i, t in enumerate(tasks)]
        finally:
            await envs.close()
    return asyncio.run(main())


def test_a_single_turn_environment_scores_by_its_own_rubric_on_exactly_the_engines_tokens():
    tasks = load_tasks("reverse_words", {"num_tasks": 40, "seed": 3})
    near = next(t for t in tasks if t.instruction.startswith("k"))
    exact = next(t for t in tasks if not t.instruction.startswith("k"))
    engine = ScriptedEngine()
    right, close = run([exact, near], engine)
    assert not right.failed and right.reward.success and right.reward.value == 1.0
    assert not close.failed and not close.reward.success
    word = near.instruction[::-1]
    assert close.reward.value == pytest.approx(SequenceMatcher(None, word[:-1] + "x", word).ratio())
    for traj, generated in zip([right, close], engine.replies):
        assert not traj.earlier_rows and len(traj.turns) == 1
        assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == generated  # the engine's ids, no others
        assert traj.logprobs[-1] == -0.5 and traj.token_versions[-1] == 3
    prompt = CHAT.tokenizer.decode(engine.requests[0].prompt_ids)
    assert "Reverse the text character by character" in prompt and f"<|user|>{exact.instruction}<|end|>" in prompt


def test_a_multi_turn_environment_keeps_one_row_over_its_users_turns():
    tasks = load_tasks("guess_number", {"num_tasks": 12, "seed": 1, "high": 8, "turns": 4})
    far = next(t for t in tasks if _secret(t) in (1, 8))  # binary search needs 3 or 4 guesses for these
    engine = ScriptedEngine()
    (traj,) = run([far], engine)
    assert not traj.failed and traj.reward.success and traj.reward.value == 1.0
    assert len(traj.turns) >= 3 and not traj.earlier_rows  # each request extended the recorded row
    assert sum(traj.loss_mask) == sum(len(r) for r in engine.replies)
    for before, after in zip(engine.requests, engine.requests[1:]):  # append-only: no token re-rendered
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    assert "Higher" in CHAT.tokenizer.decode(traj.token_ids) or "Lower" in CHAT.tokenizer.decode(traj.token_ids)


def _far_guesses():
    tasks = load_tasks("guess_number", {"num_tasks": 12, "seed": 1, "high": 8, "turns": 4})
    return [t for t in tasks if _secret(t) in (1, 8)][:1]


@pytest.mark.parametrize("module, args", [("reverse_words", {"num_tasks": 40, "seed": 3}), ("guess_number", None)])
def test_the_chat_loop_in_the_worker_records_what_verifiers_own_process_per_episode_does(module, args, monkeypatch):
    """#54: verifiers' null harness starts a process per episode (its chat program as a uv script, ~1 CPU-s of
    imports); sandforge runs the same program in the rollout worker. Same episodes, same engine: the same prompts,
    rows, masks and rewards as the reference, and no process started."""
    if args:
        tasks = load_tasks(module, args)
        tasks = tasks[:3] + [next(t for t in tasks if t.instruction.startswith("k"))]  # and a near miss
    else:
        tasks = _far_guesses()
    reference_engine, engine = ScriptedEngine(), ScriptedEngine()
    reference = run(tasks, reference_engine, harness=REFERENCE_HARNESS)

    async def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:3]}")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_process)
    ours = run(tasks, engine, harness=HARNESS)
    assert [r.prompt_ids for r in engine.requests] == [r.prompt_ids for r in reference_engine.requests]
    for a, b in zip(ours, reference):
        assert not a.failed and not b.failed, (a.failure, b.failure)
        assert (a.token_ids, a.loss_mask, a.logprobs) == (b.token_ids, b.loss_mask, b.logprobs)
        assert (a.reward.value, a.reward.success, a.finish_reason) == (b.reward.value, b.reward.success,
                                                                      b.finish_reason)
    assert len({t.reward.value for t in ours}) > 1 or module == "guess_number"  # near misses and exact answers


def test_the_chat_loop_in_the_worker_closes_its_clients_and_reports_a_dead_engine_as_the_process_would(monkeypatch):
    """Each episode's OpenAI client (a process would have closed it by exiting) is closed when its loop ends; a
    dead engine fails the episode under both harnesses alike."""
    module = chat_harness.program()
    opened = []
    real = module.AsyncOpenAI

    def recording(*args, **kwargs):
        client = real(*args, **kwargs)
        opened.append(client)
        return client

    monkeypatch.setattr(module, "AsyncOpenAI", recording)
    tasks = load_tasks("reverse_words", {"num_tasks": 40, "seed": 3})[:2]
    assert all(not t.failed for t in run(tasks, ScriptedEngine()))
    assert len(opened) == 2 and all(c.is_closed() for c in opened)
    dead = [run(tasks[:1], ScriptedEngine(fail=True), harness=h)[0] for h in (HARNESS, REFERENCE_HARNESS)]
    assert all(d.failed and "engine" in d.failure for d in dead), [d.failure for d in dead]


def test_a_budget_that_runs_out_is_scored_and_a_dead_engine_fails_only_its_episode():
    tasks = load_tasks("guess_number", {"num_tasks": 12, "seed": 1, "high": 8, "turns": 4})
    far = next(t for t in tasks if _secret(t) in (1, 8))
    (short,) = run([far], ScriptedEngine(), budget=ProxyBudget(1, 10_000))  # verifiers stops at 1 turn, and scores
    assert not short.failed and short.reward.value == 0.0 and len(short.turns) == 1, short.failure
    (dead,) = run([far], ScriptedEngine(fail=True))
    assert dead.failed and "engine" in dead.failure and dead.reward.value == 0.0


class HugeGuess(ScriptedEngine):
    """The policy's reply: a guess of 5,000 digits (Python refuses int() of more than 4,300 digits)."""

    async def generate(self, request: GenerateRequest) -> Sample:
        self.requests.append(request)
        ids = CHAT.render_assistant(Message(role="assistant", content=f"<guess>{'7' * 5000}</guess>"))
        return Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", version=3)


def test_a_reply_that_breaks_the_rubric_scores_zero_not_failed():
    """#56: a 5,000-digit guess made the shipped guess_number's rubric raise ("verifiers recorded no reward"), and
    the episode failed, out of the gradient: a losing policy could make its losses vanish. After the policy's first
    reply, whatever the rubric or the environment does with it is the policy's 0, with a cause; an honest search
    still scores 1."""
    tasks = load_tasks("guess_number", {"num_tasks": 12, "seed": 1, "high": 8, "turns": 2})
    (broken,) = run(tasks[:1], HugeGuess(), max_context=20_000)
    assert not broken.failed, broken.failure
    assert broken.reward.value == 0.0 and broken.reward.zero_causes == ["malformed"], broken.reward
    (honest,) = run([t for t in tasks if _secret(t) == 4][:1], ScriptedEngine())
    assert not honest.failed and honest.reward.value == 1.0


def test_an_unknown_module_or_argument_is_a_clear_error():
    with pytest.raises(TaskSourceError, match="no_such_env"):
        load_tasks("no_such_env", {})
    with pytest.raises(TaskSourceError, match="num_taskz"):
        load_tasks("reverse_words", {"num_taskz": 3})


def _secret(task) -> int:
    spec = task.setup["verifiers"]
    return task_list(load_env(spec["id"], spec["args"]))[spec["position"]].data.secret


class OpenAIServer:
    """A plain chat-completions server that answers by ``reply_to``, streamed as verifiers' chat program asks: what
    verifiers' own vf-eval is pointed at."""

    def __init__(self):
        from aiohttp import web

        from sandforge.rollout.chat_api import completion_events, completion_json

        async def completions(request):
            body = await request.json()
            said = [m["content"] for m in body["messages"] if m["role"] == "user"]
            done = completion_json(Message(role="assistant", content=reply_to(said)), "stop", 1, 1, "m", "id", 0)
            if body.get("stream"):
                return web.Response(body=completion_events(done, True), content_type="text/event-stream")
            return web.json_response(done)

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        self.runner = web.AppRunner(app)

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)}/v1"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("module, args", [("reverse_words", {"num_tasks": 6, "seed": 2}),
                                          ("guess_number", {"num_tasks": 4, "seed": 2, "turns": 2})])
def test_sandforge_records_the_reward_verifiers_own_eval_computes_for_the_same_completions(tmp_path, module, args):
    server = OpenAIServer()
    try:
        flags = [f"--env.taskset.{k.replace('_', '-')}={v}" for k, v in args.items()]
        subprocess.run([str(Path(sys.executable).parent / "vf-eval"), module, *flags, "-m", "scripted",
                        "--client.base-url", server.url, "--client.api-key-var", "SANDFORGE_NONE",
                        "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess",
                        "--no-push", "-o", str(tmp_path), "-c", "2"],
                       cwd=tmp_path, check=True, capture_output=True, timeout=600)
    finally:
        server.close()
    (traces,) = list(tmp_path.rglob("traces.jsonl"))
    theirs = {}
    for line in traces.read_text().splitlines():
        record = json.loads(line)
        (trace,) = record["traces"]
        theirs[record["task"]["data"]["idx"]] = sum(r["score"] * r["weight"] for r in trace["rewards"].values())
    tasks = load_tasks(module, args)
    ours = {t.setup["verifiers"]["position"]: traj.reward.value for t, traj in zip(tasks, run(tasks, ScriptedEngine()))}
    assert len(theirs) == len(tasks) and ours == pytest.approx(theirs)
    assert len(set(ours.values())) > 1  # near misses and exact answers (found and not found) both seen


@pytest.mark.slow
def test_configs_verifiers_trains_smollm2_for_a_step_on_the_environments_episodes(tmp_path):
    """configs/verifiers.yaml, shortened: `sandforge train` on reverse_words, SmolLM2 in the real engine behind the
    proxy, verifiers' own rubric as the reward, and one RL step on the recorded rows."""
    from pulled_models import pulled

    pulled("smollm2-135m")
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "rollout.tasks_per_step=2", "rollout.group_size=4", "eval.tasks_per_family=2",
                 "logging.wandb.mode=disabled", f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/verifiers.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    episodes = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    rows = [r for r in episodes if r["phase"] == "rl"]
    assert len(rows) == 8 and len(episodes) == 8 + 2 * 2 * 4  # and the held-out tasks, 4 times, before and after
    assert not any(r["failed"] for r in episodes), [r["failure"] for r in episodes]
    for r in episodes:
        assert r["task"]["env"] == "verifiers" and list(r["reward"]["breakdown"]) == ["lcs"]
        assert sum(t["generated_tokens"] for t in r["turns"]) == sum(r["loss_mask"]) > 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if m["phase"] == "rl"]
    assert [m["step"] for m in rl] == [0] and rl[0]["policy/version"] == 1


TOOLED = '''
import verifiers.v1 as vf


class Shell(vf.Toolset):
    @vf.tool
    async def run(self, command: str) -> str:
        """Run a command."""
        return command


class ShellTask(vf.Task[vf.TaskData]):
    @classmethod
    def toolsets(cls, config):
        return [Shell(vf.ToolsetConfig())]

    @vf.reward
    async def done(self, trace: vf.Trace) -> float:
        return 1.0


class ShellTaskset(vf.Taskset[ShellTask, vf.TasksetConfig]):
    def load(self):
        return [ShellTask(vf.TaskData(prompt="list the files"), self.config.task)]


__all__ = ["ShellTaskset"]
'''


def test_a_taskset_with_tool_servers_is_refused_since_they_would_run_on_the_host(tmp_path, monkeypatch):
    (tmp_path / "sf_tooled_env.py").write_text(TOOLED)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSourceError, match="tool servers .*Shell.*on the host"):
        load_tasks("sf_tooled_env", {})


SUBCLASSED = TOOLED.replace("class ShellTask(vf.Task[vf.TaskData]):", """class PlainTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def done(self, trace: vf.Trace) -> float:
        return 1.0


class ShellTask(PlainTask):""").replace("class ShellTaskset(vf.Taskset[ShellTask, vf.TasksetConfig]):",
                                        "class ShellTaskset(vf.Taskset[PlainTask, vf.TasksetConfig]):")


def test_a_task_subclass_with_tool_servers_is_refused_whatever_the_declared_type(tmp_path, monkeypatch):
    """#56: the taskset declared a tool-less task type but yielded a subclass declaring a tool server; the refusal
    looked at the declared type only, so the tool was offered and the model's call ran on the host. Every loaded
    task's own class is checked."""
    assert "Taskset[PlainTask" in SUBCLASSED and "class ShellTask(PlainTask)" in SUBCLASSED
    (tmp_path / "sf_subclassed_env.py").write_text(SUBCLASSED)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSourceError, match="tool servers .*Shell.*on the host"):
        load_tasks("sf_subclassed_env", {})


def test_the_held_out_split_does_not_move_when_only_the_system_prompt_changes(monkeypatch):
    """#55: verifiers' task key hashes the task's whole data, its system prompt included, so editing the prompt
    silently changed which tasks were held out. The split is keyed on the task without its system prompt (or on the
    durable key a task class defines)."""
    from sandforge.environments.vf import tasks as vf_tasks

    plain = load_tasks("reverse_words", {"num_tasks": 60, "seed": 3}, heldout=0.3)
    real_list = vf_tasks.task_list

    def prompted(env):
        return [t.with_data(system_prompt="You are a careful assistant. Answer in tags.") for t in real_list(env)]

    monkeypatch.setattr(vf_tasks, "task_list", prompted)
    edited = load_tasks("reverse_words", {"num_tasks": 60, "seed": 3}, heldout=0.3)
    assert [t.setup["verifiers"]["key"] for t in edited] != [t.setup["verifiers"]["key"] for t in plain]
    assert [t.split for t in edited] == [t.split for t in plain]
    assert 0 < sum(t.split == "heldout" for t in plain) < len(plain)
    assert isinstance(vf().Task.key, property)


def test_a_warm_start_replaying_references_is_refused_for_a_verifiers_environment_before_anything_runs():
    """#55: a warm start with a verifiers environment ran a minute of episodes before "no reference episode passed
    its verifier": its tasks have a rubric and no reference solution. The job check refuses it and says what works."""
    from sandforge.config import ConfigError, load_config
    from sandforge.job.preflight import validate_job

    with pytest.raises(ConfigError, match=r"verifiers.yaml: 'warmup.episodes' is 4, but environments\[0\] "
                                          r"\(verifiers reverse_words\) brings no reference solution"):
        validate_job(load_config("configs/verifiers.yaml", ["warmup.steps=2", "warmup.episodes=4"]), "verifiers.yaml")


def test_the_shipped_sft_dataset_is_its_generators_and_holds_no_held_out_word(tmp_path):
    """configs/verifiers_sft.yaml's warm start data (examples/verifiers_envs/reverse_words/sft.jsonl) is what
    make_sft_data.py writes for the config's environment, and none of its words is a held-out task's: the held-out
    reward after SFT measures reversing words the data never showed."""
    from sandforge.config import load_config
    from sandforge.job.sft_data import read_conversations

    cfg = load_config("configs/verifiers_sft.yaml")
    (env,) = cfg.environments
    example = ROOT / "examples" / "verifiers_envs" / "reverse_words"
    out = tmp_path / "sft.jsonl"
    subprocess.run([sys.executable, str(example / "make_sft_data.py"), "--out", str(out),
                    "--num-tasks", str(env.args["num_tasks"]), "--syllables", str(env.args["syllables"]),
                    "--task-seed", str(env.args["seed"]), "--heldout", str(env.heldout)],
                   check=True, capture_output=True, timeout=300)
    assert out.read_bytes() == (ROOT / cfg.warmup.data).read_bytes()
    heldout = {t.instruction for t in load_tasks(env.id, env.args, heldout=env.heldout) if t.split == "heldout"}
    said = {m.content for c in read_conversations(out) for m in c.messages if m.role == "user"}
    assert heldout and len(said) > 500 and not heldout & said
