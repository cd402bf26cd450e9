"""Synthetic pretraining data (job/pretraining_data.py): well-formed calls of the job's tools, loss on the answer only,
values made of train-split syllable words only (environments/words.py)."""

from __future__ import annotations

import json
import random
import re

from sandforge.config import ModelConfig
from sandforge.models.build import load_chat
from sandforge.job.pretraining_data import copy_exchange, copy_rows, env_tools


def job_tools(env_names: list[str]) -> list[dict]:
    """The tool schemas of the job's environments (one entry per distinct tool name)."""
    tools: dict[str, dict] = {}
    for schemas in env_tools(env_names).values():
        for schema in schemas:
            tools.setdefault(schema["name"], schema)
    return list(tools.values())


ENVS = ["terminal", "repo", "slack", "notion", "browser"]


def test_job_tools_are_every_environment_tool_once():
    names = [t["name"] for t in job_tools(ENVS)]
    assert len(names) == len(set(names))
    assert {"write_file", "str_replace", "post_message", "create_page", "goto", "submit"} <= set(names)
    assert [t["name"] for t in job_tools(["terminal"])] == ["bash", "read_file", "write_file", "submit"]


def test_each_exchange_asks_for_the_call_its_answer_makes():
    chat = load_chat(ModelConfig())
    tools = {t["name"]: t for t in job_tools(ENVS)}
    rng = random.Random(0)
    for _ in range(300):
        tool = rng.choice(list(tools.values()))
        prompt, answer = copy_exchange(chat, tool, rng)
        assert prompt[-1] == chat.assistant and answer[-1] == chat.end
        msg, errors = chat.parse_assistant(answer)
        assert not errors and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.name == tool["name"]
        props = tool["parameters"]["properties"]
        assert set(tool["parameters"]["required"]) <= set(call.arguments) <= set(props)
        asked = chat.tokenizer.decode(prompt)
        for value in call.arguments.values():  # every value to copy is in the request
            assert (value if isinstance(value, str) else json.dumps(value)) in asked


def test_rows_train_on_the_answer_only_and_use_no_heldout_words():
    from sandforge.environments.words import WORDS, split_of

    chat = load_chat(ModelConfig())
    rows = copy_rows(chat, env_tools(ENVS), random.Random(1), 200)
    for row in rows:
        mask = row.loss_mask
        assert len(mask) == len(row.token_ids) and mask[-1] == 1
        first = mask.index(1)
        assert not any(mask[:first]) and all(mask[first:])  # one contiguous answer at the end
        assert row.token_ids[first] == chat.think
    text = " ".join(chat.tokenizer.decode(r.token_ids) for r in rows).lower()
    syllable_words = set(re.findall(r"\b(?:[bdfgklmnprstvz][aeiou])+\b", text))
    assert len(syllable_words) > 100
    assert {split_of(w) for w in syllable_words} == {"train"}  # held-out tasks' words never appear
    assert not syllable_words & set(WORDS["heldout"])


def test_a_share_of_exchanges_lists_the_environments_tools_as_an_episode_does():
    chat = load_chat(ModelConfig())
    tools = env_tools(ENVS)
    listings = {env: chat.render_prompt(schemas, [])[:-2] for env, schemas in tools.items()}  # up to <|end|>
    for listed, lo, hi in ((0.0, 0, 0), (1.0, 100, 100), (0.5, 30, 70)):
        rows = copy_rows(chat, tools, random.Random(2), 100, listed=listed)
        n = 0
        for row in rows:
            ids = row.token_ids
            hits = [env for env, head in listings.items() if ids[: len(head)] == head]
            n += bool(hits)
            if hits:  # the requested tool is one of the listed environment's
                call = chat.parse_assistant(ids[row.loss_mask.index(1):])[0].tool_calls[0]
                assert any(call.name == t["name"] for env in hits for t in tools[env])
        assert lo <= n <= hi, (listed, n)
