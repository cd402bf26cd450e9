"""SFT from chat data (job/sft_data.py, ``warmup.data``, #55): JSONL conversations as TRL and prime-rl take them
(roles, tool calls, reasoning, tool results) rendered with the policy's own template and trained on the assistant
tokens only; a bad line is an error naming the file and line."""

from __future__ import annotations

import json

import pytest
from agent_fakes import CHAT
from pulled_models import smollm2_tokenizer

from sandforge.job.sft_data import DataError, conversation_row, data_rows, read_conversations
from sandforge.models.hf_chat import HFChatFormat
from sandforge.types import Message, ToolCall

TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "write a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}]
AGENTIC = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You are careful."},
    {"role": "user", "content": "Write 42 to /tmp/a."},
    {"role": "assistant", "content": "", "reasoning_content": "One call does it.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "write_file", "arguments": json.dumps({"path": "/tmp/a", "content": "42"})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "wrote 2 bytes"},
    {"role": "assistant", "content": "Done."}]}
CHATTY = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                       {"role": "assistant", "content": "Hello!"},
                       {"role": "user", "content": "bye"},
                       {"role": "assistant", "content": "Goodbye."}]}


def write(tmp_path, *rows, raw: str = ""):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + raw)
    return path


def test_roles_tool_calls_reasoning_and_tool_results_are_read(tmp_path):
    agentic, chatty = read_conversations(write(tmp_path, AGENTIC, CHATTY))
    assert [m.role for m in agentic.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = agentic.messages[2]
    assert call.reasoning == "One call does it." and call.tool_calls[0].name == "write_file"
    assert call.tool_calls[0].arguments == {"path": "/tmp/a", "content": "42"}
    assert agentic.messages[3].name == "write_file"  # the tool result names its call's tool
    assert agentic.tools[0]["name"] == "write_file" and chatty.tools == []
    assert chatty.messages[0].content == "hi there" and chatty.where.endswith("data.jsonl:2")


@pytest.mark.parametrize("line, says", [
    ("{not json", "data.jsonl:3: not JSON"),
    (json.dumps({"text": "no messages"}), "data.jsonl:3: expected an object with a non-empty list `messages`"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "data.jsonl:3: no assistant"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "data.jsonl:3: messages\\[0\\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": "oops"}}]}),
     "data.jsonl:3: tools\\[0\\].function.parameters"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, says):
    with pytest.raises(DataError, match=says):
        read_conversations(write(tmp_path, AGENTIC, CHATTY, raw=line + "\n"))


def test_a_folder_is_a_saved_dataset_or_a_clear_error(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    with pytest.raises(DataError, match="saved"):
        read_conversations(folder)
    with pytest.raises(DataError, match="no such file"):
        read_conversations(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("chat", ["builtin", "smollm2"])
def test_the_loss_is_on_the_assistant_tokens_only_rendered_as_an_episode(tmp_path, chat):
    """On the built-in format and on SmolLM2's own template: the masked tokens are exactly each assistant reply as the
    agent loop renders a policy turn, in order; the system, user and tool text is context only."""
    fmt = CHAT if chat == "builtin" else HFChatFormat(smollm2_tokenizer())
    conv = read_conversations(write(tmp_path, AGENTIC))[0]
    row = conversation_row(fmt, conv)
    assert len(row.token_ids) == len(row.loss_mask)
    learnt = [t for t, m in zip(row.token_ids, row.loss_mask) if m]
    replies = [fmt.render_assistant(m) for m in conv.messages if m.role == "assistant"]
    assert learnt == [t for r in replies for t in r]
    context = fmt.tokenizer.decode([t for t, m in zip(row.token_ids, row.loss_mask) if not m])
    assert "Write 42 to /tmp/a." in context and "wrote 2 bytes" in context and "You are careful." in context
    assert row.token_ids[: len(fmt.render_prompt(conv.tools, conv.messages[:2]))] == \
        fmt.render_prompt(conv.tools, conv.messages[:2])  # the prompt an episode of the same task starts with


def test_conversations_past_the_context_are_counted_not_dropped_silently(tmp_path):
    rows, long = data_rows(CHAT, write(tmp_path, AGENTIC, CHATTY), max_context=10_000)
    assert len(rows) == 2 and long == 0
    short = len(conversation_row(CHAT, read_conversations(write(tmp_path, CHATTY))[0]).token_ids)
    rows, long = data_rows(CHAT, write(tmp_path, AGENTIC, CHATTY), max_context=short)
    assert len(rows) == 1 and long == 1


def test_the_warm_start_takes_data_with_or_without_reference_episodes(tmp_path):
    from sandforge.config import ConfigError, load_config

    path = write(tmp_path, AGENTIC)
    cfg = load_config("configs/terminal.yaml", ["warmup.steps=2", "warmup.episodes=0", f"warmup.data={path}"])
    assert cfg.warmup.data == path and cfg.warmup.episodes == 0
    from sandforge.job.preflight import validate_job

    validate_job(cfg, "configs/terminal.yaml")
    with pytest.raises(ConfigError, match="nothing to learn from"):
        validate_job(load_config("configs/terminal.yaml", ["warmup.steps=2", "warmup.episodes=0"]), "x.yaml")
    with pytest.raises(ConfigError, match="warmup.data.*no such file"):
        validate_job(load_config("configs/terminal.yaml", ["warmup.steps=2", f"warmup.data={tmp_path}/none.jsonl"]),
                     "x.yaml")


def test_a_warm_start_that_has_no_reference_to_replay_for_an_environment_is_refused_before_anything_runs(tmp_path):
    """#55: a warm start drawing from an environment whose tasks bring no reference solution (a verifiers
    environment, a Harbor folder without solution/) ran its episodes for a minute before failing with "no reference
    episode passed its verifier". It is refused when the job is checked, naming the environment and the ways out;
    drawn in RL only, or learning from data instead, it passes."""
    import shutil

    from sandforge.config import ConfigError, load_config
    from sandforge.job.preflight import validate_job

    folder = tmp_path / "tasks"
    shutil.copytree("tests/data/harbor/hello-file", folder / "hello-file")
    harbor = [f"environments=[{{name: harbor, tasks: {folder}}}]", "warmup.steps=2", "warmup.episodes=4"]
    validate_job(load_config("configs/harbor.yaml", harbor), "harbor.yaml")  # its solution/ is a reference
    shutil.rmtree(folder / "hello-file" / "solution")
    with pytest.raises(ConfigError, match=r"harbor.yaml: 'warmup.episodes' is 4, but environments\[0\] \(harbor\) "
                                          "brings no reference solution.*'rl_weight'.*'warmup.data'"):
        validate_job(load_config("configs/harbor.yaml", harbor), "harbor.yaml")
    validate_job(load_config("configs/harbor.yaml", harbor), "harbor.yaml", warm_start=False)  # `sandforge eval`
    rl_only = [f"environments=[{{name: harbor, tasks: {folder}}}, {{name: terminal, weight: 1}}]",
               "environments.0.weight=0", "environments.0.rl_weight=1", "warmup.steps=2", "warmup.episodes=4"]
    validate_job(load_config("configs/harbor.yaml", rl_only), "harbor.yaml")
    data = write(tmp_path, AGENTIC)
    validate_job(load_config("configs/harbor.yaml", [*harbor[:2], "warmup.episodes=0", f"warmup.data={data}"]),
                 "harbor.yaml")
