"""Case 9: 10,000 fuzzed model outputs and 1,000 fuzzed tool arguments through whole episodes of the real agent loop
in real terminal sandboxes: no exception escapes an episode, every episode ends as a Trajectory, and the sandbox
keeps answering after all of it.

The policy here is a fuzzer speaking the built-in chat format (random ids, random bytes, control tokens spliced into
structure, bad JSON, unknown tools); the tool arguments are well-formed calls of the terminal's tools with wrong
types, missing or extra arguments, NUL bytes, huge strings and hostile paths, which do run in the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from seeded import terminal_task as make_task

from sandforge.environments.terminal.env import TerminalEnv
from sandforge.models.bpe import load_tokenizer
from sandforge.models.chat import ChatFormat
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.types import GenerateRequest, Message, Sample, ToolCall

pytestmark = [pytest.mark.chaos, pytest.mark.docker, pytest.mark.slow]

OUTPUTS, TOOL_ARGS, PER_EPISODE = 10_000, 1_000, 1_100

TOOLS = ["bash", "read_file", "write_file"]
STRINGS = ["", "a\x00b", "\ud800", "é" * 3000, "x" * 20_000, "../../../../etc/shadow", "/proc/self/mem",
           "/workspace/" + "d/" * 300, "`reboot`", "; exit 1", "\n" * 100, "<|end|>", "/run/sandforge-root/x",
           "/var/run/docker.sock", "-rf /", "%s%n%x", "{}"]
HANGS = ["/dev/zero", "/dev/urandom", "$(yes)", "/dev/stdin"]  # each costs an exec timeout: a few suffice
VALUES = [*STRINGS, 0, -1, 2**70, 1.5, float("1e308"), True, None, [1, "a"], {"k": "v"}]
GARBAGE_JSON = ['{"name": "bash", "arguments": {', '{"name": bash}', "[]", "null", '{"name": "bash", "arguments": 1}',
                "[" * 3000, '{"name": "bash", "arguments": {"command": NaN}}', "\x00", "{}", '"bash"']  # fmt: skip


def fuzzed_call(rng: random.Random) -> ToolCall:
    """A terminal tool call with fuzzed arguments: wrong types, extra or missing keys, hostile strings."""
    name = rng.choice(TOOLS)
    keys = {"bash": ["command"], "read_file": ["path"], "write_file": ["path", "content"]}[name]
    args = {k: rng.choice(STRINGS) if rng.random() < 0.6 else rng.choice(VALUES) for k in keys}
    if rng.random() < 0.01:
        args[keys[0]] = rng.choice(HANGS)
    roll = rng.random()
    if roll < 0.15:
        args.pop(rng.choice(keys))
    elif roll < 0.3:
        args[rng.choice(["cmd", "", "path", "x" * 50])] = rng.choice(VALUES)
    if name == "bash" and isinstance(args.get("command"), str) and rng.random() < 0.5:
        args["command"] = rng.choice(["cat ", "ls ", "echo ", "head -c 100 "]) + args["command"][:200]
    return ToolCall(name, args)


def fuzzed_output(chat: ChatFormat, rng: random.Random, i: int) -> list[int]:
    """A model output that is anything but a clean call: random ids or bytes, cut replies, bad JSON, stray tokens."""
    tok = chat.tokenizer
    specials = [chat.bos, chat.eos, chat.end, chat.system, chat.user, chat.assistant, chat.tool, chat.think,
                chat.think_end, chat.call, chat.call_end]  # fmt: skip
    kind = i % 4
    if kind == 0:
        return [rng.randrange(len(tok)) for _ in range(rng.randrange(40))]
    if kind == 1:
        return [rng.randrange(256) for _ in range(rng.randrange(60))] + [chat.end] * rng.randrange(2)
    if kind == 2:  # a reply with calls, cut anywhere
        ids = chat.render_assistant(Message("assistant", "ok", "plan", [fuzzed_call(rng) for _ in range(2)]))
        return ids[: rng.randrange(len(ids))]
    ids = [chat.think, *tok.encode("think"), chat.think_end]
    for _ in range(rng.randrange(1, 3)):
        body = rng.choice(GARBAGE_JSON) if rng.random() < 0.7 else json.dumps(
            {"name": rng.choice(["bash ", "", "submit!", "é", "read_file\n"]), "arguments": {}})
        ids += [chat.call, *tok.encode(body)] + ([chat.call_end] if rng.random() < 0.8 else [])
    for _ in range(rng.randrange(3)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids + ([chat.end] if rng.random() < 0.8 else [])


class FuzzPolicy:
    """Hands out the next fuzzed output for every turn of every episode, as an engine would (sampled ids, logprobs)."""

    def __init__(self, outputs: list[list[int]]):
        self.outputs = outputs
        self.used = 0

    async def generate(self, request: GenerateRequest) -> Sample:
        ids = self.outputs[self.used] if self.used < len(self.outputs) else []
        self.used += 1
        return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", version=0,
                      prefill_tokens=len(request.prompt_ids))

    async def close_session(self, session_id: str) -> None:
        return None


def test_fuzzed_outputs_and_tool_arguments_never_escape_an_episode(terminal_spec, run_id, docker_client):
    chat = ChatFormat(load_tokenizer("bpe"))
    rng = random.Random(9)
    outputs = [fuzzed_output(chat, rng, i) for i in range(OUTPUTS)]
    calls = [fuzzed_call(rng) for _ in range(TOOL_ARGS)]
    for k, call in enumerate(calls):  # each fuzzed call is a clean reply of its own, among the garbage
        outputs.insert(rng.randrange(len(outputs) + 1), chat.render_assistant(Message("assistant", tool_calls=[call])))
    policy = FuzzPolicy(outputs)
    limits = EpisodeLimits(max_turns=PER_EPISODE, max_context=10**7, max_new_tokens=10**6, stop_ids=chat.stop_ids,
                           max_tool_calls=3, max_tool_output=512, episode_timeout=None, tool_grace=30.0)
    task = make_task("write_file", 1)
    trajs, errors = [], 0
    while policy.used < len(outputs):
        env = TerminalEnv(task, terminal_spec, run_id, exec_timeout=1, client=docker_client)
        try:
            traj = asyncio.run(run_episode(task, env, policy, chat, limits, "fuzz"))
        except Exception as e:  # noqa: BLE001 - the assertion names it
            pytest.fail(f"an exception escaped the episode: {type(e).__name__}: {e}")
        trajs.append(traj)
        errors += sum(len(t.parse_errors) + len(t.tool_errors) for t in traj.turns)
    assert policy.used >= OUTPUTS + TOOL_ARGS
    assert sum(len(t.turns) for t in trajs) >= OUTPUTS + TOOL_ARGS - len(trajs)  # every output was answered
    failed = [t.failure for t in trajs if t.failed]
    assert not failed, failed  # the fuzz broke no sandbox, verifier or loop
    assert all(t.reward is not None for t in trajs)  # every episode was graded
    executed = sum(t.executed for traj in trajs for t in traj.turns)
    assert executed > TOOL_ARGS / 3, executed  # the fuzzed arguments did reach the sandbox
    assert errors > OUTPUTS / 2, errors  # and the garbage became error observations
