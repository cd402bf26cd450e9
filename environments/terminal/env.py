"""A bash terminal in a fresh sandbox per episode: run commands, read and write files, submit."""

from __future__ import annotations

from sandforge.environments.sandbox_env import SandboxEnv
from sandforge.environments.tools import ToolError, tool


class TerminalEnv(SandboxEnv):
    """A bash terminal: run commands, read and write files, submit. The sandbox lifecycle is ``SandboxEnv``'s."""

    @tool
    def bash(self, command: str) -> str:
        """Run a bash command in /workspace; returns output and exit code."""
        try:
            result = self.run_command(command)
        except ValueError as e:
            raise ToolError(f"bash: {e}") from e
        output = result.output if not result.output or result.output.endswith("\n") else result.output + "\n"
        if result.timed_out:
            return f"{output}[timed out after {self.exec_timeout:g}s; killed]"
        return f"{output}[exit code {result.exit_code}]"

    @tool
    def read_file(self, path: str) -> str:
        """Read a text file."""
        try:
            content = self.sandbox.read_file(path)
        except ValueError as e:
            raise ToolError(f"read_file: {e}") from e
        except OSError as e:
            raise ToolError(str(e)) from e
        if content is None:  # a rejected call (a tool error), as a wrong path to str_replace is
            raise ToolError(f"no such file: {path}")
        return self._truncate(content)

    @tool
    def write_file(self, path: str, content: str) -> str:
        """Write a text file, replacing it."""
        try:
            self.sandbox.write_file(path, content)
        except ValueError as e:  # a NUL in the path, text that is not valid Unicode
            raise ToolError(f"write_file: {e}") from e
        except OSError as e:
            return f"Error: {e}"
        return f"wrote {len(content.encode())} bytes to {path}"

    @tool
    def submit(self) -> str:
        """Finish the task."""
        self.end_episode()
        return "submitted"
