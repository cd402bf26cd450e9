"""NotesEnv: add a note, read the notes, submit. The notes live in the sandbox, where the verifier reads them."""

from __future__ import annotations

from sandforge.environments.sandbox_env import SandboxEnv
from sandforge.environments.tools import ToolError, tool

NOTES = "/workspace/notes.txt"


class NotesEnv(SandboxEnv):
    """Tools that only append to and read one file: a policy cannot do anything else in the sandbox."""

    @tool
    def add_note(self, text: str) -> str:
        """Append one note to the notes file.

        Args:
            text: the note, a single line.
        """
        if "\n" in text or not text.strip():
            raise ToolError("add_note: text must be one non-empty line")
        current = self.sandbox.read_file(NOTES) or ""
        self.sandbox.write_file(NOTES, current + text.strip() + "\n")
        return f"{len(current.splitlines()) + 1} notes"

    @tool
    def read_notes(self) -> str:
        """Read every note, one per line."""
        return self.sandbox.read_file(NOTES) or "(no notes yet)"

    @tool
    def submit(self) -> str:
        """Finish the task."""
        self.end_episode()
        return "submitted"
