"""Environments: the gymnasium environments an episode acts in (each in a Docker sandbox of sandforge.sandbox), their
task generators and task sources.

Importing this package registers every environment with gymnasium (``sandforge/Terminal-v0``, ``sandforge/Repo-v0``,
..., and installed plugins'); see ``gym_registry.py``. Registering imports nothing heavy: gymnasium, and the names.
"""

from sandforge.environments.gym_registry import register_environments

register_environments()
