"""A mock Slack workspace in the episode's sandbox: read channels, post, reply in threads, react, search, submit.

The app (``app.py``) runs inside the sandbox; these tools call its API and turn the answers into short text with the
ids the policy needs to refer back (``[m004]``). The policy has no shell: these tools are all it can do.
"""

from __future__ import annotations

from pathlib import Path

from sandforge.environments.apps.env import AppEnv
from sandforge.environments.tools import tool


def clock(ts: int) -> str:
    """Minutes since the workspace's epoch as a wall-clock time: the seed starts its days at 09:00."""
    return f"{9 + ts // 60 % 24:02d}:{ts % 60:02d}"


def format_message(m: dict, indent: str = "") -> str:
    line = f"{indent}[{m['id']}] {clock(m['ts'])} {m['user']}: {m['text']}"
    for name, users in m["reactions"]:
        line += f"\n{indent}    :{name}: {users}"
    return line


class SlackEnv(AppEnv):
    """Slack's everyday actions over the mock app's API."""

    app = "slack"
    app_module = Path(__file__).resolve().parent / "app.py"

    @tool
    def list_channels(self) -> str:
        """List the channels with their topics."""
        channels = self.call("conversations.list")
        return "\n".join(f"#{c['name']} ({c['id']}, {c['messages']} messages): {c['topic']}" for c in channels)

    @tool
    def read_channel(self, channel: str) -> str:
        """Read a channel's recent messages and their threads; channel like "#general"."""
        history = self.call("conversations.history", channel=channel)
        lines = [f"#{history['name']}: {history['topic']}"]
        for m in history["messages"]:
            lines.append(format_message(m))
            lines += [format_message(r, indent="    ") for r in m["replies"]]
        if not history["messages"]:
            lines.append("(no messages)")
        return "\n".join(lines)

    @tool
    def post_message(self, channel: str, text: str) -> str:
        """Post a message in a channel."""
        m = self.call("chat.postMessage", channel=channel, text=text)
        return f"posted [{m['id']}] in #{m['channel']}"

    @tool
    def reply_in_thread(self, message_id: str, text: str) -> str:
        """Reply in the thread of a message, given its id like "m004"."""
        m = self.call("chat.postMessage", thread_id=message_id, text=text)
        return f"replied [{m['id']}] in #{m['channel']}, thread of [{m['thread_id']}]"

    @tool
    def add_reaction(self, message_id: str, emoji: str) -> str:
        """React to a message with an emoji name, like "thumbsup"."""
        r = self.call("reactions.add", message_id=message_id, name=emoji)
        return f"reacted :{r['name']}: to [{r['message_id']}]"

    @tool
    def search_messages(self, query: str) -> str:
        """Find messages containing some text, newest first."""
        found = self.call("search.messages", query=query)
        if not found:
            return f"no messages contain {query!r}"
        return "\n".join(
            f"#{m['channel']} " + format_message(m) + (f" (in thread of [{m['thread_id']}])" if m["thread_id"] else "")
            for m in found
        )
