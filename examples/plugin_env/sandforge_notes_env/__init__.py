"""An example sandforge plugin: the policy keeps a notes file through two tools, a verifier checks the notes.

Registered through entry points (see pyproject.toml). The sandboxes reuse the built-in terminal image; a plugin with
its own image puts a Dockerfile in a package and names it: ``"dockerfile": "my_plugin.image"``.
"""

ENVIRONMENT = {
    "env": "sandforge_notes_env.env:NotesEnv",
    "tasks": "sandforge_notes_env.tasks",
    "image": "terminal",
}
