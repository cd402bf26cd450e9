"""The agent loop with fake environments and policies (no Docker, no model): limits, timeouts, truncation, parallel
tool calls, per-turn records, versions and routing per token, failures that stay inside one episode. The last tests run
real TerminalEnv episodes in containers."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

import pytest
from agent_fakes import CHAT, TASK, FakeEnv, ReplayPolicy, grade, limits, reply

from sandforge.rollout.agent import NO_TOOL_CALL, run_episode
from sandforge.job.rollout_metrics import rollout_metrics
from sandforge.rollout.policy_client import EnginePolicy, scripted_policy
from sandforge.rollout.tool_calls import truncate_output
from sandforge.types import Sample, ToolCall, Trajectory


def episode(env, policy, chat=CHAT, **kw):
    return asyncio.run(run_episode(TASK, env, policy, chat, limits(**kw), "g/0", version=5, session_id="s-1",
                                   score=grade))


def test_turn_records_versions_and_token_spans():
    env = FakeEnv()
    first = reply(ToolCall("echo", {"text": "hi"}), reasoning="plan A")
    policy = ReplayPolicy([{"token_ids": first, "version": 3, "cached_tokens": 10, "prefill_tokens": 20},
                           {"token_ids": reply(ToolCall("submit")), "version": 4}])
    traj = episode(env, policy)
    assert (traj.failed, traj.finish_reason, traj.reward.success) == (False, "submit", True)
    assert policy.closed == ["s-1"] and env.closed == 1 and traj.metadata["session"] == "s-1"
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.token_versions) == n and traj.routed_experts is None
    t0, t1 = traj.turns
    assert (t0.version, t0.cached_tokens, t0.prefill_tokens, t0.finish_reason) == (3, 10, 20, "stop")
    assert (t1.version, t1.index, t1.executed, t0.executed) == (4, 1, 1, 1)
    assert t0.observations == ["hi"] and t0.seconds_generate >= 0 and t0.seconds_tools >= 0
    # each request is the whole sequence so far; generated spans carry their version, all else -1
    assert policy.requests[1].prompt_ids == traj.token_ids[: t1.prompt_tokens]
    assert t1.prompt_tokens == t0.prompt_tokens + t0.generated_tokens + t0.observation_tokens
    assert traj.token_ids[t0.prompt_tokens : t0.prompt_tokens + len(first)] == first
    for t, v in ((t0, 3), (t1, 4)):
        span = slice(t.prompt_tokens, t.prompt_tokens + t.generated_tokens)
        assert set(traj.token_versions[span]) == {v} and set(traj.loss_mask[span]) == {1}
    assert sum(traj.loss_mask) == t0.generated_tokens + t1.generated_tokens
    assert traj.token_versions.count(-1) == n - sum(traj.loss_mask)
    assert policy.requests[0].session_id == "s-1" and policy.requests[0].n == 1
    assert policy.requests[0].stop_ids == CHAT.stop_ids and policy.requests[0].max_tokens == 512
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back == traj


def test_routed_experts_align_with_fed_positions():
    """Position p holds the routing computed when token p was fed; a session cache means only new tokens are fed."""
    fed_log = []

    def engine(ids):
        def answer(request):
            prompt = request.prompt_ids
            cached = sum(fed_log[-1]) if fed_log else 4  # a prefix hit on turn 0, then the session's own cache
            fed = len(prompt) - cached + len(ids) - 1
            fed_log.append((cached, fed))
            routing = [[[cached + i, 0]] for i in range(fed)]  # one MoE layer, top-2: [position, 0]
            return {"token_ids": ids, "cached_tokens": cached, "routed_experts": routing}
        return answer

    traj = episode(FakeEnv(), ReplayPolicy([engine(reply(ToolCall("echo", {"text": "x"}))),
                                            engine(reply(ToolCall("submit")))]))
    routed = traj.routed_experts
    assert len(routed) == len(traj.token_ids)
    assert routed[:4] == [None] * 4 and routed[-1] is None  # prefix-cached, and the last token was never fed
    assert all(routed[p] == [[p, 0]] for p in range(4, len(routed) - 1))
    # a misaligned answer is dropped and counted, never placed at the wrong positions
    bad = {"token_ids": reply(ToolCall("submit")), "routed_experts": [[[1, 2]]]}
    traj = episode(FakeEnv(), ReplayPolicy([bad]))
    assert traj.routed_experts is None and traj.metadata["routing_errors"] == 1 and not traj.failed


def test_episode_timeout_interrupts_generation_and_is_still_graded():
    policy = ReplayPolicy([reply(ToolCall("echo", {"text": "a"})), 30.0])
    start = time.monotonic()
    traj = episode(FakeEnv(), policy, episode_timeout=0.5)
    assert time.monotonic() - start < 5
    assert (traj.finish_reason, traj.failed, traj.reward.success) == ("timeout", False, True)
    assert [t.finish_reason for t in traj.turns] == ["stop", "timeout"]
    assert traj.turns[1].generated_tokens == 0 and traj.turns[1].seconds_generate >= 0.3
    assert policy.closed == ["s-1"]


def test_a_running_tool_call_finishes_but_no_new_one_starts_after_the_deadline():
    env = FakeEnv()
    calls = [ToolCall("nap", {"seconds": 0.6}), ToolCall("echo", {"text": "late"})]
    traj = episode(env, ReplayPolicy([reply(*calls)]), episode_timeout=0.3)
    assert traj.finish_reason == "timeout" and not traj.failed
    assert [name for name, *_ in env.log] == ["nap"] and traj.turns[0].observations == ["slept 0.6"]
    # a call that outlives the deadline by more than the grace period fails the episode: it cannot be graded
    traj = episode(FakeEnv(), ReplayPolicy([reply(ToolCall("nap", {"seconds": 1.5}))]), episode_timeout=0.1,
                   tool_grace=0.2)
    assert traj.failed and traj.failure.startswith("tool: ") and traj.finish_reason == "error"


def test_tool_output_is_truncated_head_and_tail_with_a_marker():
    original = "".join(chr(65 + i % 26) for i in range(1000))
    text, cut = truncate_output(original, 100)
    assert cut and text.startswith(original[:50] + "\n[") and text.endswith("]\n" + original[-50:])
    assert "[... 900 of 1000 characters cut from the middle of this output ...]" in text
    assert truncate_output("short", 100) == ("short", False)
    traj = episode(FakeEnv(), ReplayPolicy([reply(ToolCall("shout", {"n": 5000}), ToolCall("echo", {"text": "ok"}))]),
                   max_tool_output=200)
    turn = traj.turns[0]
    assert turn.truncated_outputs == 1 and "4800 of 5000 characters cut" in turn.observations[0]
    assert len(turn.observations[0]) < 300 and turn.observations[1] == "ok"
    assert "4800 of 5000" in CHAT.tokenizer.decode(traj.token_ids)  # what the policy saw is the cut version


@pytest.mark.parametrize("concurrent", [False, True])
def test_parallel_tool_calls_answer_in_call_order(concurrent):
    env = FakeEnv(concurrent=concurrent)
    calls = [ToolCall("nap", {"seconds": 0.3}), ToolCall("nap", {"seconds": 0.3}), ToolCall("echo", {"text": 1}),
             ToolCall("nap", {"seconds": 0.3}), ToolCall("ehco", {"text": "x"}), ToolCall("echo", {"text": "last"})]
    traj = episode(env, ReplayPolicy([reply(*calls)]))
    turn = traj.turns[0]
    tools = traj.messages[2:8]  # user, assistant, then this turn's six results
    assert [m.tool_call_id for m in tools] == [f"call_{i}" for i in range(6)]
    assert [m.name for m in tools] == [c.name for c in calls]
    assert turn.observations[:2] == ["slept 0.3"] * 2 and turn.observations[5] == "last"
    assert "'text' must be string, got integer" in turn.observations[2]
    assert "unknown tool 'ehco' (did you mean 'echo'?)" in turn.observations[4]
    assert turn.executed == 4 and len(turn.tool_errors) == 2
    naps = [(s, e) for name, s, e in env.log if name == "nap"]
    overlap = max(s for s, _ in naps) < min(e for _, e in naps)
    assert overlap == concurrent  # concurrent envs run them at once; the others strictly one after another
    decoded = CHAT.tokenizer.decode(traj.token_ids)
    where = [decoded.index(s) for s in ("<|tool|>nap\nslept", "<|tool|>ehco\nError", "<|tool|>echo\nlast")]
    assert where == sorted(where)


def test_tool_calls_over_the_cap_are_not_run_and_say_so():
    env = FakeEnv()
    traj = episode(env, ReplayPolicy([reply(*[ToolCall("echo", {"text": str(i)}) for i in range(4)])]),
                   max_tool_calls=2)
    turn = traj.turns[0]
    assert turn.executed == 2 and len(env.log) == 2
    assert turn.observations[:2] == ["0", "1"]
    assert turn.observations[2].startswith("Error: tool call 3 (echo) was not run: at most 2 tool calls run per turn")
    assert len(turn.tool_errors) == 2


def test_parse_errors_and_missing_calls_become_error_observations():
    bad = CHAT.tokenizer.encode("no calls at all") + [CHAT.end]
    truncated = reply(ToolCall("echo", {"text": "abcdef"}))[:-8]
    traj = episode(FakeEnv(), ReplayPolicy([bad, truncated, reply(ToolCall("submit"))]))
    t0, t1, _ = traj.turns
    assert t0.observations == [f"Error: {NO_TOOL_CALL}"] and t0.parse_errors == []
    assert t1.finish_reason == "length" and any("not closed" in e for e in t1.parse_errors)
    assert all(o.startswith("Error: ") for o in t1.observations)
    # the truncated reply was closed with <|end|> before the observations: an observation token, not a policy one
    end = t1.prompt_tokens + t1.generated_tokens
    assert traj.token_ids[end] == CHAT.end and traj.loss_mask[end] == 0


@pytest.mark.parametrize("first", ["prose", "cut-off prose"])
def test_with_end_on_text_a_reply_of_prose_ends_the_episode_and_is_graded(first):
    prose = CHAT.tokenizer.encode("I am done here. " * (1 if first == "prose" else 40)) + [CHAT.end]
    env = FakeEnv()
    traj = episode(env, ReplayPolicy([reply(ToolCall("echo", {"text": "hi"})), prose, reply(ToolCall("submit"))]),
                   end_on_text=True, max_new_tokens=64)
    assert traj.finish_reason == "text" and len(traj.turns) == 2 and traj.reward is not None and not traj.failed
    assert traj.turns[1].finish_reason == ("stop" if first == "prose" else "length")
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]  # no note it never read
    assert traj.loss_mask[-1] == 1
    assert rollout_metrics([traj])["episodes/finish_text"] == 1.0


def test_with_end_on_text_a_malformed_call_still_gets_its_error_and_the_episode_goes_on():
    cut = reply(ToolCall("echo", {"text": "abcdef"}))[:-8]
    traj = episode(FakeEnv(), ReplayPolicy([cut, reply(ToolCall("submit"))]), end_on_text=True)
    assert traj.finish_reason == "submit" and any("not closed" in e for e in traj.turns[0].parse_errors)
    assert all(o.startswith("Error: ") for o in traj.turns[0].observations)


def test_context_and_turn_limits():
    long = reply(ToolCall("echo", {"text": "x" * 40}))
    traj = episode(FakeEnv(), ReplayPolicy([long] * 10), max_turns=3)
    assert traj.finish_reason == "max_turns" and len(traj.turns) == 3
    assert traj.loss_mask[-1] == 1  # the last turn's results are not appended: no one would read them
    prompt = len(CHAT.render_prompt(FakeEnv().tools, [traj.messages[0]]))
    cap = prompt + 2 * len(long) + 30
    policy = ReplayPolicy([long] * 10)
    traj = episode(FakeEnv(), policy, max_context=cap, max_turns=10, max_new_tokens=len(long))
    assert traj.finish_reason == "context" and len(traj.token_ids) <= cap
    budgets = [r.max_tokens for r in policy.requests]
    assert budgets[0] == len(long) and 0 < budgets[-1] < len(long)  # the last turn only gets what is left
    assert traj.turns[-1].finish_reason == "context" and len(traj.turns) == 2


class FakeHandle:
    """Looks like a Ray actor handle: methods have ``.remote`` returning an awaitable."""

    def __init__(self, engine):
        for name in ("generate", "close_session"):
            method = getattr(engine, name)

            class Remote:
                @staticmethod
                def remote(*args, _m=method):
                    async def run():
                        return await _m(*args) if asyncio.iscoroutinefunction(_m) else _m(*args)
                    return run()
            setattr(self, name, Remote)


class ListEngine:
    def __init__(self, answer):
        self.answer, self.closed = answer, []

    async def generate(self, request):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return [self.answer(request)]

    def close_session(self, session_id):  # sync, like RemoteEngine's
        self.closed.append(session_id)


@pytest.mark.parametrize("wrap", [lambda e: e, FakeHandle], ids=["object", "ray-handle"])
def test_engine_policy_adapter_and_engine_failures(wrap):
    ids = reply(ToolCall("submit"))
    ok = ListEngine(lambda r: Sample(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", version=9,
                                     prefill_tokens=3))
    traj = episode(FakeEnv(), EnginePolicy(wrap(ok)))
    assert traj.finish_reason == "submit" and set(traj.token_versions) == {-1, 9} and ok.closed == ["s-1"]

    for answer, why in [(RuntimeError("actor died"), "engine: RuntimeError: actor died"),
                        (lambda r: Sample(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop"), "equal length"),
                        (lambda r: Sample(token_ids=[1], logprobs=[0.0], finish_reason="abort"), "finish_reason"),
                        (lambda r: {"token_ids": [1], "logprobs": [0.0], "finish_reason": "stop"}, "expected a Sample")]:
        env, engine = FakeEnv(), ListEngine(answer)
        traj = episode(env, EnginePolicy(wrap(engine)))
        assert traj.failed and why in traj.failure and traj.failure.startswith("engine:")
        assert traj.finish_reason == "error" and traj.reward.value == 0.0
        assert [t.finish_reason for t in traj.turns] == [""]  # it did not stop for time, or anything else
        assert env.closed == 1 and engine.closed == ["s-1"]  # sandbox and engine session released all the same


def test_scripted_policy_replays_the_reference_solution():
    from sandforge.types import Task

    task = Task(id="f/2", env="fake", family="f", seed=2, instruction="x",
                solution=[ToolCall("echo", {"text": "hi"}), ToolCall("submit")])
    traj = asyncio.run(run_episode(task, FakeEnv(), scripted_policy(task, CHAT, version=2), CHAT, limits(), "g",
                                   version=2, score=grade))
    assert traj.finish_reason == "submit" and [t.executed for t in traj.turns] == [1, 1]
    assert set(traj.token_versions) == {-1, 2}


def test_metrics_count_how_episodes_and_turns_ended():
    trajs = [episode(FakeEnv(), ReplayPolicy([reply(ToolCall("echo", {"text": "a"}), ToolCall("nope"))])),
             episode(FakeEnv(), ReplayPolicy([reply(ToolCall("echo", {"text": "a"})), 30.0]), episode_timeout=0.3),
             episode(FakeEnv(), ReplayPolicy([RuntimeError("boom")]))]
    m = rollout_metrics(trajs)
    assert m["episodes/count"] == 3 and m["episodes/failed"] == 1 and m["episodes/failed_error"] == 1
    ends = [m[f"episodes/finish_{end}"] for end in ("submit", "timeout", "error")]
    assert ends == [pytest.approx(1 / 3)] * 3
    assert m["episodes/timeouts"] == 1 and m["turns/finish_timeout"] > 0
    assert m["tools/errors_per_episode"] == 0.5 and m["reward/mean"] == 1.0
    assert {"tokens/cache_hit_rate", "time/generate_per_turn", "time/episode_mean", "turns/max"} <= set(m)
    from sandforge.job.rl_job import step_line

    assert "timeouts 1" in step_line(0, 1, m | {"time/step": 1.0})


def test_rollout_config_keys_reach_the_episode_limits():
    from pydantic import ValidationError

    from sandforge.config import RolloutConfig
    from sandforge.rollout.episode import EpisodeLimits

    lim = EpisodeLimits.from_config(RolloutConfig(episode_timeout=30, max_tool_calls=2, max_tool_output=100), [1, 2])
    assert (lim.episode_timeout, lim.max_tool_calls, lim.max_tool_output, lim.stop_ids) == (30, 2, 100, [1, 2])
    assert RolloutConfig().episode_timeout == 600 and RolloutConfig(episode_timeout=None).episode_timeout is None
    for bad in ({"episode_timeout": 0}, {"max_tool_calls": 0}, {"max_tool_output": 10}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            RolloutConfig(**bad)


# --- real containers ----------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_terminal_episode_with_parallel_tool_calls(terminal_spec, run_id, docker_client):
    from sandforge.environments.terminal.env import TerminalEnv
    from seeded import terminal_task as make_task
    from sandforge.verifiers.checks import score_task

    task = make_task("write_file", 3)
    path, content = task.checks[0]["path"], task.checks[0]["content"]
    calls = [ToolCall("write_file", {"path": path, "content": content}), ToolCall("bash", {"command": f"cat {path}"}),
             ToolCall("read_file", {"path": path}), ToolCall("bash", {"command": 42}), ToolCall("submit")]
    env = TerminalEnv(task, terminal_spec, run_id, client=docker_client)
    assert env.concurrent_tools is False  # one shell session, and later calls read what earlier ones wrote
    policy = ReplayPolicy([reply(*calls)])
    traj = asyncio.run(run_episode(task, env, policy, CHAT, limits(), "g", session_id="s-docker", score=score_task))
    assert not traj.failed, traj.failure
    assert (traj.finish_reason, traj.reward.success) == ("submit", True)
    turn = traj.turns[0]
    assert turn.observations[0].startswith("wrote") and turn.observations[1] == f"{content}\n[exit code 0]"
    assert turn.observations[2] == content and "'command' must be string" in turn.observations[3]
    assert turn.observations[4] == "submitted" and turn.executed == 4 and len(turn.tool_errors) == 1
    assert policy.closed == ["s-docker"] and traj.metadata["sandbox"]


@pytest.mark.docker
def test_worker_waits_for_a_sandbox_when_max_live_are_in_use(terminal_image, run_id, docker_client):
    from sandforge.config import JobConfig
    from containers import list_run_containers
    from seeded import terminal_task as make_task
    from sandforge.rollout.worker import RolloutWorker, WorkerSetup

    job = JobConfig.model_validate({"sandbox": {"max_live": 1, "warm_pool": 0}, "rollout": {"concurrency": 3}})
    setup = WorkerSetup(run_id=run_id, engine="unused", images={"terminal": terminal_image}, labels={},
                        environments=tuple(job.environments), rollout=job.rollout, sandbox=job.sandbox, model=job.model)
    worker = RolloutWorker(0, setup, engine=object())  # scripted episodes never ask the engine
    tasks = [make_task("write_file", s) for s in range(3)]
    try:
        out = asyncio.run(worker.run_episodes([asdict(t) for t in tasks], ["a", "b", "c"], version=1, scripted=True))
    finally:
        worker.close()
    trajs = [Trajectory.from_dict(d) for d in out]
    assert [t.failed for t in trajs] == [False] * 3, [t.failure for t in trajs]
    assert all(t.reward.success and t.finish_reason == "submit" for t in trajs)
    assert max(t.metadata["seconds_sandbox_wait"] for t in trajs) > 0.1  # the others waited for the one slot
    assert len({t.metadata["session"] for t in trajs}) == 3 and trajs[0].metadata["session"].startswith(run_id)
    assert len(worker.stats.export(reset=False)["acquire"]) == 3
    assert list_run_containers(run_id, docker_client) == []


def test_sequence_length_counts_every_training_row_of_an_episode():
    """An episode whose harness rewrote its history trains on its earlier rows too: ``sequence/length_mean`` is the
    mean over every training sequence, not over each episode's last row."""
    from dataclasses import replace

    from sandforge.types import TokenRow

    traj = episode(FakeEnv(), ReplayPolicy([reply(ToolCall("echo", {"text": "hi"})), reply(ToolCall("submit"))]))
    n = len(traj.token_ids)
    earlier = TokenRow(token_ids=[1] * 10, loss_mask=[0] * 5 + [1] * 5, logprobs=[0.0] * 10, token_versions=[5] * 10)
    rewritten = replace(traj, earlier_rows=[earlier])
    assert rollout_metrics([traj])["sequence/length_mean"] == n
    assert rollout_metrics([rewritten])["sequence/length_mean"] == (n + 10) / 2
    assert rollout_metrics([rewritten])["response/length_mean"] == traj.response_tokens + 5
