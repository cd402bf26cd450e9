"""Notion task families: each seeds a small workspace (pages with blocks, two databases with typed properties) and
asks for one change.

Same (family, seed, split) -> same workspace, same ids, same task. Page titles, database names and words are fresh
syllable words of the task's split (environments/words.py), so no title or text a solution writes can be learnt in
place of copying it, and held-out tasks ask for words no training task uses. Every check is one ``sql`` query listing
everything the policy did (pages and blocks it created, property values it set), so doing nothing, the wrong place,
or extras all score 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from sandforge.environments.seeding import task_start as start
from sandforge.environments.notion.env import NotionEnv
from sandforge.environments.words import distinct
from sandforge.types import Task, ToolCall

STATUS = ["Todo", "In progress", "Done"]
PRIORITY = ["Low", "Medium", "High"]

# Everything the policy did: (kind, page, parent, type or property, text or value, checked, position).
ACTIONS = (
    "SELECT 'page', id, parent_id, NULL, title, NULL, NULL FROM pages WHERE created_by = 'agent' "
    "UNION ALL SELECT 'block', page_id, parent_block_id, type, text, checked, position FROM blocks "
    "WHERE created_by = 'agent' "
    "UNION ALL SELECT 'value', page_id, NULL, name, value, NULL, NULL FROM property_values WHERE updated_by = 'agent'"
)


@dataclass
class Workspace:
    """A workspace being seeded; ids are handed out in order (p01, d01, b001)."""

    rng: random.Random
    split: str
    pages: list[list] = field(default_factory=list)
    blocks: list[list] = field(default_factory=list)
    databases: list[list] = field(default_factory=list)
    properties: list[list] = field(default_factory=list)
    values: list[list] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)  # the words used so far: each title and phrase is new

    def page(self, parent: str, title: str, database: str | None = None) -> str:
        page_id = f"p{len(self.pages) + 1:02d}"
        self.pages.append([page_id, parent, database, title])
        return page_id

    def block(self, page: str, kind: str, text: str, parent: str | None = None, checked: bool | None = None) -> str:
        block_id = f"b{len(self.blocks) + 1:03d}"
        position = sum(1 for b in self.blocks if b[1] == page and b[2] == parent)
        self.blocks.append([block_id, page, parent, kind, text, None if checked is None else int(checked), position])
        return block_id

    def phrase(self, n: int = 2) -> str:
        return " ".join(self.fresh(n))

    def fresh(self, n: int) -> list[str]:
        """``n`` new words of the workspace's split."""
        return distinct(self.rng, self.split, n, self.taken)

    def titles(self, n: int) -> list[str]:
        return [w.capitalize() for w in self.fresh(n)]

    def seed(self) -> dict:
        return {"pages": self.pages, "blocks": self.blocks, "databases": self.databases,
                "properties": self.properties, "values": self.values}


def _workspace(rng: random.Random, split: str) -> tuple[Workspace, dict[str, str], dict[str, str]]:
    """Four top-level pages with a few blocks each, and two task databases (title -> id for both) under the first."""
    ws = Workspace(rng, split)
    pages = {}
    for title in ws.titles(4):
        page = pages[title] = ws.page("", title)
        ws.block(page, "heading", f"{title} overview")
        ws.block(page, "paragraph", f"notes on the {ws.phrase()}")
        for _ in range(2):
            ws.block(page, "bullet", ws.phrase())
        ws.block(page, "todo", f"{ws.phrase(1)} the {ws.phrase(1)}", checked=rng.random() < 0.5)
    home = next(iter(pages.values()))
    databases = {}
    for i, title in enumerate(ws.titles(2)):
        database = databases[title] = f"d{i + 1:02d}"
        ws.databases.append([database, home, title])
        ws.properties += [[database, "Status", "select", STATUS, 0], [database, "Priority", "select", PRIORITY, 1],
                          [database, "Points", "number", [], 2]]
        for verb in ws.fresh(3):
            row = ws.page(database, f"{verb} the {ws.phrase(1)}", database=database)
            ws.values += [[row, "Status", rng.choice(STATUS)], [row, "Priority", rng.choice(PRIORITY)],
                          [row, "Points", rng.randint(1, 8)]]
    return ws, pages, databases


def _task(family: str, seed: int, split: str, task_id: str, instruction: str, ws: Workspace, expect: list,
          solution: list[ToolCall]) -> Task:
    return Task(
        id=task_id, env="notion", family=family, seed=seed, split=split, instruction=instruction,
        setup={"app": ws.seed()},
        checks=[{"verifier": "sql", "db": NotionEnv.db_path(), "query": ACTIONS, "expect": expect}],
        solution=[*solution, ToolCall("submit")],
    )


def create_page_task(seed: int, split: str = "train") -> Task:
    """Create a page under a named page, with a heading and a to-do."""
    rng, task_id = start("notion", "create_page", seed, split)
    ws, pages, _ = _workspace(rng, split)
    parent_title = rng.choice(list(pages))
    parent = pages[parent_title]
    title, heading, todo = f"{ws.phrase()} notes", ws.phrase(), f"{ws.phrase(1)} the {ws.phrase(1)}"
    new = f"p{len(ws.pages) + 1:02d}"  # the id the app gives the next page
    instruction = (f'Create a page titled "{title}" under "{parent_title}" with a heading "{heading}" '
                   f'and a to-do "{todo}".')
    expect = [["page", new, parent, None, title, None, None],
              ["block", new, None, "heading", heading, None, 0], ["block", new, None, "todo", todo, 0, 1]]
    return _task("create_page", seed, split, task_id, instruction, ws, expect, [
        ToolCall("search", {"query": parent_title}),
        ToolCall("create_page", {"parent_id": parent, "title": title, "blocks": f"# {heading}\n[ ] {todo}"}),
    ])


def update_property_task(seed: int, split: str = "train") -> Task:
    """Set one property of one row of a named database (the other database has rows that look alike)."""
    rng, task_id = start("notion", "update_property", seed, split)
    ws, _, databases = _workspace(rng, split)
    db_title = rng.choice(list(databases))
    database = databases[db_title]
    row_id, _, _, row_title = rng.choice([p for p in ws.pages if p[2] == database])
    current = next(v[2] for v in ws.values if v[0] == row_id and v[1] == "Status")
    status = rng.choice([s for s in STATUS if s != current])
    instruction = f'In the {db_title} database, set the Status of "{row_title}" to {status}.'
    return _task("update_property", seed, split, task_id, instruction, ws,
                 [["value", row_id, None, "Status", status, None, None]], [
                     ToolCall("search", {"query": db_title}),
                     ToolCall("query_database", {"database_id": database}),
                     ToolCall("update_page_properties", {"page_id": row_id, "properties": f'{{"Status": "{status}"}}'}),
                 ])


def append_blocks_task(seed: int, split: str = "train") -> Task:
    """Nest a new bullet under an existing bullet of a named page (another page has a bullet with the same text)."""
    rng, task_id = start("notion", "append_blocks", seed, split)
    ws, pages, _ = _workspace(rng, split)
    page_title, other_title = rng.sample(list(pages), 2)
    page, other = pages[page_title], pages[other_title]
    item = ws.phrase()
    ws.block(other, "bullet", item)
    target = ws.block(page, "bullet", item)
    ws.block(page, "paragraph", f"see also the {ws.phrase(1)}")
    new_item = ws.phrase()
    instruction = f'On the page "{page_title}", add a bullet "{new_item}" nested under the bullet "{item}".'
    return _task("append_blocks", seed, split, task_id, instruction, ws,
                 [["block", page, target, "bullet", new_item, None, 0]], [
                     ToolCall("search", {"query": page_title}),
                     ToolCall("get_page", {"page_id": page}),
                     ToolCall("append_blocks", {"block_id": target, "blocks": f"- {new_item}"}),
                 ])


FAMILIES: dict[str, Callable[[int, str], Task]] = {
    "create_page": create_page_task,
    "update_property": update_property_task,
    "append_blocks": append_blocks_task,
}
