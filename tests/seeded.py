"""The built-in environments' seeded tasks, ``(family, seed, split="train") -> Task``, made as a job's task source
makes them: by the registry entry, the one lookup of a family in the task module's ``FAMILIES``."""

from __future__ import annotations

from sandforge.registry import environment

terminal_task = environment("terminal").make_task()
repo_task = environment("repo").make_task()
slack_task = environment("slack").make_task()
notion_task = environment("notion").make_task()
browser_task = environment("browser").make_task()
