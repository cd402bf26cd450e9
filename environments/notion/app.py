"""Mock Notion: pages, nested blocks, and databases whose rows are pages with typed properties, in SQLite. Runs inside
the sandbox (stdlib only) under ``environments/apps/server.py``; the env's tools call the methods below.

Ids are the seed's (``p01``, ``d01``, ``b001``); what the policy creates gets the next number. ``created_by`` (pages,
blocks) and ``updated_by`` (property values) say 'seed' or 'agent', so a check sees everything the policy did.
"""

from __future__ import annotations

import json
import re
import sqlite3

from server import text_arg  # environments/apps/server.py, beside this module in the app's bundle

SCHEMA = """
CREATE TABLE databases (id TEXT PRIMARY KEY, parent_id TEXT NOT NULL, title TEXT NOT NULL);
CREATE TABLE properties (
    database_id TEXT NOT NULL REFERENCES databases(id),
    name TEXT NOT NULL,
    type TEXT NOT NULL CHECK (type IN ('text', 'number', 'select', 'checkbox', 'date')),
    options TEXT NOT NULL DEFAULT '[]',  -- JSON list: the choices of a select
    position INTEGER NOT NULL,
    PRIMARY KEY (database_id, name)
);
CREATE TABLE pages (
    id TEXT PRIMARY KEY,
    parent_id TEXT NOT NULL,             -- a page's or a database's id ('' for a top-level page)
    database_id TEXT,                    -- set for a database row
    title TEXT NOT NULL,
    created_by TEXT NOT NULL DEFAULT 'agent'
);
CREATE TABLE property_values (
    page_id TEXT NOT NULL REFERENCES pages(id),
    name TEXT NOT NULL,
    value,                               -- text, number, 0/1 (checkbox), "YYYY-MM-DD" (date) or NULL
    updated_by TEXT NOT NULL DEFAULT 'agent',
    PRIMARY KEY (page_id, name)
);
CREATE TABLE blocks (
    id TEXT PRIMARY KEY,
    page_id TEXT NOT NULL REFERENCES pages(id),
    parent_block_id TEXT REFERENCES blocks(id),  -- NULL: directly on the page
    type TEXT NOT NULL CHECK (type IN ('heading', 'paragraph', 'bullet', 'todo')),
    text TEXT NOT NULL,
    checked INTEGER,                     -- todo blocks only: 0 or 1
    position INTEGER NOT NULL,           -- order among its siblings
    created_by TEXT NOT NULL DEFAULT 'agent'
);
"""

BLOCK_TYPES = ("heading", "paragraph", "bullet", "todo")
MAX_TEXT = 2000
MAX_BLOCKS = 100  # per call
LIST_LIMIT = 50
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def seed(con: sqlite3.Connection, data: dict) -> None:
    con.executemany("INSERT INTO databases VALUES (?, ?, ?)", data.get("databases", []))
    con.executemany("INSERT INTO properties VALUES (?, ?, ?, ?, ?)",
                    [[d, n, t, json.dumps(o), i] for d, n, t, o, i in data.get("properties", [])])
    con.executemany("INSERT INTO pages VALUES (?, ?, ?, ?, 'seed')", data.get("pages", []))
    con.executemany("INSERT INTO property_values VALUES (?, ?, ?, 'seed')", data.get("values", []))
    con.executemany("INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, 'seed')", data.get("blocks", []))



def _page(con: sqlite3.Connection, page_id: str) -> tuple:
    row = con.execute("SELECT id, parent_id, database_id, title FROM pages WHERE id = ?", (page_id,)).fetchone()
    if row is None:
        raise LookupError(f"no page with id {page_id!r}; page ids look like p01 (find them with search)")
    return row


def _database(con: sqlite3.Connection, database_id: str) -> tuple:
    row = con.execute("SELECT id, title FROM databases WHERE id = ?", (database_id,)).fetchone()
    if row is None:
        raise LookupError(f"no database with id {database_id!r}; database ids look like d01 (find them with search)")
    return row


def _schema(con: sqlite3.Connection, database_id: str) -> dict[str, tuple[str, list]]:
    rows = con.execute("SELECT name, type, options FROM properties WHERE database_id = ? ORDER BY position",
                       (database_id,))
    return {name: (kind, json.loads(options)) for name, kind, options in rows}


def _properties(con: sqlite3.Connection, page_id: str, database_id: str) -> dict:
    values = dict(con.execute("SELECT name, value FROM property_values WHERE page_id = ?", (page_id,)).fetchall())
    return {name: values.get(name) for name in _schema(con, database_id)}


def _next_id(con: sqlite3.Connection, table: str, prefix: str, width: int) -> str:
    (count,) = con.execute(f"SELECT count(*) FROM {table}").fetchone()  # table is one of ours, never an argument
    return f"{prefix}{count + 1:0{width}d}"


def _check_value(name: str, kind: str, options: list, value):
    """The value stored for property ``name`` of type ``kind``; ValueError says what that type takes."""
    if value is None:
        return None
    if kind == "select":
        if value not in options:
            raise ValueError(f"'{name}' is a select: use one of {', '.join(map(repr, options))}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"'{name}' is a number: give a JSON number like 3, not {json.dumps(value)}")
    elif kind == "checkbox":
        if not isinstance(value, bool):
            raise ValueError(f"'{name}' is a checkbox: give true or false")
        return int(value)
    elif kind == "date":
        if not isinstance(value, str) or not _DATE.match(value):
            raise ValueError(f"'{name}' is a date: give it as \"YYYY-MM-DD\"")
    elif not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"'{name}' is text: give a string of at most {MAX_TEXT} characters")
    return value


def _set_properties(con: sqlite3.Connection, page_id: str, database_id: str, properties) -> None:
    if not isinstance(properties, dict):
        raise ValueError('properties must be an object like {"Status": "Done"}')
    schema = _schema(con, database_id)
    for name, value in properties.items():
        if name not in schema:
            raise ValueError(f"the database has no property {name!r}; its properties: {', '.join(schema)}")
        stored = _check_value(name, *schema[name], value)
        con.execute("INSERT OR REPLACE INTO property_values VALUES (?, ?, ?, 'agent')", (page_id, name, stored))


def _add_blocks(con: sqlite3.Connection, page_id: str, parent_block_id: str | None, blocks, depth: int = 0) -> int:
    """Append ``blocks`` (a list of {type, text, checked?, children?}) under the parent; returns how many were added."""
    if not isinstance(blocks, list):
        raise ValueError('blocks must be a list like [{"type": "paragraph", "text": "..."}]')
    if depth > 8:
        raise ValueError("blocks nest at most 8 levels deep")
    (position,) = con.execute("SELECT coalesce(max(position) + 1, 0) FROM blocks WHERE page_id = ? AND "
                              "parent_block_id IS ?", (page_id, parent_block_id)).fetchone()
    added = 0
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            raise ValueError(f"each block needs a type, one of {', '.join(BLOCK_TYPES)}")
        text = block.get("text", "")
        if not isinstance(text, str) or len(text) > MAX_TEXT:
            raise ValueError(f"a block's text must be a string of at most {MAX_TEXT} characters")
        checked = int(bool(block.get("checked"))) if block["type"] == "todo" else None
        block_id = _next_id(con, "blocks", "b", 3)
        con.execute("INSERT INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, 'agent')",
                    (block_id, page_id, parent_block_id, block["type"], text, checked, position))
        position += 1
        added += 1 + _add_blocks(con, page_id, block_id, block.get("children", []), depth + 1)
        if added > MAX_BLOCKS:
            raise ValueError(f"at most {MAX_BLOCKS} blocks per call")
    return added


def _block_tree(con: sqlite3.Connection, page_id: str, parent_block_id: str | None = None) -> list[dict]:
    rows = con.execute("SELECT id, type, text, checked FROM blocks WHERE page_id = ? AND parent_block_id IS ? "
                       "ORDER BY position, id", (page_id, parent_block_id)).fetchall()
    return [{"id": i, "type": t, "text": x, "checked": c, "children": _block_tree(con, page_id, i)}
            for i, t, x, c in rows]


def search(con: sqlite3.Connection, args: dict) -> list[dict]:
    """Pages and databases whose title contains the query (case-insensitive, literally); all of them for ''."""
    query = text_arg(args, "query", required=False, strip=True)
    pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = con.execute(
        "SELECT 'database', id, title, parent_id FROM databases WHERE title LIKE ?1 ESCAPE '\\' "
        "UNION ALL SELECT 'page', id, title, parent_id FROM pages WHERE title LIKE ?1 ESCAPE '\\' "
        "ORDER BY 1, 2 LIMIT ?2", (pattern, LIST_LIMIT)).fetchall()
    return [{"object": o, "id": i, "title": t, "parent_id": p} for o, i, t, p in rows]


def pages_get(con: sqlite3.Connection, args: dict) -> dict:
    page_id, parent_id, database_id, title = _page(con, text_arg(args, "page_id", strip=True))
    parent = con.execute("SELECT title FROM pages WHERE id = ?1 UNION ALL SELECT title FROM databases WHERE id = ?1",
                         (parent_id,)).fetchone()
    return {
        "id": page_id, "title": title, "parent_id": parent_id, "parent_title": parent[0] if parent else "",
        "properties": _properties(con, page_id, database_id) if database_id else None,
        "blocks": _block_tree(con, page_id),
    }


def pages_create(con: sqlite3.Connection, args: dict) -> dict:
    """A page under a page, or a row in a database (parent_id is the database's id), with optional blocks."""
    parent_id, title = text_arg(args, "parent_id", strip=True), text_arg(args, "title", strip=True)
    if len(title) > MAX_TEXT:
        raise ValueError(f"the title is {len(title)} characters; at most {MAX_TEXT}")
    in_database = con.execute("SELECT 1 FROM databases WHERE id = ?", (parent_id,)).fetchone() is not None
    if not in_database:
        _page(con, parent_id)
    page_id = _next_id(con, "pages", "p", 2)
    con.execute("INSERT INTO pages VALUES (?, ?, ?, ?, 'agent')",
                (page_id, parent_id, parent_id if in_database else None, title))
    if args.get("properties"):
        if not in_database:
            raise ValueError("only database rows have properties: give a database id as parent_id, or no properties")
        _set_properties(con, page_id, parent_id, args["properties"])
    added = _add_blocks(con, page_id, None, args.get("blocks", []))
    return {"id": page_id, "title": title, "parent_id": parent_id, "blocks": added}


def blocks_append(con: sqlite3.Connection, args: dict) -> dict:
    """Append blocks at the end of a page (block_id is a page id) or as children of a block."""
    target = text_arg(args, "block_id", strip=True)
    block = con.execute("SELECT id, page_id FROM blocks WHERE id = ?", (target,)).fetchone()
    if block is None:
        page_id, parent_block_id = _page(con, target)[0], None
    else:
        parent_block_id, page_id = block
    added = _add_blocks(con, page_id, parent_block_id, args.get("children"))
    if added == 0:
        raise ValueError("no blocks given: pass at least one")
    return {"page_id": page_id, "parent_block_id": parent_block_id, "added": added}


def pages_update(con: sqlite3.Connection, args: dict) -> dict:
    page_id, _, database_id, title = _page(con, text_arg(args, "page_id", strip=True))
    if database_id is None:
        raise ValueError(f"page {page_id} ({title!r}) is not a database row, so it has no properties")
    _set_properties(con, page_id, database_id, args.get("properties"))
    return {"id": page_id, "title": title, "properties": _properties(con, page_id, database_id)}


def databases_query(con: sqlite3.Connection, args: dict) -> dict:
    """The database's rows with their properties; ``filter`` {"property": name, "equals": value} keeps matching rows."""
    database_id, title = _database(con, text_arg(args, "database_id", strip=True))
    schema = _schema(con, database_id)
    rows = con.execute("SELECT id, title FROM pages WHERE database_id = ? ORDER BY id", (database_id,)).fetchall()
    found = [{"id": i, "title": t, "properties": _properties(con, i, database_id)} for i, t in rows]
    wanted = args.get("filter")
    if wanted:
        name = wanted.get("property") if isinstance(wanted, dict) else None
        if name not in schema:
            raise ValueError(f"filter by one of the properties: {', '.join(schema)}")
        value = _check_value(name, *schema[name], wanted.get("equals"))
        found = [row for row in found if row["properties"][name] == value]
    return {"id": database_id, "title": title, "schema": {n: t for n, (t, _) in schema.items()},
            "rows": found[:LIST_LIMIT]}


METHODS = {
    "search": search,
    "pages.get": pages_get,
    "pages.create": pages_create,
    "blocks.append": blocks_append,
    "pages.update": pages_update,
    "databases.query": databases_query,
}
