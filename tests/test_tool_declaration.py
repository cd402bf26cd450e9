"""Tool calling for any chat template: a template that cannot show tools (SmolLM2's ChatML) gets them declared by
sandforge in the hermes style, and the model's calls parse back; a template that can show them keeps its own way."""

from __future__ import annotations

import copy

import pytest
from pulled_models import smollm2_tokenizer

from sandforge.models.hf_chat import HFChatFormat
from sandforge.types import Message, ToolCall

BASH = {"name": "bash", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@pytest.fixture(scope="module")
def smol():
    return HFChatFormat(copy.deepcopy(smollm2_tokenizer()))


def test_a_template_without_tools_gets_them_declared_and_its_calls_parse(smol):
    assert smol.declares_tools  # auto: SmolLM2's template shows no tool it is given
    prompt = smol.tokenizer.decode(smol.render_prompt([BASH], [Message("user", "List the files.")]))
    assert prompt.startswith("<|im_start|>system\nYou can use tools.") and '"name": "bash"' in prompt
    assert prompt.endswith("<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n")
    # what a model writes after the declaration, end-of-turn token included, becomes the call
    reply = smol.tokenizer.encode('<think>\nI should look.\n</think>\n<tool_call>\n{"name": "bash", "arguments": '
                                  '{"command": "ls -la"}}\n</tool_call><|im_end|>')
    msg, errors = smol.parse_assistant(reply)
    assert errors == [] and msg.reasoning == "I should look."
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("bash", {"command": "ls -la"})]
    # a demonstration renders the same way and parses back whole
    demo = Message("assistant", "Checking.", "Plan it.", [ToolCall("bash", {"command": "pwd"}, "call_0")])
    back, errors = smol.parse_assistant(smol.render_assistant(demo))
    assert errors == [] and (back.content, back.reasoning, back.tool_calls) == ("Checking.", "Plan it.",
                                                                              demo.tool_calls)


def test_tool_results_come_back_as_one_user_turn_of_tool_responses(smol):
    results = [Message("tool", "a.txt\nb.txt", name="bash"), Message("tool", "done", name="bash")]
    delta = smol.tokenizer.decode(smol.render_observations(results, closed=True))
    # the newline after the policy's <|im_end|> is the template's, so it opens the appended tokens
    assert delta == ("\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response>\n<tool_response>\ndone\n"
                     "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tool_format_template_keeps_the_template_even_without_tools(smol):
    plain = HFChatFormat(copy.deepcopy(smollm2_tokenizer()), tool_format="template")
    assert not plain.declares_tools
    assert "bash" not in plain.tokenizer.decode(plain.render_prompt([BASH], [Message("user", "hi")]))


def test_a_template_that_shows_tools_keeps_its_own_way():
    from test_hf import build_tokenizer

    chat = HFChatFormat(build_tokenizer())
    assert not chat.declares_tools and "bash" in chat.tokenizer.decode(chat.render_prompt([BASH], [Message("user",
                                                                                                         "hi")]))


def test_a_chat_template_override_replaces_the_models_own():
    override = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = HFChatFormat(copy.deepcopy(smollm2_tokenizer()), chat_template=override)
    assert not chat.declares_tools  # the override shows tools, so auto keeps the template
    assert "TOOLS bash\n" in chat.tokenizer.decode(chat.render_prompt([BASH], [Message("user", "hi")]))
