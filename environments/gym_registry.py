"""gymnasium ids for every sandforge environment, registered when ``sandforge.environments`` is imported::

    import gymnasium
    import sandforge.environments  # registers sandforge/Terminal-v0, sandforge/Repo-v0, ...

    env = gymnasium.make("sandforge/Terminal-v0", family="count_words", seed=3)  # or task=<Task>

Built-ins have the ids in ``GYM_IDS``; an installed plugin's environment (entry-point group ``sandforge.environments``)
gets ``sandforge/<Name>-v0`` from its entry-point name (``notes`` -> ``sandforge/Notes-v0``). Registering imports
neither Docker nor any environment's module: each id's entry point is ``ENTRY_POINT``, a string gymnasium imports
only when ``gymnasium.make`` is called. It names ``sandforge.rollout.gym_envs.make_env``, which builds the env on one
task and grades its last step with the verifiers: rollout/ may import verifiers, environments/ may not
(ARCHITECTURE.md), so the factory lives there and only its name is here.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import gymnasium

from sandforge.registry import BUILTIN_ENVIRONMENTS, ENVIRONMENT_GROUP

GYM_IDS = {
    "terminal": "sandforge/Terminal-v0",
    "repo": "sandforge/Repo-v0",
    "harbor": "sandforge/Harbor-v0",
    "slack": "sandforge/Slack-v0",
    "notion": "sandforge/Notion-v0",
    "browser": "sandforge/Browser-v0",
}
ENTRY_POINT = "sandforge.rollout.gym_envs:make_env"  # gymnasium's lazy "module:attr": imported at make, not here


def gym_id(name: str) -> str:
    """The gymnasium id of environment ``name``: a built-in's from ``GYM_IDS``, else ``sandforge/<CamelName>-v0``."""
    if name in GYM_IDS:
        return GYM_IDS[name]
    return "sandforge/" + "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", name) if w) + "-v0"


def register_environments() -> dict[str, str]:
    """Register every built-in and every installed plugin environment with gymnasium (again after a plugin is
    installed: ids already registered are kept). Returns environment name -> gymnasium id."""
    names = list(BUILTIN_ENVIRONMENTS) + [ep.name for ep in entry_points(group=ENVIRONMENT_GROUP)]
    ids = {}
    for name in dict.fromkeys(names):
        env_id = gym_id(name)
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point=ENTRY_POINT, kwargs={"env": name})
        ids[name] = env_id
    return ids
