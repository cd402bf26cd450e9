"""Mock Slack: users, channels, messages, threads, reactions and search, in SQLite. Runs inside the sandbox (stdlib
only) under ``environments/apps/server.py``; the env's tools call the methods below, named after Slack's Web API.

The policy acts as the user ``seed["me"]``. Ids are the seed's (``C01``, ``U01``, ``m001``...); messages it posts get
the next ``m<number>`` and the next timestamp, so the same actions always leave the same database.
"""

from __future__ import annotations

import re
import sqlite3

from server import text_arg  # environments/apps/server.py, beside this module in the app's bundle

SCHEMA = """
CREATE TABLE users (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, real_name TEXT NOT NULL);
CREATE TABLE channels (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, topic TEXT NOT NULL DEFAULT '');
CREATE TABLE messages (
    id TEXT PRIMARY KEY,
    channel_id TEXT NOT NULL REFERENCES channels(id),
    user_id TEXT NOT NULL REFERENCES users(id),
    text TEXT NOT NULL,
    thread_id TEXT REFERENCES messages(id),  -- the thread's first message; NULL for a message in the channel itself
    ts INTEGER NOT NULL                      -- minutes since the workspace's epoch
);
CREATE TABLE reactions (
    message_id TEXT NOT NULL REFERENCES messages(id),
    user_id TEXT NOT NULL REFERENCES users(id),
    name TEXT NOT NULL,
    PRIMARY KEY (message_id, user_id, name)
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

MAX_TEXT = 4000
LIST_LIMIT = 50  # messages per answer: keeps every answer small enough to show
SHOW_CHARS = 500  # characters of a message's text in a listing
_EMOJI = re.compile(r"^[a-z0-9_+\-]{1,40}$")


def seed(con: sqlite3.Connection, data: dict) -> None:
    con.executemany("INSERT INTO users VALUES (?, ?, ?)", data["users"])
    con.executemany("INSERT INTO channels VALUES (?, ?, ?)", data["channels"])
    con.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?)", data["messages"])
    con.executemany("INSERT INTO reactions VALUES (?, ?, ?)", data.get("reactions", []))
    con.execute("INSERT INTO meta VALUES ('me', ?)", (data["me"],))


def _me(con: sqlite3.Connection) -> str:
    return con.execute("SELECT value FROM meta WHERE key = 'me'").fetchone()[0]



def _channel(con: sqlite3.Connection, ref: str) -> tuple[str, str]:
    """(id, name) of a channel given as "#name", "name" or its id."""
    name = ref.strip().lstrip("#")
    row = con.execute("SELECT id, name FROM channels WHERE name = ? OR id = ?", (name, name)).fetchone()
    if row is None:
        known = ", ".join("#" + n for (n,) in con.execute("SELECT name FROM channels ORDER BY name"))
        raise LookupError(f"no channel {ref!r}; channels: {known}")
    return row


def _message(con: sqlite3.Connection, message_id: str) -> sqlite3.Row:
    row = con.execute("SELECT id, channel_id, thread_id FROM messages WHERE id = ?", (message_id.strip(),)).fetchone()
    if row is None:
        raise LookupError(f"no message with id {message_id!r}; message ids look like m001 (see read_channel)")
    return row


def _show(con: sqlite3.Connection, row: tuple) -> dict:
    message_id, channel, user, text, thread_id, ts = row
    reactions = con.execute(
        "SELECT r.name, group_concat(u.name, ', ') FROM reactions r JOIN users u ON u.id = r.user_id "
        "WHERE r.message_id = ? GROUP BY r.name ORDER BY min(r.rowid)", (message_id,)
    ).fetchall()
    return {
        "id": message_id,
        "channel": channel,
        "user": user,
        "text": text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "...",
        "thread_id": thread_id,
        "ts": ts,
        "reactions": [list(r) for r in reactions],
    }


_SELECT = ("SELECT m.id, c.name, u.name, m.text, m.thread_id, m.ts FROM messages m "
           "JOIN channels c ON c.id = m.channel_id JOIN users u ON u.id = m.user_id")


def conversations_list(con: sqlite3.Connection, args: dict) -> list[dict]:
    rows = con.execute(
        "SELECT c.id, c.name, c.topic, count(m.id) FROM channels c LEFT JOIN messages m ON m.channel_id = c.id "
        "GROUP BY c.id ORDER BY c.name"
    ).fetchall()
    return [{"id": i, "name": n, "topic": t, "messages": k} for i, n, t, k in rows]


def conversations_history(con: sqlite3.Connection, args: dict) -> dict:
    """The channel's latest top-level messages, oldest first, each with its thread's replies."""
    channel_id, name = _channel(con, text_arg(args, "channel"))
    top = con.execute(
        f"SELECT * FROM ({_SELECT} WHERE m.channel_id = ? AND m.thread_id IS NULL ORDER BY m.ts DESC, m.id DESC "
        f"LIMIT ?) ORDER BY 6, 1", (channel_id, LIST_LIMIT)
    ).fetchall()
    messages = []
    for row in top:
        shown = _show(con, row)
        replies = con.execute(f"{_SELECT} WHERE m.thread_id = ? ORDER BY m.ts, m.id LIMIT ?", (row[0], LIST_LIMIT))
        shown["replies"] = [_show(con, r) for r in replies.fetchall()]
        messages.append(shown)
    topic = con.execute("SELECT topic FROM channels WHERE id = ?", (channel_id,)).fetchone()[0]
    return {"id": channel_id, "name": name, "topic": topic, "messages": messages}


def chat_post_message(con: sqlite3.Connection, args: dict) -> dict:
    """Post in a channel, or in a thread with ``thread_id`` (replying to a reply joins its thread, as in Slack)."""
    text = text_arg(args, "text")
    if len(text) > MAX_TEXT:
        raise ValueError(f"the message is {len(text)} characters; at most {MAX_TEXT}")
    thread_ref = text_arg(args, "thread_id", required=False)
    if thread_ref.strip():
        parent = _message(con, thread_ref)
        channel_id, thread_id = parent[1], parent[2] or parent[0]
    else:
        channel_id, thread_id = _channel(con, text_arg(args, "channel"))[0], None
    (count,) = con.execute("SELECT count(*) FROM messages").fetchone()
    (last,) = con.execute("SELECT max(ts) FROM messages").fetchone()
    message_id = f"m{count + 1:03d}"
    con.execute("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?)",
                (message_id, channel_id, _me(con), text, thread_id, (last or 0) + 1))
    return _show(con, con.execute(f"{_SELECT} WHERE m.id = ?", (message_id,)).fetchone())


def reactions_add(con: sqlite3.Connection, args: dict) -> dict:
    message_id = _message(con, text_arg(args, "message_id"))[0]
    name = text_arg(args, "name").strip().strip(":")
    if not _EMOJI.match(name):
        raise ValueError(f"{name!r} is not an emoji name; use a name like thumbsup or white_check_mark")
    try:
        con.execute("INSERT INTO reactions VALUES (?, ?, ?)", (message_id, _me(con), name))
    except sqlite3.IntegrityError:
        raise ValueError(f"you already reacted :{name}: to {message_id}") from None
    return {"message_id": message_id, "name": name}


def search_messages(con: sqlite3.Connection, args: dict) -> list[dict]:
    """Messages whose text contains the query (case-insensitive, literally: % and _ are not wildcards), newest first."""
    query = text_arg(args, "query").strip()
    pattern = "%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = con.execute(f"{_SELECT} WHERE m.text LIKE ? ESCAPE '\\' ORDER BY m.ts DESC, m.id DESC LIMIT ?",
                       (pattern, LIST_LIMIT)).fetchall()
    return [_show(con, r) for r in rows]


METHODS = {
    "conversations.list": conversations_list,
    "conversations.history": conversations_history,
    "chat.postMessage": chat_post_message,
    "reactions.add": reactions_add,
    "search.messages": search_messages,
}
