"""A local Hugging Face model (tiny random Qwen3-MoE, offline BPE tokenizer, Qwen-like template) as a policy."""

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from sandforge.models.sampling import SamplingParams, token_logprobs  # noqa: E402
from sandforge.engine.naive import generate_batch_naive  # noqa: E402
from sandforge.models.hf import HFPolicy, load_hf_policy  # noqa: E402
from sandforge.models.hf_chat import PARSERS, HFChatFormat, TemplateDeltaError  # noqa: E402
from sandforge.types import Message, ToolCall  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]

# Qwen-like: tools in the system message, reasoning in <think>, calls as <tool_call> JSON, results as user turns.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3's own template for earlier turns: drops the reasoning of any assistant message that is not the last one.
DROPS_REASONING = TEMPLATE.replace("{% if m.reasoning_content %}", "{% if m.reasoning_content and loop.last %}")

TEXT = [
    "The quick brown fox jumps over the lazy dog while the tool returns a result.",
    'Call the function with arguments {"path": "main.py", "line": 3} and read the output.',
    "system user assistant tool response think plan run list files tests pass fail error",
    "def main():\n    print('hello world')\n    return 0\n",
]


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[3:] + ["<|im_start|>"],
        chat_template=TEMPLATE,
    )


def save_tiny_qwen3_moe(path, max_positions: int = 256, sharpen: float = 25.0):
    """A tiny random Qwen3-MoE and its tokenizer, saved in ``path`` the way a downloaded model would be."""
    tokenizer = build_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=max_positions, router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharpen it: a freshly initialised model mostly predicts one token
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(sharpen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"))


@pytest.fixture(scope="module")
def policy(checkpoint):
    return load_hf_policy(checkpoint)


def test_loads_offline_with_policy_attributes(policy):
    model, chat = policy
    assert model.config.max_seq_len == 256 and model.vocab_size == len(chat.tokenizer)
    assert chat.stop_ids == [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def greedy_reference(model, prompt, n):
    """One prompt, no padding, no cache: a full forward per token."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_cached_generate_equals_unbatched_greedy_and_token_logprobs(policy):
    model, chat = policy
    prompts = [
        chat.render_prompt([], [Message("user", "list files")]),
        chat.render_prompt([{"name": "run", "description": "run a command"}], [Message("user", "run the tests")]),
        chat.render_prompt([], [Message("system", "Be brief."), Message("user", "The quick brown fox jumps")]),
    ]
    assert len({len(p) for p in prompts}) == 3
    gens = generate_batch_naive(model, prompts, SamplingParams(max_new_tokens=12, temperature=0))
    outputs = [g.token_ids for g in gens]
    assert len({tuple(o) for o in outputs}) > 1, "the model is too flat for this test to mean anything"
    for prompt, gen in zip(prompts, gens):
        assert gen.token_ids == greedy_reference(model, prompt, len(gen.token_ids))

    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    width = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), width, dtype=torch.long), torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        lp, aux = token_logprobs(model, ids, mask)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        got = lp[i, len(p) : len(p) + len(g.token_ids)]
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=1e-4)
    assert aux.ndim == 0 and aux.item() > 0  # router balance loss of the MoE config


def test_cache_select_keeps_the_original(policy):
    model, chat = policy
    prompt = torch.tensor([chat.render_prompt([], [Message("user", "hello")])] * 2)
    with torch.no_grad():
        res = model(prompt, use_cache=True)
        one = res.cache.select(torch.tensor([1]))
        step = torch.tensor([[5]])
        a = model(step, cache=one, use_cache=True).logits
        b = model(torch.tensor([[5], [5]]), cache=res.cache, use_cache=True).logits  # original still 2 rows, intact
        full = model(torch.cat([prompt[:1], step], 1)).logits[:, -1:]
    assert torch.allclose(a, full, atol=1e-4) and torch.allclose(b[1:], full, atol=1e-4)


def test_dense_model_from_config_has_zero_aux_loss():
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    model = HFPolicy(transformers.AutoModelForCausalLM.from_config(config))
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 3, 50) and out.aux_loss.item() == 0.0
    assert model.config.max_seq_len == 64 and out.router_ids is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_right_padded_batch_runs_causal_without_its_mask_and_scores_as_with_it(family):
    """``causal_right_padding``: a right-padded batch without a cache reaches the model with no padding mask (so SDPA
    takes its causal kernel); the logits at every real token, and the trainer's log-probs, are those of the masked
    forward (the reference). A left-padded batch keeps its mask; an MoE config never drops it."""
    from sandforge.models.sampling import token_logprobs

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = cls(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = HFPolicy(transformers.AutoModelForCausalLM.from_config(config)).eval()
    seen = []
    model.model.model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(1, 60, (3, 12))
    lengths = [12, 7, 3]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    with torch.no_grad():
        fast = model(ids, attention_mask=mask).logits
        assert seen[-1] is None
        lp_fast, _ = token_logprobs(model, ids, mask)
        model.causal_right_padding = False
        ref = model(ids, attention_mask=mask).logits
        assert seen[-1] is not None
        lp_ref, _ = token_logprobs(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(fast[real], ref[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_fast, lp_ref, atol=1e-5, rtol=1e-5)
    model.causal_right_padding = True
    with torch.no_grad():
        model(ids, attention_mask=mask.flip(1))  # left-padded
    assert seen[-1] is not None


def test_an_moe_policy_keeps_its_padding_mask(policy):
    assert policy[0].causal_right_padding is False


def test_multi_turn_sequence_equals_a_full_render(policy):
    """Prompt + each turn's generated tokens + each rendered delta == rendering the whole history at once."""
    _, chat = policy
    history = [{"role": "user", "content": "fix the bug"}]
    seq = chat.render_prompt([], [Message("user", "fix the bug")])
    for turn in range(3):
        call = ToolCall("run", {"cmd": f"step {turn}"}, f"call_{turn}")
        reply = Message("assistant", f"turn {turn}", f"think {turn}", [call])
        seq += chat.render_assistant(reply)
        seq += chat.render_observations([Message("tool", f"out {turn}\n", name="run")], closed=True)
        history.append({"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                        "tool_calls": [{"id": call.id, "type": "function",
                                        "function": {"name": "run", "arguments": call.arguments}}]})  # fmt: skip
        history.append({"role": "tool", "content": f"out {turn}\n", "name": "run"})
    assert seq == chat.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert all(f"think {t}" in chat.tokenizer.decode(seq) for t in range(3))


def test_observation_delta_extends_the_sequence_exactly(policy):
    _, chat = policy
    tok = chat.tokenizer
    tools = [{"name": "run", "description": "run a command", "parameters": {"type": "object", "properties": {}}}]
    prompt = chat.render_prompt(tools, [Message("user", "run the tests")])
    reply = Message("assistant", "", "I will run them.", [ToolCall("run", {"cmd": "pytest -q"}, "call_0")])
    generated = chat.render_assistant(reply)
    assert generated[-1] == chat.end_of_turn
    results = [Message("tool", "3 passed", name="run"), Message("tool", "ok", name="run")]
    delta = chat.render_observations(results, closed=True)
    seq = prompt + generated + delta
    # the whole history rendered at once gives exactly the same tokens: nothing was re-rendered or merged
    history = [{"role": "user", "content": "run the tests"}]
    history.append({"role": "assistant", "content": "", "reasoning_content": "I will run them.", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "run", "arguments": {"cmd": "pytest -q"}}}]})
    history += [{"role": "tool", "content": r.content, "name": "run"} for r in results]
    tools_schema = [{"type": "function", "function": tools[0]}]
    assert seq == tok.apply_chat_template(history, tools=tools_schema, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert "<think>\nI will run them.\n</think>" in tok.decode(seq)  # reasoning stays in the history
    assert chat.render_observations(results, closed=False) == [chat.end_of_turn, *delta]
    msg, errors = chat.parse_assistant(generated)
    assert errors == [] and msg.reasoning == reply.reasoning and msg.tool_calls[0].arguments == {"cmd": "pytest -q"}


def test_template_that_rewrites_history_is_detected(checkpoint):
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    tok.chat_template = DROPS_REASONING
    chat = HFChatFormat(tok)
    with pytest.raises(TemplateDeltaError, match="does not extend the sequence exactly"):
        chat.render_observations([Message("tool", "3 passed", name="run")], closed=True)


def hermes_text(msg):
    calls = "".join(
        f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in msg.tool_calls
    )
    return f"<think>\n{msg.reasoning}\n</think>\n\n{msg.content}{calls}"


def kimi_text(msg):
    calls = "".join(
        f"<|tool_call_begin|>functions.{c.name}:{i}<|tool_call_argument_begin|>{json.dumps(c.arguments)}"
        "<|tool_call_end|>"
        for i, c in enumerate(msg.tool_calls)
    )
    return f"<think>{msg.reasoning}</think>{msg.content}<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"


@pytest.mark.parametrize("name,render", [("hermes", hermes_text), ("kimi_k2", kimi_text)])
def test_parsers_round_trip_and_never_raise(name, render):
    parse = PARSERS[name]
    msg = Message(
        "assistant", "Running both.", "Two calls: ls, then cat.",
        [ToolCall("ls", {"path": "."}), ToolCall("cat", {"path": "a b.txt", "n": [1, {"x": None}]})],
    )  # fmt: skip
    text = render(msg)
    got, errors = parse(text)
    assert errors == []
    assert (got.content, got.reasoning) == (msg.content, msg.reasoning)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in msg.tool_calls]

    bad, errors = parse(text.replace('{"path": "."}', '{"path": .}'))
    assert len(bad.tool_calls) == 1 and any("invalid JSON" in e for e in errors)
    cut, errors = parse(text[: len(text) - 30])
    assert errors and len(cut.tool_calls) <= 1

    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"name"', ":", '"arguments"', "[",
              "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
              "<|tool_call_end|>", "<|tool_calls_section_end|>", "functions.x:0",
              "\\", "\x00", "1e999999", "null"]  # fmt: skip
    for _ in range(2000):
        if rng.random() < 0.5:
            fuzz = "".join(rng.choice(pieces + [chr(rng.randrange(0x10FFFF))]) for _ in range(rng.randrange(12)))
        else:
            fuzz = text[: rng.randrange(len(text))] + text[rng.randrange(len(text)) :]
        got, errors = parse(fuzz)
        assert isinstance(got, Message) and all(isinstance(e, str) for e in errors)
        assert all(isinstance(c.arguments, dict) and c.name for c in got.tool_calls)


def test_parse_assistant_never_raises_on_random_ids(policy):
    _, chat = policy
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(chat.tokenizer)) for _ in range(rng.randrange(20))]
        msg, errors = chat.parse_assistant(ids)
        assert isinstance(msg, Message) and isinstance(errors, list)
    assert chat.parse_assistant(["x"])[1]
