"""Tasks that teach the skill, not the values (issue #31): every generated family's reference solution only writes
what the policy has been shown, its values are fresh enough that a warm start cannot memorise them, and held-out
tasks ask for unseen values through the same steps. No Docker: terminal and repo reads are answered from the task's
files, slack and notion calls by their app's own methods on an in-memory database (the Docker tests replay the same
solutions in real sandboxes and score them 1).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import importlib.util
import json
import keyword
import random
import re
import sqlite3
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml
from seeded import straight

from sandforge.environments.notion.env import NotionEnv
from sandforge.environments.slack.env import SlackEnv
from sandforge.environments.words import split_of
from sandforge.registry import environment
from sandforge.types import Task, ToolCall

ROOT = Path(__file__).resolve().parents[1]
SYLLABLE_WORD = re.compile(r"\b(?:[bdfgklmnprstvz][aeiou]){2,}\b", re.I)
_PYTHON_NAMES = set(keyword.kwlist) | set(dir(builtins))


def generated_words(text: str) -> list[str]:
    """The syllable words in ``text`` (lower-cased), Python's own names (``None``) aside."""
    return [w.lower() for w in SYLLABLE_WORD.findall(text) if w not in _PYTHON_NAMES]
DRAWS = 64  # a family's draws in the quickstart's warm start: 256 episodes over 6 families, about 51 at most
# At most this many of 64 training draws may repeat an earlier draw's value. A value drawn uniformly from N repeats
# about 64 * 63 / (2 N) times: fresh two- or three-syllable words give well under 1, a booking date (about 1,100
# train dates) about 2; the pools this replaced (60-400 words, 7 functions, 8 packages, 20 dates) gave 16 to 57.
MAX_REPEATS = 4
# Of the distinct syllable words each of the 64 solutions writes, the share that an earlier solution wrote too: k words
# from N repeat about k / (2 N) of the time, 6% for the ~340 short names of 64 repo fixes (N ~ 2,600 two-syllable
# train words), under 2% for fresh two- or three-syllable words; the pools gave 19-34%.
MAX_WORD_REPEATS = 0.1


def _function(task: Task) -> str:
    return re.search(r"`(\w+)\(", task.instruction).group(1)


def _call(task: Task, name: str) -> dict:
    return next(c.arguments for c in task.solution if c.name == name)


# What each family's solution must write, slot by slot: the values a policy has to copy rather than recall.
ANSWERS: dict[tuple[str, str], Callable[[Task], dict[str, str]]] = {
    ("terminal", "write_file"): lambda t: {"file": _call(t, "write_file")["path"],
                                           "content": _call(t, "write_file")["content"]},
    ("terminal", "count_words"): lambda t: {"file": next(iter(t.setup["files"]))},
    **{("repo", family): (lambda t: {"package": t.checks[0]["package"], "module": _call(t, "str_replace")["path"],
                                     "function": _function(t), "buggy line": _call(t, "str_replace")["old"]})
       for family in ("wrong_operator", "off_by_one", "wrong_condition")},
    ("slack", "post_message"): lambda t: {"channel": _call(t, "post_message")["channel"],
                                          "text": _call(t, "post_message")["text"]},
    ("slack", "reply_in_thread"): lambda t: {"channel": _call(t, "read_channel")["channel"],
                                             "reply": _call(t, "reply_in_thread")["text"]},
    ("slack", "add_reaction"): lambda t: {"emoji": _call(t, "add_reaction")["emoji"],
                                          "message": _call(t, "search_messages")["query"]},
    ("notion", "create_page"): lambda t: {"parent": _call(t, "search")["query"], "title": _call(t, "create_page")["title"],
                                          "blocks": _call(t, "create_page")["blocks"]},
    ("notion", "update_property"): lambda t: {"database": _call(t, "search")["query"]},
    ("notion", "append_blocks"): lambda t: {"page": _call(t, "search")["query"],
                                            "bullet": _call(t, "append_blocks")["blocks"]},
    ("browser", "booking"): lambda t: {"guest": _call(t, "type")["text"], "date": _call(t, "select")["option"]},
    ("browser", "wiki"): lambda t: {"answer": [c for c in t.solution if c.name == "type"][0].arguments["text"]},
}
FAMILIES = sorted(ANSWERS)


def quickstart_families() -> list[tuple[str, str]]:
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    return [(env["name"], family) for env in config["environments"] for family in env["families"]]


@functools.cache
def _maker(env: str) -> Callable[..., Task]:
    return environment(env).make_task()


def make(env: str, family: str, seed: int, split: str = "train") -> Task:
    """The task, its reference solution without a stumble (tests/seeded.py ``straight``): what it writes is read."""
    return straight(_maker(env)(family, seed, split))


def sampler_seeds(n: int = DRAWS, stream: int = 0) -> list[int]:
    """Seeds as the task sampler draws them (job/task_sampler.py: ``rng.randrange(2**31)``)."""
    rng = random.Random(stream)
    return [rng.randrange(2**31) for _ in range(n)]


def repeats(values: list) -> int:
    """How many values repeat an earlier one."""
    return len(values) - len(set(values))


def test_every_quickstart_family_is_covered():
    assert set(quickstart_families()) <= set(ANSWERS)


# --- (b) 64 training draws rarely repeat a value ------------------------------------------------------------------


@pytest.mark.parametrize("env,family", FAMILIES)
def test_64_training_draws_rarely_repeat_a_value(env, family):
    for stream in range(3):
        answers = [ANSWERS[env, family](make(env, family, seed)) for seed in sampler_seeds(stream=stream)]
        for slot in answers[0]:
            values = [a[slot] for a in answers]
            assert repeats(values) <= MAX_REPEATS, (slot, sorted(v for v in values if values.count(v) > 1))
        # a word may recur within a task (a package in its module's path); across tasks it should not
        words = [w for a in answers for w in {w for v in a.values() for w in generated_words(v)}]
        assert repeats(words) <= MAX_WORD_REPEATS * len(words), (len(words), repeats(words))


def test_the_repeat_bound_fails_a_small_pool():
    pool = [f"/workspace/name{i}.txt" for i in range(100)]  # the file-name pool the terminal tasks had
    rng = random.Random(0)
    assert repeats([rng.choice(pool) for _ in range(DRAWS)]) > MAX_REPEATS


# --- (c) train and held-out values are disjoint -------------------------------------------------------------------


@pytest.mark.parametrize("env,family", FAMILIES)
def test_train_and_heldout_values_are_disjoint_and_of_their_split(env, family):
    values = {}
    for split in ("train", "heldout"):
        values[split] = set()
        for seed in range(100):
            for slot, value in ANSWERS[env, family](make(env, family, seed, split)).items():
                values[split].add((slot, value))
                if slot == "date" or value.isdigit():
                    assert split_of(value) == split, value
                # every syllable word a solution writes is a word of its task's split
                assert {split_of(w) for w in generated_words(value)} <= {split}, (slot, value)
    assert not values["train"] & values["heldout"]


# --- (d) held-out tasks take the same steps -----------------------------------------------------------------------


def shape(task: Task) -> tuple:
    """The solution's steps: each call's tool and argument names."""
    return tuple((c.name, tuple(sorted(c.arguments))) for c in task.solution)


def template(text: str) -> str:
    """An instruction with its generated values blanked: syllable words and numbers."""
    return re.sub(r"\d+", "9", SYLLABLE_WORD.sub("X", text))


@pytest.mark.parametrize("env,family", FAMILIES)
def test_heldout_solutions_take_the_steps_training_ones_do(env, family):
    train = [make(env, family, seed) for seed in sampler_seeds(200)]
    held = [make(env, family, seed, "heldout") for seed in range(50)]
    assert {shape(t) for t in held} <= {shape(t) for t in train}
    if env != "browser":  # browser instructions also name products, English words from split pools
        assert {template(t.instruction) for t in held} <= {template(t.instruction) for t in train}


# --- (a) the reference solution writes only what it has been shown -------------------------------------------------


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _app(env_class: type):
    """The app module ``env_class`` runs in its sandbox (SCHEMA, seed, METHODS), imported here."""
    server = _load("server", ROOT / "environments" / "apps" / "server.py")
    saved, sys.modules["server"] = sys.modules.get("server"), server  # the app imports text_arg from it
    try:
        return _load(f"{env_class.app}_app", env_class.app_module)
    finally:
        sys.modules.pop("server") if saved is None else sys.modules.__setitem__("server", saved)


def in_process_app(env_class: type, task: Task):
    """``env_class``'s tools over its app's methods on an in-memory database seeded from ``task``: what the policy
    would read, without a sandbox."""
    app = _app(env_class)
    con = sqlite3.connect(":memory:")
    con.executescript(app.SCHEMA)
    app.seed(con, json.loads(json.dumps(task.setup["app"])))
    env = env_class.__new__(env_class)
    env.call = lambda method, **args: json.loads(json.dumps(app.METHODS[method](con, args)))
    return env


def observe(task: Task, call: ToolCall, app) -> str:
    """What ``call`` shows the policy. Terminal and repo reads come from the task's files; writes show nothing new."""
    if app is not None:
        try:
            return getattr(app, call.name)(**call.arguments)
        except (LookupError, ValueError) as e:  # a ToolError too: the policy would read the message
            return f"Error: {e}"
    if call.name == "read_file":
        return task.setup.get("files", {}).get(call.arguments["path"], f"Error: no such file: {call.arguments['path']}")
    return ""


def _read_paths(call: ToolCall) -> set[str]:
    if call.name == "read_file":
        return {call.arguments["path"]}
    if call.name == "bash":
        return set(re.findall(r"\bcat\s+(\S+)", call.arguments["command"]))
    return set()


def _pieces(call: ToolCall) -> list[str]:
    """The values a call writes, as the policy would have to copy them: block lines without their marks, property
    values, the paths in a command, every other string argument whole."""
    out = []
    for key, value in call.arguments.items():
        if key == "blocks":
            out += [re.sub(r"^\s*(# |- |\[[ x]\] )", "", line) for line in value.split("\n") if line.strip()]
        elif key == "properties":
            out += [str(v) for item in json.loads(value).items() for v in item]
        elif key == "command":
            out += re.findall(r"(?:/|\b)[\w./-]+\.\w+\b", value)
        elif key == "new":  # str_replace's fix: checked against the file it edits
            continue
        else:
            out.append(str(value))
    return out



def unseen(task: Task) -> list[str]:
    """What the solution writes that neither the instruction nor an earlier call showed; empty when every value can
    be copied. A file is edited only after it was read, and the edit's old text is in what was read."""
    app = {"slack": SlackEnv, "notion": NotionEnv}.get(task.env)
    app = in_process_app(app, task) if app else None
    seen, read, problems = [task.instruction], {}, []
    for i, call in enumerate(task.solution):
        if call.name == "submit":
            continue
        shown = "\n".join(seen)
        problems += [f"{i}:{call.name}: {piece!r}" for piece in _pieces(call) if piece not in shown]
        path = call.arguments.get("path")
        if call.name == "str_replace" or (call.name == "write_file" and path in task.setup.get("files", {})):
            if path not in read:
                problems.append(f"{i}:{call.name}: edits {path} before reading it")
            elif call.name == "str_replace":
                old, new = call.arguments["old"], call.arguments["new"]
                if old not in read[path]:
                    problems.append(f"{i}:str_replace: old text is not in {path} as read")
                names = set(re.findall(r"[A-Za-z_]\w*", new)) - _PYTHON_NAMES
                if not names <= set(re.findall(r"[A-Za-z_]\w*", read[path])):
                    problems.append(f"{i}:str_replace: the fix names what {path} does not")
        observation = observe(task, call, app)
        for p in _read_paths(call):
            read[p] = observation
        seen.append(observation)
    return problems


@pytest.mark.parametrize("env,family", [f for f in FAMILIES if f[0] != "browser"])
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_the_reference_writes_only_what_it_was_shown(env, family, split):
    for seed in sampler_seeds(12):
        task = make(env, family, seed, split)
        assert unseen(task) == [], (task.id, task.instruction)


@pytest.mark.parametrize("family", ["shop", "booking", "wiki"])
def test_browser_references_type_only_what_the_task_or_its_site_shows(family):
    # the element ids come from the page; the browser's Docker test checks each against the page it clicked on
    for seed in sampler_seeds(12):
        task = make("browser", family, seed)
        site = json.dumps(task.setup["site"])
        for call in task.solution:
            if call.name in ("type", "select", "goto"):
                value = call.arguments.get("text") or call.arguments.get("option") or call.arguments["url"]
                assert value in task.instruction or value in site, (task.id, call)


def test_a_solution_that_edits_unread_code_or_recalls_a_value_is_caught():
    task = make("repo", "wrong_operator", 3)
    blind = dataclasses.replace(task, solution=task.solution[1:])  # the edit without the read
    assert any("before reading it" in p for p in unseen(blind))
    wrong = dataclasses.replace(task, solution=[task.solution[0], ToolCall("str_replace", {
        **task.solution[1].arguments, "old": "    return total"}), ToolCall("submit")])
    assert any("old text is not in" in p for p in unseen(wrong))
    post = make("slack", "post_message", 3)
    recalled = dataclasses.replace(post, solution=[ToolCall("post_message", {"channel": "#general", "text": "hi"}),
                                                   ToolCall("submit")])
    assert unseen(recalled) == ["0:post_message: '#general'", "0:post_message: 'hi'"]
    page = make("notion", "create_page", 3)
    guessed = dataclasses.replace(page, solution=[ToolCall("create_page", {**page.solution[1].arguments}),
                                                  ToolCall("submit")])  # the parent's id without searching
    assert unseen(guessed) == [f"0:create_page: {page.solution[1].arguments['parent_id']!r}"]
