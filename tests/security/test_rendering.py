"""What a policy writes is shown, never interpreted (issue #23, item 7): `sandforge show` prints tool names, arguments
and outputs that look like rich markup as they are, and report.html escapes them."""

from __future__ import annotations

import io

from rich.console import Console

from sandforge.job.show import episode_table, render_episode

HOSTILE = "[/bold][link=file:///etc/shadow]x[/link] [red]red[/red] [/]"


def episode() -> dict:
    return {"task": {"id": f"t{HOSTILE}", "env": "terminal", "instruction": HOSTILE}, "phase": "rl", "step": 0,
            "group": HOSTILE, "failed": True, "failure": HOSTILE, "finish_reason": "error",
            "metadata": {"session": HOSTILE, "traceback": HOSTILE, "screenshots": [HOSTILE]},
            "reward": {"value": 0.0, "success": False, "reason": HOSTILE, "breakdown": {HOSTILE: 0.0}},
            "messages": [{"role": "user", "content": HOSTILE},
                         {"role": "assistant", "content": HOSTILE, "reasoning": HOSTILE,
                          "tool_calls": [{"name": HOSTILE, "arguments": {HOSTILE: HOSTILE}}]},
                         {"role": "tool", "name": HOSTILE, "content": HOSTILE}],
            "turns": [{"tool_calls": [{"name": HOSTILE, "arguments": {}}], "observations": [HOSTILE]}]}


def test_show_prints_markup_lookalikes_verbatim():
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(render_episode(episode()))
    console.print(episode_table([episode()]))
    text = console.file.getvalue()
    assert text.count("[/bold]") >= 5 and "[red]red[/red]" in text


def test_the_report_escapes_it(tmp_path):
    from sandforge.job.report import episode_html

    page = episode_html(0, episode())
    assert "[/bold]" in page and "<link" not in page and "&lt;" not in HOSTILE
