"""The notes_equal verifier: the notes file, read as root after the episode, must list exactly the expected notes."""

from __future__ import annotations

from sandforge_notes_env.env import NOTES


def notes_equal(sandbox, args: dict) -> tuple[float, str]:
    """1.0 if the notes match ``args["notes"]`` in order; partial credit for each note in its right place."""
    expected = args["notes"]
    text = sandbox.read_file(NOTES, user="root")
    if text is None:
        return 0.0, f"{NOTES}: missing"
    got = text.splitlines()
    if got == expected:
        return 1.0, "notes match"
    right = sum(a == b for a, b in zip(got, expected))
    return right / max(len(expected), len(got)), f"expected {expected}, got {got}"
