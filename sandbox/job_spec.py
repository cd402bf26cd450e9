"""A sandbox's spec as a job gives it: the job's ``sandbox`` section, the environment's needs and the task's own
settings, in that order (the rollout workers, ``gymnasium.make`` and ``sandforge harbor check`` all build it here)."""

from __future__ import annotations

import docker.errors

from sandforge.config import SandboxConfig
from sandforge.sandbox.spec import ROOT_AGENT_CAPS, SandboxSpec
from sandforge.types import TaskSandbox


def sandbox_spec(s: SandboxConfig, image: str, env_class: type, task_sandbox: TaskSandbox | None, client) -> SandboxSpec:
    """The job's ``sandbox`` config, with what the env declares it needs (``sandbox_defaults``) and what the task asks
    (``task.sandbox``: a Harbor task's user, workdir, cpus, memory) on top; cpus and memory that the job's
    config sets explicitly win over the task's. A root agent (Harbor's contract) gets root's home and powers."""
    fields = dict(memory=s.memory, cpus=s.cpus, pids_limit=s.pids_limit, network=s.network, runtime=s.runtime,
                  read_only=s.read_only, workspace_size=s.workspace_size, tmp_size=s.tmp_size, nofile=s.nofile,
                  max_file_size=s.max_file_size)
    explicit = {k: fields[k] for k in ("memory", "cpus") if k in s.model_fields_set}
    own = task_sandbox.overrides() if task_sandbox is not None else {}
    merged = {**fields, **getattr(env_class, "sandbox_defaults", {}), **own, **explicit}
    if getattr(env_class, "workdir_from_image", False) and "workdir" not in own:
        try:
            workdir = client.images.get(image).attrs.get("Config", {}).get("WorkingDir") or ""
        except docker.errors.ImageNotFound:  # starting a sandbox from it will say so
            workdir = ""
        merged["workdir"] = workdir if workdir not in ("", "/") else "/workspace"  # the image's WORKDIR
    if merged.get("user") in ("root", "0", "0:0"):
        merged.setdefault("home", "/root")
        merged["root_caps"] = tuple(ROOT_AGENT_CAPS)
    return SandboxSpec(image=image, **merged)


def grading_spec(s: SandboxConfig, image: str, env_class: type, task_sandbox: TaskSandbox | None,
                 client) -> SandboxSpec:
    """The spec of a task's separate grader's sandbox (``Task.grading_image``, built as ``image``): root's, with the
    task's limits and workdir (else the image's WORKDIR), none of a non-root agent's scratch folders."""
    own = task_sandbox or TaskSandbox()
    grader = TaskSandbox(user="root", workdir=own.workdir, cpus=own.cpus, memory=own.memory,
                         workspace_size=own.workspace_size)
    return sandbox_spec(s, image, env_class, grader, client)
