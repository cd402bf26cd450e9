"""The chaos suite's fixtures live in harness.py with its helpers (a module of its own name, so it never shadows
tests/conftest.py): the ``live_job`` RLJob, plus the session's ``docker_client`` and ``terminal_image``."""

from harness import live_job  # noqa: F401 - a fixture
