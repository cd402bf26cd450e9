"""Trajectory assembly behind the recording proxy (rollout/rows.py), as property tests: random harness conversations
that append, drop reasoning, edit an earlier message or summarise, against the built-in chat format (byte and BPE
tokenizers) and SmolLM2's real template, whose tools sandforge declares.

Whatever the harness does, the rows' policy tokens (loss mask 1) are exactly the generated tokens, in order, none
twice; a request that extends the row is its recorded tokens plus the new messages, never a re-tokenized history; a
rewrite starts a new row from the conversation as sent."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_agent_properties import chat_format

from sandforge.rollout.chat_api import ChatRequest, message_json, read_message
from sandforge.rollout.messages_api import message_reply, read_messages
from sandforge.rollout.proxy import reply_message
from sandforge.rollout.responses_api import read_responses, response_json
from sandforge.rollout.rows import RowRecorder, render_conversation
from sandforge.types import Message, Sample, ToolCall

TOOLS = [{"name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
# templates trim the text they render: keep it trimmed, so the samples made with render_assistant are what it renders
TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .,:;-_/\n", min_size=1, max_size=30).map(
    lambda t: t.strip() or "ok")


def echoed(reply: Message, names: dict) -> Message:
    """The reply as an OpenAI client sends it back: through its JSON and read again."""
    return read_message(json.loads(json.dumps(message_json(reply))), 0, names)


def sample_for(chat, msg: Message) -> Sample:
    ids = chat.render_assistant(msg)
    return Sample(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", version=3)


@st.composite
def episodes(draw):
    """Per request: what the harness does to its history first, and the reply the engine gives."""
    steps = []
    for i in range(draw(st.integers(1, 6))):
        action = "first" if i == 0 else draw(st.sampled_from(["tool", "tool", "user", "drop_reasoning", "edit",
                                                               "summarise"]))
        reply = Message(role="assistant", content=draw(TEXT), reasoning=draw(st.sampled_from(["", "think first"])),
                        tool_calls=[ToolCall("bash", {"command": draw(TEXT)})] if draw(st.booleans()) else [])
        steps.append((action, draw(TEXT), reply))
    return steps


def responses_body(messages: list[Message]) -> dict:
    """The conversation as a Responses client sends it: the policy's turns as the proxy gave them (output items)."""
    items: list[dict] = []
    for m in messages:
        if m.role == "assistant":
            items += response_json(m, "stop", 0, 0, "m", "resp_x", 0)["output"]
        elif m.role == "tool":
            items.append({"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content})
        else:
            items.append({"role": m.role, "content": m.content})
    tools = [{"type": "function", **t} for t in TOOLS]
    return {"model": "m", "input": items, "tools": tools}


def messages_body(messages: list[Message]) -> dict:
    """The conversation as an Anthropic client sends it: the system prompt apart, tool results in the user turn that
    follows them, the policy's turns as the proxy gave them (content blocks)."""
    system = "".join(m.content for m in messages if m.role == "system")
    turns: list[dict] = []
    for m in messages:
        if m.role == "assistant":
            turns.append({"role": "assistant", "content": message_reply(m, "stop", 0, 0, "m", "msg_x")["content"]})
            continue
        block = ({"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content} if m.role == "tool"
                 else {"type": "text", "text": m.content} if m.role == "user" else None)
        if block is None:
            continue
        if turns and turns[-1]["role"] == "user" and (block["type"] == "text" or turns[-1]["content"][-1]["type"]
                                                      == "tool_result"):
            turns[-1]["content"].append(block)  # results first, then the text: one user turn
        else:
            turns.append({"role": "user", "content": [block]})
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    return {"model": "m", "max_tokens": 64, "system": system, "messages": turns, "tools": tools}


def surface_request(surface: str, messages: list[Message]) -> ChatRequest:
    """The request the proxy reads from ``messages`` sent through ``surface``."""
    if surface == "responses":
        return read_responses(json.loads(json.dumps(responses_body(messages))))
    if surface == "messages":
        return read_messages(json.loads(json.dumps(messages_body(messages))))
    return ChatRequest(list(messages), TOOLS, None, {})


@pytest.mark.parametrize("fmt, surface", [("bytes", "chat"), ("bpe", "chat"), ("smollm2", "chat"),
                                          ("bpe", "responses"), ("smollm2", "responses"),
                                          ("bpe", "messages"), ("smollm2", "messages")])
@settings(max_examples=60, deadline=None)
@given(steps=episodes())
def test_rows_hold_every_generated_token_once(fmt, surface, steps):
    """... over each of the proxy's APIs (#58): OpenAI's Responses and Anthropic's Messages carry the conversation
    in their own shapes, and the recording rules hold the same."""
    chat = chat_format(fmt)
    recorder = RowRecorder(chat)
    messages = [Message(role="system", content="You are an agent."), Message(role="user", content="Do the task.")]
    names: dict[str, str] = {}
    generated: list[list[int]] = []
    rows_before = 0
    for i, (action, text, reply) in enumerate(steps):
        if action == "tool":
            last = messages[-1]
            call = last.tool_calls[0].id if last.role == "assistant" and last.tool_calls else ""
            messages.append(Message(role="tool", content=text, name="bash", tool_call_id=call))
        elif action == "user":
            messages.append(Message(role="user", content=text))
        elif action == "drop_reasoning":
            last = messages[-1]
            messages[-1] = Message(role="assistant", content=last.content or "ok", tool_calls=last.tool_calls)
            messages.append(Message(role="user", content=text))
        elif action == "edit":
            messages[1] = Message(role="user", content=messages[1].content + " " + text)
            messages.append(Message(role="user", content=text))
        elif action == "summarise":
            messages = [messages[0], Message(role="user", content="Summary so far: " + text)]
        request = surface_request(surface, messages)
        pending = recorder.prompt(request)
        rewrote = action in ("edit", "summarise") or (action == "drop_reasoning" and steps[i - 1][2].reasoning)
        if i and not rewrote:
            assert pending.extends, action
            row = recorder.rows[-1]
            assert pending.prompt_ids[: len(row.token_ids)] == row.token_ids  # recorded ids, never re-tokenized
        if rewrote:
            assert not pending.extends
            assert pending.prompt_ids == render_conversation(chat, TOOLS, request.messages)
        sample = sample_for(chat, reply)
        given_reply, _ = reply_message(chat, sample.token_ids, True, i, cut=False)
        recorder.record(pending, sample, given_reply)
        generated.append(sample.token_ids)
        messages.append(echoed(given_reply, names))
        event(f"rows {len(recorder.rows)}")
        assert len(recorder.rows) == rows_before + (0 if pending.extends else 1)
        rows_before = len(recorder.rows)

    policy = [t for row in recorder.rows for t, m in zip(row.token_ids, row.loss_mask) if m]
    assert policy == [t for ids in generated for t in ids]
    for row in recorder.rows:
        assert len(row.token_ids) == len(row.loss_mask) == len(row.logprobs) == len(row.token_versions)
        assert all((lp == -0.5) == bool(m) for lp, m in zip(row.logprobs, row.loss_mask))
        assert all((v == 3) == bool(m) for v, m in zip(row.token_versions, row.loss_mask))
        assert row.loss_mask[0] == 0  # every row starts with a prompt the policy did not write


def test_recorded_ids_are_kept_where_text_would_tokenize_otherwise():
    """The engine may emit a non-canonical tokenization (here one token per character where BPE merges); the row
    keeps those ids, and the next request's prompt starts with them, not with the text re-encoded."""
    chat = chat_format("bpe")
    tok = chat.tokenizer
    text = "the answer is there"
    odd = [i for ch in text for i in tok.encode(ch)] + [chat.end]
    assert odd[:-1] != tok.encode(text)  # the test means something only if BPE would merge
    recorder = RowRecorder(chat)
    messages = [Message(role="user", content="Say it.")]
    first = recorder.prompt(ChatRequest(list(messages), [], None, {}))
    sample = Sample(token_ids=odd, logprobs=[-1.0] * len(odd), finish_reason="stop")
    reply, finish = reply_message(chat, odd, False, 0, cut=False)
    assert reply.content == text and finish == "stop"
    recorder.record(first, sample, reply)
    messages += [echoed(reply, {}), Message(role="user", content="Again.")]
    second = recorder.prompt(ChatRequest(list(messages), [], None, {}))
    assert second.extends
    assert second.prompt_ids[len(first.prompt_ids) : len(first.prompt_ids) + len(odd)] == odd


def test_other_tools_or_a_changed_reply_start_a_new_row():
    chat = chat_format("bytes")
    recorder = RowRecorder(chat)
    messages = [Message(role="user", content="Go.")]
    p = recorder.prompt(ChatRequest(list(messages), TOOLS, None, {}))
    reply = Message(role="assistant", content="ok", tool_calls=[ToolCall("bash", {"command": "ls"}, "call_0_0")])
    recorder.record(p, sample_for(chat, reply), reply)
    answer = Message(role="tool", content="a.txt", name="bash", tool_call_id="call_0_0")
    assert recorder.prompt(ChatRequest([*messages, reply, answer], TOOLS, None, {})).extends
    assert not recorder.prompt(ChatRequest([*messages, reply, answer], [], None, {})).extends  # tools changed
    edited = Message(role="assistant", content="ok", tool_calls=[ToolCall("bash", {"command": "ls -a"}, "call_0_0")])
    assert not recorder.prompt(ChatRequest([*messages, edited, answer], TOOLS, None, {})).extends


def test_an_episode_of_several_rows_trains_each_with_the_episodes_one_advantage():
    """An RL step's rows from a harness episode recorded in two rows (job/rl_job.py training_rows, per_episode,
    per_row): every row trains, and each of its policy tokens gets the advantage the group gave the episode."""
    from sandforge.job.rl_job import per_episode, per_row, training_rows
    from sandforge.trainer.algorithms import resolve, token_advantages
    from sandforge.config import TrainerConfig
    from sandforge.types import Reward, Task, TokenRow, Trajectory

    task = Task(id="t", env="repo", family="f", seed=0, instruction="")

    def episode(value: float, split: bool) -> Trajectory:
        t = Trajectory(task=task, group="g", token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 0], logprobs=[0.0] * 4,
                       token_versions=[-1] * 4, reward=Reward(value, value > 0))
        if split:
            t.earlier_rows = [TokenRow([5, 6, 7], [0, 0, 1], [0.0, 0.0, -1.0], [-1, -1, 1])]
        return t

    trajs = [episode(1.0, True), episode(0.0, False)]
    rows = training_rows(trajs)
    assert [r.token_ids for r in rows] == [[5, 6, 7], [1, 2, 3, 4], [1, 2, 3, 4]]
    assert trajs[0].response_tokens == 3
    s = resolve(TrainerConfig(algorithm="grpo"), 64)
    adv, _ = token_advantages(s.algorithm.advantages, [1.0, 0.0], ["g", "g"],
                              per_episode([r.loss_mask for r in rows], trajs))
    split = per_row(adv, trajs)
    assert [len(a) for a in split] == [3, 4, 4]
    win, lose = split[0][2], split[2][1]
    assert win > 0 > lose
    assert split[0][:2] == [0.0, 0.0] and split[1] == [0.0, win, win, 0.0]  # both of its rows, the same advantage
