"""Slack task families: each seeds a small workspace (people, channels, chatter, threads) and asks for one action.

Same (family, seed, split) -> same workspace, same ids, same task. People, channels (the build bot's too), emoji,
services and words are fresh syllable words of the task's split (environments/words.py), and build numbers are split
by the same hash, so no value a solution writes can be learnt in place of copying it, and held-out tasks ask for
values no training task uses. Every check is one ``sql`` query over everything the policy did (its messages and
reactions), so doing nothing, doing it in the wrong place, or doing extra all score 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from sandforge.environments.seeding import task_start as start
from sandforge.environments.slack.env import SlackEnv
from sandforge.environments.words import distinct, split_of
from sandforge.types import Task, ToolCall

ME = "U00"
BOT = "U99"
# build numbers: 4 digits each, so none is a substring of another, and of one split, as words are
_BUILDS = {split: [b for b in range(1000, 10000) if split_of(str(b)) == split] for split in ("train", "heldout")}
_CHATTER = ("anyone seen the {} {}?", "the {} {} is back", "lunch: {} or {}?", "moving the {} to the {}",
            "who has the {} {}", "{} {} meeting at three")

# What the policy did, all of it: its messages (where, which thread, the text) and its reactions.
_ACTIONS = ("SELECT 'message', channel_id, thread_id, {text} FROM messages WHERE user_id = '" + ME + "' "
            "UNION ALL SELECT 'reaction', message_id, name, NULL FROM reactions WHERE user_id = '" + ME + "'")


@dataclass
class Workspace:
    """A workspace being seeded: messages get ids and timestamps in the order they are added."""

    rng: random.Random
    split: str
    users: list[list] = field(default_factory=list)
    channels: list[list] = field(default_factory=list)
    messages: list[list] = field(default_factory=list)
    ts: int = 0
    taken: set[str] = field(default_factory=set)  # the names and words used so far: each value is new

    def fresh(self, n: int) -> list[str]:
        """``n`` new words of the workspace's split, unlike any name it has."""
        return distinct(self.rng, self.split, n, self.taken)

    def post(self, channel: str, user: str, text: str, thread: str | None = None) -> str:
        self.ts += self.rng.randint(1, 9)
        message_id = f"m{len(self.messages) + 1:03d}"
        self.messages.append([message_id, channel, user, text, thread, self.ts])
        return message_id

    def chatter(self, channel: str, people: list[str], n: int) -> None:
        for _ in range(n):
            words = self.fresh(2)
            self.post(channel, self.rng.choice(people), self.rng.choice(_CHATTER).format(*words))

    def seed(self) -> dict:
        return {"me": ME, "users": self.users, "channels": self.channels, "messages": self.messages}


def _workspace(rng: random.Random, split: str, n_people: int = 5) -> tuple[Workspace, list[str], list[str]]:
    """A workspace with ``n_people`` people (ids U01..), the policy (U00), a CI bot, and four channels (C01..C04), the
    first the bot's."""
    ws = Workspace(rng, split)
    names = ws.fresh(n_people)
    ws.users = [[ME, "me", "You"], [BOT, "ci-bot", "CI"]]
    ws.users += [[f"U{i + 1:02d}", n, n.capitalize()] for i, n in enumerate(names)]
    ci, *rest = ws.fresh(4)
    topics = ("build results", "company-wide news", "the team's channel", "anything else")
    ws.channels = [[f"C{i + 1:02d}", name, topic] for i, (name, topic) in enumerate(zip((ci, *rest), topics))]
    return ws, [u[0] for u in ws.users[2:]], [c[0] for c in ws.channels]


def _task(family: str, seed: int, split: str, task_id: str, instruction: str, ws: Workspace, expect: list,
          text_test: str, solution: list[ToolCall]) -> Task:
    query = _ACTIONS.format(text=text_test)
    return Task(
        id=task_id, env="slack", family=family, seed=seed, split=split, instruction=instruction,
        setup={"app": ws.seed()},
        checks=[{"verifier": "sql", "db": SlackEnv.db_path(), "query": query, "expect": expect}],
        solution=[*solution, ToolCall("submit")],
    )


def reply_in_thread_task(seed: int, split: str = "train") -> Task:
    """Answer a question in its thread with a value found in another channel (the latest passing build)."""
    rng, task_id = start("slack", "reply_in_thread", seed, split)
    ws, people, (ci, general, team, _) = _workspace(rng, split)
    service, other = ws.fresh(2)
    asker, other_asker = rng.sample(people, 2)
    builds = rng.sample(_BUILDS[split], 4)
    target, failed, other_build, older = builds
    ws.chatter(general, people, 2)
    ws.post(ci, BOT, f"Build {older} passed on main ({service})")
    ws.post(ci, BOT, f"Build {other_build} passed on main ({other})")
    ws.post(ci, BOT, f"Build {target} passed on main ({service})")
    ws.chatter(team, people, 2)
    ws.post(ci, BOT, f"Build {failed} failed on main ({service})")
    channel = rng.choice([general, team])
    question = ws.post(channel, asker, f"When does the {service} deploy go out, and with which build?")
    ws.post(channel, other_asker, f"Is the {other} deploy still on for today?")
    ws.post(channel, rng.choice(people), "no idea, check the ci channel", thread=question)
    ws.chatter(general, people, 2)
    name = ws.users[people.index(asker) + 2][2]
    ci_name = ws.channels[0][1]
    instruction = (f"Reply in the thread where {name} asked about the {service} deploy, with the number of the latest "
                   f"passing {service} build from #{ci_name}.")
    # the reply must hold the right build number and none of the others
    text_test = f"instr(text, '{target}') > 0" + "".join(f" AND instr(text, '{b}') = 0" for b in builds[1:])
    return _task("reply_in_thread", seed, split, task_id, instruction, ws, [["message", channel, question, 1]],
                 text_test, [ToolCall("search_messages", {"query": "deploy"}),
                             ToolCall("read_channel", {"channel": f"#{ci_name}"}),
                             ToolCall("reply_in_thread", {"message_id": question, "text": f"Build {target}"})])


def post_message_task(seed: int, split: str = "train") -> Task:
    """Post given text in a given channel (and nowhere else)."""
    rng, task_id = start("slack", "post_message", seed, split)
    ws, people, channels = _workspace(rng, split)
    for channel in channels[1:]:
        ws.chatter(channel, people, 2)
    channel = rng.choice(channels[1:])
    name = dict((c[0], c[1]) for c in ws.channels)[channel]
    text = " ".join(ws.fresh(rng.randint(2, 4)))
    instruction = f'Post "{text}" in #{name}.'
    return _task("post_message", seed, split, task_id, instruction, ws, [["message", channel, None, text]],
                 "trim(text)", [ToolCall("post_message", {"channel": f"#{name}", "text": text})])


def add_reaction_task(seed: int, split: str = "train") -> Task:
    """React to one person's message, told apart from the same words said by someone else."""
    rng, task_id = start("slack", "add_reaction", seed, split)
    ws, people, channels = _workspace(rng, split)
    person, echo = rng.sample(people, 2)
    words = ws.fresh(2)
    said = f"the {words[0]} {words[1]} is ready"
    (emoji,) = ws.fresh(1)  # a custom emoji, as a workspace has
    ws.chatter(channels[1], people, 2)
    first, second = rng.sample(channels[1:], 2)
    if rng.random() < 0.5:
        ws.post(first, echo, said)
        target = ws.post(second, person, said)
    else:
        target = ws.post(first, person, said)
        ws.post(second, echo, said)
    ws.chatter(channels[2], people, 2)
    name = ws.users[people.index(person) + 2][2]
    instruction = f'React with :{emoji}: to the message where {name} said "{said}".'
    return _task("add_reaction", seed, split, task_id, instruction, ws, [["reaction", target, emoji, None]],
                 "text", [ToolCall("search_messages", {"query": said}),
                          ToolCall("add_reaction", {"message_id": target, "emoji": emoji})])


FAMILIES: dict[str, Callable[[int, str], Task]] = {
    "reply_in_thread": reply_in_thread_task,
    "post_message": post_message_task,
    "add_reaction": add_reaction_task,
}
