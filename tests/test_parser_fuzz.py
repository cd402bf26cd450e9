"""10,000 fuzzed model outputs per chat format through the parser and the tool dispatch: random token ids and bytes,
truncated calls, bad JSON, wrong argument types, unknown tools. None raises; every output yields a tool call that ran
or an error observation, and every call in it is answered."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest
from agent_fakes import limits

from sandforge.environments.base import ToolEnv
from sandforge.environments.tools import tool
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.agent import answer_reply
from sandforge.types import Message, ToolCall

N = 10_000


class FuzzEnv(ToolEnv):
    """Cheap tools of every parameter type; nothing here can hang or grow with the input."""

    @tool
    def echo(self, text: str) -> str:
        """Say it back."""
        return text[:100]

    @tool
    def add(self, a: int, b: int = 0) -> str:
        """Add integers."""
        return str(a + b)[:50]

    @tool
    def scale(self, x: float, loud: bool = False) -> str:
        """Scale."""
        return str(x * 2)

    @tool
    def submit(self) -> str:
        """Finish."""
        self.end_episode()
        return "submitted"


NAMES = ["echo", "add", "scale", "submit", "ecoh", "", "bash", "é", "x" * 300, "add\n", "__init__", "end_episode"]
VALUES = ["hi", "", "a\x00b", 1, -(10**40), 2.5, float("1e308"), True, None, [1, 2], {"k": "v"}, "<|end|>", "\ud800"]
BAD_JSON = ['{"name": "echo", "arguments": {', '{"name": echo}', "[]", "null", '{"name": "x", "arguments": "s"}',
            "1e999999", '{"name": ""}', "[" * 5000, '{"name": "echo", "arguments": {"text": NaN}}', "{'name': 'echo'}",
            '{"name": "add", "arguments": {"a": 1}, "name": 3}', '"echo"', '{"name": ["echo"]}', "\x00", "{}"]  # fmt: skip


VALID = [lambda r: ToolCall("echo", {"text": r.choice(["hi", "", "a\x00b", "<|end|>", "é" * 50])}),
         lambda r: ToolCall("add", {"a": r.randrange(-10**30, 10**30), "b": r.randrange(9)}),
         lambda r: ToolCall("scale", {"x": r.choice([1, 2.5, -0.0, 1e308]), "loud": r.random() < 0.5}),
         lambda r: ToolCall("submit")]  # fmt: skip


def random_call(rng: random.Random) -> ToolCall:
    """A valid call, or one made wrong in one way: an argument's type, the tool's name, an extra or missing one."""
    call = rng.choice(VALID[:3] if rng.random() < 0.9 else VALID)(rng)
    roll = rng.random()
    if roll < 0.4:
        return call
    if roll < 0.6 and call.arguments:
        key = next(iter(call.arguments))
        call.arguments[key] = rng.choice([v for v in VALUES if type(v) is not type(call.arguments[key])])
    elif roll < 0.75:
        call.name = rng.choice(NAMES[4:])
    elif roll < 0.9:
        call.arguments[rng.choice(["zz", "text", "b", ""])] = rng.choice(VALUES)
    else:
        call.arguments = {}
    return call


def call_json(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(BAD_JSON)
    call = random_call(rng)
    return json.dumps({"name": call.name, "arguments": call.arguments})


def k2_call(rng: random.Random, k: int) -> str:
    """Kimi K2: the name is in the call id, the arguments are bare JSON."""
    call = random_call(rng)
    args = rng.choice(BAD_JSON) if rng.random() < 0.3 else json.dumps(call.arguments)
    ident = f"functions.{call.name}:{k}" if rng.random() < 0.9 else rng.choice(["", "functions.a b:0", "x:y:z"])
    return f"<|tool_call_begin|>{ident}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def builtin_outputs(chat: ChatFormat, rng: random.Random, n: int):
    tok = chat.tokenizer
    specials = [chat.bos, chat.eos, chat.end, chat.system, chat.user, chat.assistant, chat.tool, chat.think,
                chat.think_end, chat.call, chat.call_end]  # fmt: skip
    for i in range(n):
        kind = i % 5
        if kind == 0:  # random ids over the whole vocabulary, out-of-range ones too
            yield [rng.randrange(-5, len(tok) + 5) for _ in range(rng.randrange(40))]
        elif kind == 1:  # random bytes, sometimes closed
            ids = [rng.randrange(256) for _ in range(rng.randrange(60))]
            yield ids + [chat.end] * rng.randrange(2)
        elif kind == 2:  # a well-formed reply with random calls, cut anywhere
            calls = [random_call(rng) for _ in range(rng.randrange(6))]
            ids = chat.render_assistant(Message("assistant", "ok", "plan", calls))
            yield ids[: rng.randrange(len(ids) + 1)] if rng.random() < 0.5 else ids
        else:  # structure with bad JSON, wrong types and unknown tools inside, control tokens spliced in
            ids = [chat.think, *tok.encode("think"), chat.think_end]
            for _ in range(rng.randrange(1, 4)):
                ids += [chat.call, *tok.encode(call_json(rng))] + ([chat.call_end] if rng.random() < 0.8 else [])
            for _ in range(rng.randrange(3) if kind == 4 else 0):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            yield ids + ([chat.end] if rng.random() < 0.8 else [])


def hf_outputs(chat, rng: random.Random, n: int):
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>", "<|tool_calls_section_begin|>",
              "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
              "functions.echo:0", "functions.add:1", "functions.:x", "\n", "{", "}", '"name"', ":"]  # fmt: skip
    for i in range(n):
        kind = i % 4
        if kind == 0:
            yield [rng.randrange(-5, len(chat.tokenizer) + 5) for _ in range(rng.randrange(30))]
            continue
        if kind == 1:  # hermes calls
            body = "".join(f"<tool_call>\n{call_json(rng)}\n</tool_call>" for _ in range(rng.randrange(1, 5)))
        elif kind == 2:  # kimi k2 calls
            calls = "".join(k2_call(rng, k) for k in range(rng.randrange(1, 5)))
            body = f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"
        else:
            body = "".join(rng.choice(pieces + [chr(rng.randrange(32, 0x2FFF))]) for _ in range(rng.randrange(30)))
        text = f"<think>\nplan\n</think>\n\n{body}"
        text = text[: rng.randrange(len(text) + 1)] if rng.random() < 0.3 else text + "<|im_end|>"
        yield chat.tokenizer.encode(text, add_special_tokens=False)


def run_fuzz(chat, outputs) -> Counter:
    lim = limits(max_tool_calls=3, max_tool_output=200)
    seen: Counter = Counter()

    async def main():
        for ids in outputs:
            env = FuzzEnv()
            try:
                message, errors, out = await answer_reply(env, chat, ids, lim)
            except Exception as e:  # noqa: BLE001 - the assertion below names the input
                pytest.fail(f"{type(e).__name__}: {e} on {ids[:80]!r}")
            assert isinstance(message, Message) and all(isinstance(e, str) and e for e in errors)
            assert all(isinstance(c.name, str) and c.name and isinstance(c.arguments, dict) for c in message.tool_calls)
            assert out.results, "every reply gets an answer"
            for m in out.results:
                assert m.role == "tool" and isinstance(m.content, str)
            ran = out.executed  # whatever is not an error observation is the output of a call that ran
            assert sum(not m.content.startswith("Error: ") for m in out.results) <= ran
            if not out.terminated:  # every call answered: one message per parse error and per call
                assert len(out.results) == max(1, len(errors) + len(message.tool_calls))
            seen["executed"] += ran
            for text in errors + out.errors:
                for key in ("invalid JSON", "unknown tool", "must be integer", "must be string", "not closed",
                            "unknown argument", "missing argument", "cut off", "not run: at most"):
                    seen[key] += key in text

    asyncio.run(main())
    return seen


def assert_variety(seen: Counter, keys) -> None:
    assert seen["executed"] > 200, seen
    for key in keys:
        assert seen[key] > 20, (key, seen)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_built_in_parser_fuzz(tokenizer):
    from sandforge.models.bpe import load_tokenizer

    chat = ChatFormat(ByteTokenizer() if tokenizer == "bytes" else load_tokenizer("bpe"))
    seen = run_fuzz(chat, builtin_outputs(chat, random.Random(0), N // 2))
    assert_variety(seen, ["invalid JSON", "unknown tool", "must be integer", "must be string", "not closed",
                          "unknown argument", "cut off", "not run: at most"])


@pytest.mark.parametrize("parser", ["hermes", "kimi_k2"])
def test_hf_parser_fuzz(parser):
    pytest.importorskip("transformers")
    from test_hf import build_tokenizer

    from sandforge.models.hf_chat import HFChatFormat

    chat = HFChatFormat(build_tokenizer(), parser=parser)
    seen = run_fuzz(chat, hf_outputs(chat, random.Random(1), N // 2))
    assert_variety(seen, ["invalid JSON", "unknown tool", "must be integer", "not closed", "cut off"])
