"""A Python repository with a reported bug, in a fresh sandbox per episode: read, edit, run the visible tests, submit.

The tools are the SWE-agent set: bash, read_file, str_replace (an edit that must name its target exactly once) and
run_tests. The repository, its git history and the visible tests come from the task's setup (see ``tasks.py``);
grading is the ``repo_tests`` verifier's, in a fresh container with the hidden tests, so nothing here decides a reward.
"""

from __future__ import annotations

import posixpath

from sandforge.environments.terminal.env import TerminalEnv
from sandforge.environments.tools import ToolError, tool

RUN_TESTS_TIMEOUT = 60.0  # seconds; a test run is slower than a typical bash command
_RUN_TESTS = "python3 -m pytest -q --tb=short -p no:cacheprovider tests 2>&1"


class RepoEnv(TerminalEnv):
    """bash and read_file as in the terminal env; file edits go through str_replace, tests through run_tests."""

    # the terminal's write_file is replaced by str_replace: an edit the policy has to locate exactly
    write_file = None

    @tool
    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of old with new in a file; old must match exactly once, whitespace included.

        Args:
            path: the file, relative to /workspace or absolute
            old: the exact text to replace, with enough surrounding lines that it occurs only once
            new: the text that takes its place
        """
        if not old:
            raise ToolError("str_replace: old must not be empty (to create a file use bash)")
        try:
            content = self.sandbox.read_file(path)
        except (ValueError, OSError) as e:  # a NUL in the path, a directory, a file the policy may not read
            raise ToolError(f"str_replace: {e}") from e
        if content is None:
            raise ToolError(f"str_replace: no such file: {path}")
        count = content.count(old)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            raise ToolError(f"str_replace: old {where} in {path}; it must match exactly one place (add context lines)")
        try:
            self.sandbox.write_file(path, content.replace(old, new, 1))
        except (ValueError, OSError) as e:
            raise ToolError(f"str_replace: {e}") from e
        line = content[: content.index(old)].count("\n") + 1
        return f"edited {posixpath.normpath(path)} at line {line}"

    @tool
    def run_tests(self) -> str:
        """Run the repository's tests (the visible ones in tests/) with pytest; returns the short report."""
        timeout = max(self.exec_timeout, RUN_TESTS_TIMEOUT)
        result = self.run_command(_RUN_TESTS, timeout=timeout, session=False)
        if result.timed_out:
            return self._truncate(result.output) + f"\n[tests timed out after {timeout:g}s; killed]"
        return self._truncate(result.output)
