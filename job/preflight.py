"""Checks of a job that need more than its schema (the registry, the host, the Docker daemon), run before anything
heavy is imported or started: a config that cannot run fails in a second with one line naming the key and the file."""

from __future__ import annotations

import json
from pathlib import Path

from sandforge.config import ConfigError, JobConfig


def validate_job(cfg: JobConfig, source: str = "config", warm_start: bool = True):
    """Checks that need the registry (environment names, task families); still no heavy imports. ``warm_start``:
    the command runs the config's warm start (``train``, ``sft``; not ``eval``). Returns the job's ``TaskSampler``:
    its task sources, opened here once for the whole run."""
    from sandforge.job.task_sampler import TaskSampler
    from sandforge.registry import PluginError

    try:
        sampler = TaskSampler(cfg.environments, cfg.run.seed)
    except (KeyError, ValueError, PluginError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    if warm_start and cfg.warmup.steps > 0 and cfg.warmup.episodes > 0:
        for i in sampler.without_references("warmup"):
            env = cfg.environments[i]
            raise ConfigError(
                f"{source}: 'warmup.episodes' is {cfg.warmup.episodes}, but environments[{i}] ({env.name}"
                f"{'' if env.id is None else ' ' + env.id}) brings no reference solution for the warm start to "
                "replay (none of its tasks has one); draw it in RL only (its 'weight' 0 and an 'rl_weight'), or "
                "learn from conversations instead ('warmup.episodes' 0 and 'warmup.data'), or 'warmup.steps' 0")
    check_harness_context(cfg, source)
    n_experts = 0
    if cfg.model.arch == "k3":
        from sandforge.models.k3.config import preset_config  # plain dataclasses, no torch

        try:
            n_experts = preset_config(cfg.model.preset, cfg.model.k3).n_experts
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None
        if cfg.model.init_from is not None:  # a checkpoint brings its own sizes
            n_experts = json.loads((Path(cfg.model.init_from) / "config.json").read_text()).get("n_experts", 0)
    ep = cfg.trainer.expert_parallel
    if ep > 1 and cfg.model.arch != "k3":
        raise ConfigError(f"{source}: 'trainer.expert_parallel' = {ep}: expert parallelism shards the K3 LatentMoE "
                          f"(model.arch k3); model.arch {cfg.model.arch} cannot use it")
    if ep > 1 and n_experts % ep:
        raise ConfigError(f"{source}: 'trainer.expert_parallel' = {ep} must divide the model's n_experts "
                          f"({n_experts}); change model.k3.n_experts or trainer.expert_parallel")
    return sampler


def check_harness_context(cfg: JobConfig, source: str = "config") -> None:
    """A harness whose own prompt does not fit the episode's context is refused now, not at every first request."""
    if cfg.agent.harness is None:
        return
    from sandforge.rollout.harnesses import find_harness

    try:
        harness = find_harness(cfg.agent.harness, cfg.agent.options)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if harness.prompt_tokens >= cfg.rollout.max_context:
        raise ConfigError(
            f"{source}: 'agent.harness' {harness.name} sends about {harness.prompt_tokens:,} tokens before the task "
            f"(its system prompt and tool declarations, counted with SmolLM2's tokenizer), more than "
            f"'rollout.max_context' {cfg.rollout.max_context}: every episode would end at its first request; give "
            "it a policy and a 'rollout.max_context' that hold its prompt, or another harness")


def local_model(cfg: JobConfig, source: str = "config") -> JobConfig:
    """The job with ``model.path`` resolved to a local Hugging Face directory (a .gguf file converted once, a pulled
    catalogue name found in the cache), so no process of the run needs to know where the weights came from."""
    if cfg.model.arch != "hf":
        return cfg
    from sandforge.job.console import console
    from sandforge.models.sources import ModelSourceError, local_model_dir

    try:
        path = local_model_dir(cfg.model.path, announce=lambda line: console.print(line, soft_wrap=True))
    except ModelSourceError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path)})})


# the kernel's guards for links and files in sticky folders (/tmp), which root graders rely on: scripts/harden_host.sh
STICKY_GUARDS = {"protected_symlinks": 1, "protected_regular": 2, "protected_fifos": 2, "protected_hardlinks": 1}


def sticky_guard_warnings(sysctl_dir: Path = Path("/proc/sys/fs")) -> list[str]:
    """What the host leaves open to a policy's links in /tmp: one line per guard that is off (the switches are the
    host's, not a container's; unreadable ones are not reported)."""
    lines = []
    for name, want in STICKY_GUARDS.items():
        try:
            have = int((sysctl_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if have < want:
            lines.append(f"fs.{name} is {have} on this host (want {want}): a link or file the policy planted in a "
                         f"sandbox's /tmp can redirect a root grader's write there; `sudo sysctl -w fs.{name}={want}` "
                         "(scripts/harden_host.sh sets all of them)")
    return lines


def check_host(cfg: JobConfig, source: str = "config") -> None:
    """What this host cannot give the job, found before anything starts: one sandbox needing more memory or cpus than
    the machine has, a runtime or a named base image the Docker daemon lacks. (On a cluster, ``ray.address``, the
    sandboxes run on other nodes, so only the Docker checks apply.)"""
    import os

    from sandforge.sandbox.spec import parse_size

    s = cfg.sandbox
    if cfg.ray.address is None:
        try:
            memory = parse_size(s.memory)
        except Exception:  # noqa: BLE001 - docker's own error names no key
            raise ConfigError(f"{source}: 'sandbox.memory' = {s.memory!r} is not a size such as 512m or 2g") from None
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if memory > host:
            raise ConfigError(f"{source}: 'sandbox.memory' = {s.memory} is more than this machine has "
                              f"({host / 2**30:.1f} GiB); lower sandbox.memory")
        if s.cpus > (os.cpu_count() or 1):
            raise ConfigError(f"{source}: 'sandbox.cpus' = {s.cpus:g} is more than this machine has "
                              f"({os.cpu_count()}); lower sandbox.cpus")
    if s.base_image is None and s.runtime is None:
        return
    from sandforge.sandbox.daemon import docker_client
    from sandforge.sandbox.images import image_id
    from sandforge.types import SandboxError

    try:
        client = docker_client()
    except SandboxError:
        return  # the run reports the missing daemon itself, with what to do
    if s.runtime is not None and s.runtime not in (client.info().get("Runtimes") or {}):
        raise ConfigError(f"{source}: 'sandbox.runtime' = {s.runtime!r}: the Docker daemon has no such runtime "
                          f"(it has: {', '.join(sorted(client.info().get('Runtimes') or {}))})")
    if s.base_image is not None and image_id(client, s.base_image) is None:
        raise ConfigError(f"{source}: 'sandbox.base_image' = {s.base_image!r} is not a local image: "
                          f"`docker pull {s.base_image}` (or `docker load`) first, or leave sandbox.base_image "
                          "unset to bootstrap Debian bookworm")
