"""Property tests of the agent loop (hypothesis): random multi-turn conversations with random tool results and randomly
truncated replies, for the built-in chat format (byte and BPE tokenizers), a Hugging Face template that shows tools
and SmolLM2's real tokenizer and template, whose tools sandforge declares.

Whatever happens, the final sequence is exactly the first prompt followed by each turn's generated tokens and the
tokens appended after it; each request's prompt is the sequence so far; every reasoning section stays in it; the loss
mask is 1 exactly on generated tokens."""

from __future__ import annotations

import asyncio
import functools
import string

import pytest
from agent_fakes import TASK, FakeEnv, grade
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sandforge.environments.tools import tool
from sandforge.models.bpe import load_tokenizer
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.tool_calls import truncate_output
from sandforge.types import GenerateRequest, Message, Sample, ToolCall


@functools.cache
def chat_format(name: str):
    if name == "bytes":
        return ChatFormat(ByteTokenizer())
    if name == "bpe":
        return ChatFormat(load_tokenizer("bpe"))
    pytest.importorskip("transformers")
    from sandforge.models.hf_chat import HFChatFormat

    if name == "smollm2":  # a real tokenizer whose template shows no tools: sandforge declares them (hermes)
        from pulled_models import smollm2_tokenizer

        return HFChatFormat(smollm2_tokenizer())
    from test_hf import build_tokenizer

    return HFChatFormat(build_tokenizer())


# HF tokenizers turn special-token text inside messages into special tokens (a template's own injection problem), and
# templates strip reasoning: keep HF text plain. The built-in format takes any text.
PLAIN = st.text(alphabet=string.ascii_letters + string.digits + " .,:;!?'\"{}[]()-_=+/\\\n\t", max_size=40)
ANY = st.text(max_size=40)


class ResultEnv(FakeEnv):
    """``run`` returns the drawn results in order and remembers what it returned."""

    def __init__(self, results):
        super().__init__(results)
        self.returned: list[str] = []

    @tool
    def run(self, cmd: str) -> str:
        """Next drawn result."""
        self.returned.append(self.results.pop(0) if self.results else "")
        return self.returned[-1]


def calls(text):
    call = st.one_of(
        st.builds(lambda c: ToolCall("run", {"cmd": c}), text),
        st.builds(lambda n: ToolCall("run", {"cmd": n}), st.integers()),  # wrong type: an error observation
        st.builds(lambda c: ToolCall("nope", {"x": c}), text),  # unknown tool
        st.just(ToolCall("submit")),
    )
    return st.lists(call, max_size=3)


def replies(text):
    reply = st.builds(lambda r, c, tc: Message("assistant", c.strip(), r.strip(), tc), text, text, calls(text))
    return st.lists(st.tuples(reply, st.floats(0.0, 2.0)), min_size=1, max_size=5)  # cut >= 1: the whole reply


class ScriptPolicy:
    """Renders the drawn replies (cut at the drawn fraction) as the engine would return them."""

    def __init__(self, chat, script):
        self.chat, self.script = chat, script
        self.gens: list[list[int]] = []
        self.requests: list[GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        msg, cut = self.script[len(self.gens) % len(self.script)]
        ids = self.chat.render_assistant(msg)
        if cut < 1:
            ids = ids[: max(1, int(cut * len(ids)))]
        ids = ids[: request.max_tokens]
        self.gens.append(ids)
        finish = "stop" if ids[-1] in self.chat.stop_ids else "length"
        return Sample(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason=finish, version=len(self.gens),
                      prefill_tokens=len(request.prompt_ids))

    async def close_session(self, session_id):
        pass


def check_episode(name, script, results, max_turns, room, max_output):
    chat = chat_format(name)
    env, policy = ResultEnv(results), ScriptPolicy(chat, script)
    max_context = len(chat.render_prompt(env.tools, [Message("user", TASK.instruction)])) + room
    limits = EpisodeLimits(max_turns=max_turns, max_context=max_context, max_new_tokens=400,
                           stop_ids=chat.stop_ids, max_tool_output=max_output)
    traj = asyncio.run(run_episode(TASK, env, policy, chat, limits, "g", score=grade))
    assert not traj.failed, traj.failure
    event(f"finish: {traj.finish_reason}")
    event(f"turns: {len(traj.turns)}")
    event(f"truncated replies: {sum(t.finish_reason != 'stop' for t in traj.turns) > 0}")
    assert len(traj.turns) == len(policy.gens) <= max_turns

    # the sequence is the prompt, then per turn exactly the generated tokens and the rendered results appended
    groups: list[tuple[Message, list[Message]]] = []
    for m in traj.messages[1:]:
        if m.role == "assistant":
            groups.append((m, []))
        else:
            groups[-1][1].append(m)
    expected = chat.render_prompt(env.tools, [traj.messages[0]])
    spans = []
    for turn, gen, request, (_, results) in zip(traj.turns, policy.gens, policy.requests, groups):
        assert turn.prompt_tokens == len(expected) and request.prompt_ids == expected
        spans.append(range(len(expected), len(expected) + len(gen)))
        expected += gen
        if turn.observation_tokens:
            closed = gen[-1] in chat.stop_ids
            expected += chat.render_observations(results, closed=closed)
    assert traj.token_ids == expected
    assert len(traj.token_ids) <= max_context

    # the tool results are what the environment returned, cut to max_output, in call order
    shown = []
    for parsed, results in groups:  # call ids are unique within a turn
        ran = {c.id for c in parsed.tool_calls if c.name == "run" and isinstance(c.arguments["cmd"], str)}
        shown += [m.content for m in results if m.tool_call_id in ran]
    assert shown == [truncate_output(r, max_output)[0] for r in env.returned]

    # every reasoning section the policy finished stays in the sequence, and parses back
    text = chat.tokenizer.decode(traj.token_ids)
    for (msg, cut), gen, (parsed, _) in zip(script * max_turns, policy.gens, groups):
        if gen == chat.render_assistant(msg):
            assert parsed.reasoning == msg.reasoning and msg.reasoning in text

    # the loss mask is 1 exactly on generated tokens, which alone carry logprobs and a policy version
    generated = {p for span in spans for p in span}
    assert {p for p, m in enumerate(traj.loss_mask) if m} == generated
    assert all((traj.logprobs[p] != 0.0) == (p in generated) for p in range(len(traj.token_ids)))
    assert all((traj.token_versions[p] >= 1) == (p in generated) for p in range(len(traj.token_ids)))


EPISODE = dict(max_turns=st.integers(1, 5), room=st.integers(1, 3000), max_output=st.integers(64, 300))


@pytest.mark.parametrize("name", ["bytes", "bpe"])
@settings(max_examples=100, deadline=None, database=None)
@given(script=replies(ANY), results=st.lists(ANY | st.text(min_size=200, max_size=600), max_size=12), **EPISODE)
def test_built_in_format_sequences_are_exact(name, script, results, max_turns, room, max_output):
    check_episode(name, script, results, max_turns, room, max_output)


@pytest.mark.parametrize("name", ["hf", "smollm2"])
@settings(max_examples=40, deadline=None, database=None)
@given(script=replies(PLAIN), results=st.lists(PLAIN, max_size=12), **EPISODE)
def test_hf_template_sequences_are_exact(name, script, results, max_turns, room, max_output):
    check_episode(name, script, results, max_turns, room, max_output)
