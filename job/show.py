"""``sandforge show RUN_DIR [--episode ID]``: one recorded episode, readable in a terminal.

Renders what the policy was told, each turn's reasoning, reply and tool calls, what the tools answered, and how the
verifiers scored it. Works on any row of trajectories.jsonl, including failed episodes and rows missing fields (a run
from an older version, a torn write): a missing part is left out, never an exception.
"""

from __future__ import annotations

import json

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from sandforge.policy_text import visible_tree

HEAD_LINES, TAIL_LINES, MAX_CHARS = 15, 5, 3000


def clip_observation(text: str) -> str:
    """A tool's output shortened for reading: first and last lines kept (errors and exit codes sit at the end)."""
    lines = str(text).splitlines()
    if len(lines) > HEAD_LINES + TAIL_LINES + 1:
        cut = len(lines) - HEAD_LINES - TAIL_LINES
        lines = lines[:HEAD_LINES] + [f"… {cut} lines cut …"] + lines[-TAIL_LINES:]
    out = "\n".join(lines)
    if len(out) > MAX_CHARS:
        out = f"{out[: MAX_CHARS * 2 // 3]}\n… {len(out) - MAX_CHARS} characters cut …\n{out[-MAX_CHARS // 3 :]}"
    return out


def fmt_reward(reward: dict) -> str:
    value = reward.get("value")
    return f"{value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "—"


def outcome(ep: dict) -> Text:
    if ep.get("failed"):
        return Text("failed", style="bold red")
    reward = ep.get("reward") or {}
    return Text("success", style="green") if reward.get("success") else Text("no success", style="yellow")


def episode_table(episodes: list[dict], last: int = 40) -> Table:
    """One line for each of the ``last`` episodes recorded, so a user can pick one with --episode (a long run records
    thousands; the latest are the ones people look at)."""
    first = max(0, len(episodes) - last)
    title = f"{len(episodes)} episodes (trajectories.jsonl)" + (f", the last {last} shown" if first else "")
    episodes = [visible_tree(ep) for ep in episodes[first:]]  # the policy's bytes are shown, never obeyed
    table = Table(title=title, title_justify="left")
    for col in ("#", "step", "phase", "task", "reward", "turns", "finish"):
        table.add_column(col, justify="right" if col in ("#", "step", "reward", "turns") else "left")
    for i, ep in enumerate(episodes, start=first):
        finish = Text(str(ep.get("finish_reason") or "?"))
        if ep.get("failed"):
            finish.append(" (failed)", style="red")
        task = ep.get("task") or {}
        table.add_row(str(i), Text(str(ep.get("step", ""))), Text(str(ep.get("phase", ""))),
                      Text(str(task.get("id", "?"))), fmt_reward(ep.get("reward") or {}),
                      str(len(ep.get("turns") or [])), finish)
    return table


def tool_call(call: dict) -> RenderableType:
    args = json.dumps(call.get("arguments") or {}, indent=2, ensure_ascii=False)
    return Group(Text.assemble(("→ call ", "bold"), (str(call.get("name", "?")), "bold cyan")),
                 Syntax(args, "json", theme="ansi_dark", word_wrap=True, background_color="default"))


def assistant(message: dict, turn: dict) -> RenderableType:
    parts: list[RenderableType] = []
    if message.get("reasoning"):
        parts += [Text("reasoning", style="bold magenta"), Text(message["reasoning"], style="italic")]
    if message.get("content"):
        parts += [Text("reply", style="bold"), Text(message["content"])]
    parts += [tool_call(c) for c in message.get("tool_calls") or []]
    for err in turn.get("parse_errors") or []:
        parts.append(Text(f"parse error: {err}", style="red"))
    if not parts:
        parts.append(Text("(empty reply)", style="dim"))
    title = f"assistant · turn {turn.get('index', '?')}"
    if turn:
        title += f" · {turn.get('generated_tokens', '?')} tokens · {turn.get('finish_reason', '?')}"
    return Panel(Group(*parts), title=Text(title), title_align="left", border_style="blue")


def observation(message: dict) -> RenderableType:
    name = message.get("name") or "?"
    style = "red" if name == "error" else "white"
    text = clip_observation(message.get("content", "")) or "(no output)"
    return Panel(Text(text), title=Text(f"tool · {name}"), title_align="left", border_style=style)


def reward_panel(ep: dict) -> RenderableType:
    reward = ep.get("reward") or {}
    if not reward:
        return Panel(Text("not graded", style="dim"), title="reward", title_align="left")
    parts: list[RenderableType] = [Text.assemble(("value ", "bold"), fmt_reward(reward), "   ", outcome(ep))]
    if reward.get("breakdown"):
        table = Table("check", "score", box=None, padding=(0, 2))
        for check, score in reward["breakdown"].items():
            table.add_row(Text(str(check)), fmt_reward({"value": score}))
        parts.append(table)
    if reward.get("reason"):
        parts.append(Text(str(reward["reason"]), style="dim"))
    return Panel(Group(*parts), title="reward", title_align="left", border_style="magenta")


def render_episode(ep: dict) -> RenderableType:
    """The episode as rich renderables: header, instruction, turns with observations, reward, failure. Every string of
    the row is made ``visible`` first: control characters the policy wrote (ESC sequences that clear the screen, set
    the title, write the clipboard) are printed as escapes, not sent to the terminal."""
    ep = visible_tree(ep)
    task = ep.get("task") or {}
    meta = ep.get("metadata") or {}
    header = Text.assemble(
        (str(task.get("id", "unknown task")), "bold"),
        f"  env {task.get('env', '?')} · {task.get('split', '?')} · {ep.get('phase', '?')} step {ep.get('step', '?')}"
        f" · policy v{ep.get('policy_version', '?')} · finish {ep.get('finish_reason') or '?'} · ",
        outcome(ep),
        f"\ngroup {ep.get('group', '?')} · session {meta.get('session', '?')}",
    )
    parts: list[RenderableType] = [header]
    messages = ep.get("messages") or []
    if not any(m.get("role") == "user" for m in messages):
        parts.append(Panel(Text(str(task.get("instruction", "(no instruction recorded)"))), title="instruction",
                           title_align="left", border_style="green"))
    turns = ep.get("turns") or []
    n_assistant = 0
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            turn = turns[n_assistant] if n_assistant < len(turns) else {}
            parts.append(assistant(m, turn))
            n_assistant += 1
        elif role == "tool":
            parts.append(observation(m))
        else:
            parts.append(Panel(Text(str(m.get("content", ""))), title=Text(str(role or "?")), title_align="left",
                               border_style="green" if role == "user" else "white"))
    parts.append(reward_panel(ep))
    if meta.get("screenshots"):
        parts.append(Panel(Text("\n".join(map(str, meta["screenshots"]))), title="screenshots (in the run directory)",
                           title_align="left", border_style="blue"))
    if ep.get("failed"):
        detail = str(ep.get("failure") or "no reason recorded")
        if meta.get("traceback"):
            detail += "\n" + clip_observation(meta["traceback"])
        parts.append(Panel(Text(detail), title="failure (excluded from the gradient)", title_align="left",
                           border_style="red"))
    return Group(*parts)
