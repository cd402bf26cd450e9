"""Synthetic pretraining: a policy built from scratch learns to copy text into tool calls before it sees a task.

A real base model arrives knowing how to repeat a name or a phrase it was just shown; a K3 policy initialised at
random does not, and a few hundred reference episodes over small word pools teach it to memorise them instead (it then
writes words from its training tasks where a held-out task asks for new ones). This stage gives it the copying a
pretrained model has: short generated exchanges in the policy's own chat format, each asking for one call of one of
the job's tools with argument values made of random syllable words, numbers, paths, channels and dates, and answered
with exactly that call (loss on the answer only). Nothing in them comes from a task, and the words are train-split
syllable words (environments/words.py), the kind tasks are made of, so held-out tasks stay held out.

``pretrain.steps`` of ``pretrain.batch_size`` exchanges each, before the warm start, on the same trainer (``sft``
mode). A policy loaded with ``model.init_from`` is pretrained already: set ``pretrain.steps: 0``.
"""

from __future__ import annotations

import json
import random

from sandforge.environments import words
from sandforge.types import Message, ToolCall, TrainingRow

def word(rng: random.Random) -> str:
    """A train-split syllable word: held-out words (environments/words.py) never appear in pretraining."""
    return words.word(rng, "train")


def phrase(rng: random.Random, lo: int = 1, hi: int = 4) -> str:
    return " ".join(word(rng) for _ in range(rng.randint(lo, hi)))


# the shapes tool arguments take besides plain words: a path, a channel, a name, a date, a time, an id
_SHAPES = (
    lambda r: f"/workspace/{word(r)}.{r.choice(['txt', 'py', 'md'])}",
    lambda r: f"#{word(r)}",
    lambda r: f"{word(r).capitalize()} {word(r).capitalize()}",
    lambda r: f"20{r.randint(20, 39)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    lambda r: f"{r.randint(8, 22):02d}:{r.choice(['00', '15', '30', '45'])}",
    lambda r: f"{r.choice('pCM')}{r.randint(1, 99):02d}",
)


def string_value(rng: random.Random) -> str:
    """A string argument: one of ``_SHAPES`` three times in four, else a phrase of words."""
    kind = rng.randrange(len(_SHAPES) + 2)
    return _SHAPES[kind](rng) if kind < len(_SHAPES) else phrase(rng)


def value_for(schema: dict, rng: random.Random):
    kind = schema.get("type", "string")
    if kind == "integer":
        return rng.randint(0, 99)
    if kind == "number":
        return round(rng.uniform(0, 99), 1)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return string_value(rng)
    return None  # arrays and objects: left out


def env_tools(env_names: list[str]) -> dict[str, list[dict]]:
    """Each environment's tool schemas, as its episodes list them to the policy."""
    from sandforge.environments.tools import tool_schemas
    from sandforge.registry import environment

    out = {}
    for name in env_names:
        entry = environment(name)
        if entry.library_loader is not None:  # a verifiers environment: its requests carry their own tools
            out[name] = []
            continue
        cls = entry.env_class()
        out[name] = tool_schemas(cls.__new__(cls))  # schemas come from the class's @tool methods
    return out


def instruction(name: str, args: dict, rng: random.Random) -> str:
    shown = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
    style = rng.randrange(3)
    if not args:
        return rng.choice([f"Call {name}.", f"Use {name} now.", f"{name}, please."])
    if style == 0:
        return f"Call {name} with " + ", ".join(f'{k} "{v}"' for k, v in shown.items()) + "."
    if style == 1:
        return f"{name}: " + "; ".join(f"{k}={v}" for k, v in shown.items())
    return f"Use {name}. " + " ".join(f'The {k} is "{v}".' for k, v in shown.items())


def copy_exchange(chat, tool: dict, rng: random.Random, listed: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): a user asks for one call of ``tool`` with given values; the answer makes it.

    ``listed``: tools the prompt lists first, as an episode's prompt does (the value to copy then sits a few hundred
    tokens in, where a task puts it); None for the bare request."""
    props = tool.get("parameters", {}).get("properties", {})
    required = set(tool.get("parameters", {}).get("required", []))
    args = {}
    for arg, schema in props.items():
        if arg in required or rng.random() < 0.5:
            value = value_for(schema, rng)
            if value is not None:
                args[arg] = value
    prompt = chat.render_prompt(listed or [], [Message("user", instruction(tool["name"], args, rng))])
    answer = chat.render_assistant(Message("assistant", reasoning=f"I will use {tool['name']}.",
                                           tool_calls=[ToolCall(tool["name"], args)]))
    return prompt, answer


def copy_rows(chat, tools: dict[str, list[dict]], rng: random.Random, n: int,
              listed: float = 0.0) -> list[TrainingRow]:
    """``n`` training rows (the trainer's ``sft`` mode) of generated exchanges over ``tools`` (environment -> its
    tool schemas): each picks an environment, then one of its tools; a share ``listed`` of them lists that
    environment's tools before the request, as its episodes do."""
    rows = []
    envs = sorted(tools)
    for _ in range(n):
        schemas = tools[rng.choice(envs)]
        tool = rng.choice(schemas)
        prompt, answer = copy_exchange(chat, tool, rng, schemas if rng.random() < listed else None)
        rows.append(TrainingRow(token_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer)))
    return rows
