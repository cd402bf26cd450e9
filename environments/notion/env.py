"""A mock Notion workspace in the episode's sandbox: search, read pages, create pages, append blocks, set database
properties, query databases, submit.

Blocks are written as Markdown-like lines, one block a line, two spaces of indent per nesting level::

    # Heading
    plain text is a paragraph
    - a bullet
      - a bullet nested under it
    [ ] a to-do        ([x] when done)

Tools take only strings (and numbers), so properties and filters are short JSON or ``Name = value`` text.
"""

from __future__ import annotations

import json
from pathlib import Path

from sandforge.environments.apps.env import AppEnv
from sandforge.environments.tools import ToolError, tool

_MARKS = (("# ", "heading"), ("- ", "bullet"), ("[ ] ", "todo"), ("[x] ", "todo"))
_SHOW = {"heading": "# ", "bullet": "- ", "paragraph": ""}


def parse_blocks(tool_name: str, text: str) -> list[dict]:
    """Markdown-like lines -> the API's block tree; a ToolError says which line is wrong and what is expected."""
    roots: list[dict] = []
    stack: list[tuple[int, list]] = [(-1, roots)]  # (depth, children list) of the open parents
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent % 2:
            raise ToolError(f"{tool_name}: line {number} is indented by {indent} spaces; nest with 2 spaces a level")
        depth, body = indent // 2, line.strip()
        while stack[-1][0] >= depth:
            stack.pop()
        if depth > stack[-1][0] + 1:
            raise ToolError(f"{tool_name}: line {number} is nested two levels below the line before it")
        kind, checked = "paragraph", None
        for mark, mark_kind in _MARKS:
            if body.startswith(mark) or body == mark.strip():
                kind, body = mark_kind, body[len(mark):].strip()
                checked = mark == "[x] " if kind == "todo" else None
                break
        block = {"type": kind, "text": body, "children": []}
        if checked is not None:
            block["checked"] = checked
        stack[-1][1].append(block)
        stack.append((depth, block["children"]))
    if not roots:
        raise ToolError(f'{tool_name}: no blocks given; write one block a line, e.g. "# Title\\n- item\\n[ ] to do"')
    return roots


def show_blocks(blocks: list[dict], depth: int = 0) -> list[str]:
    lines = []
    for b in blocks:
        mark = ("[x] " if b["checked"] else "[ ] ") if b["type"] == "todo" else _SHOW[b["type"]]
        lines.append(f"{'  ' * depth}[{b['id']}] {mark}{b['text']}")
        lines += show_blocks(b["children"], depth + 1)
    return lines


def show_properties(properties: dict) -> str:
    return ", ".join(f"{name}: {json.dumps(value)}" for name, value in properties.items())


class NotionEnv(AppEnv):
    """Notion's everyday actions over the mock app's API."""

    app = "notion"
    app_module = Path(__file__).resolve().parent / "app.py"

    @tool
    def search(self, query: str) -> str:
        """Find pages and databases by title ("" lists them all)."""
        found = self.call("search", query=query)
        if not found:
            return f"nothing is titled with {query!r}"
        return "\n".join(f"{f['object']} {f['id']}: {f['title']}" + (f" (in {f['parent_id']})" * bool(f["parent_id"]))
                         for f in found)

    @tool
    def get_page(self, page_id: str) -> str:
        """Read a page: its title, properties and blocks (with block ids)."""
        page = self.call("pages.get", page_id=page_id)
        lines = [f"page {page['id']}: {page['title']}"]
        if page["parent_id"]:
            lines[0] += f" (in {page['parent_id']}: {page['parent_title']})"
        if page["properties"] is not None:
            lines.append("properties: " + show_properties(page["properties"]))
        lines += show_blocks(page["blocks"]) or ["(no blocks)"]
        return "\n".join(lines)

    @tool
    def create_page(self, parent_id: str, title: str, blocks: str = "") -> str:
        """Create a page under a page or database; blocks one a line: "# heading", "- bullet", "[ ] to-do", text."""
        tree = parse_blocks("create_page", blocks) if blocks.strip() else []
        page = self.call("pages.create", parent_id=parent_id, title=title, blocks=tree)
        return f"created page {page['id']}: {page['title']} (in {page['parent_id']}, {page['blocks']} blocks)"

    @tool
    def append_blocks(self, block_id: str, blocks: str) -> str:
        """Append blocks to the end of a page (a page id) or nested under a block (a block id)."""
        added = self.call("blocks.append", block_id=block_id, children=parse_blocks("append_blocks", blocks))
        where = f"under block {added['parent_block_id']}" if added["parent_block_id"] else "at the end"
        return f"added {added['added']} blocks to page {added['page_id']} {where}"

    @tool
    def update_page_properties(self, page_id: str, properties: str) -> str:
        """Set a database row's properties, given as JSON like {"Status": "Done", "Points": 3}."""
        shape = 'a JSON object like {"Status": "Done"}'
        try:
            values = json.loads(properties)
        except json.JSONDecodeError as e:
            raise ToolError(f"update_page_properties: 'properties' must be {shape} ({e.msg} at character {e.pos})") \
                from None
        if not isinstance(values, dict) or not values:
            raise ToolError(f"update_page_properties: 'properties' must be {shape}")
        page = self.call("pages.update", page_id=page_id, properties=values)
        return f"updated page {page['id']}: {page['title']}; {show_properties(page['properties'])}"

    @tool
    def query_database(self, database_id: str, filter: str = "") -> str:
        """List a database's rows and properties; filter like "Status = Done" keeps matching rows."""
        args: dict = {"database_id": database_id}
        if filter.strip():
            name, eq, value = filter.partition("=")
            if not eq or not name.strip():
                raise ToolError('query_database: filter must look like "Property = value", e.g. "Status = Done"')
            value = value.strip()
            try:  # numbers and true/false as JSON; anything else is the text itself
                parsed = json.loads(value)
                value = parsed if isinstance(parsed, (int, float, bool)) else value
            except json.JSONDecodeError:
                pass
            args["filter"] = {"property": name.strip(), "equals": value}
        db = self.call("databases.query", **args)
        lines = [f"database {db['id']}: {db['title']} ({', '.join(f'{n}: {t}' for n, t in db['schema'].items())})"]
        lines += [f"{r['id']}: {r['title']} | {show_properties(r['properties'])}" for r in db["rows"]]
        if not db["rows"]:
            lines.append("(no rows)")
        return "\n".join(lines)
