"""The cold start before RL, for a policy that cannot call tools yet: synthetic pretraining, then the warm start.

Pretraining (``pretrain.steps``) trains on generated one-call exchanges over the job's tools (job/pretraining_data.py). The
warm start (``warmup.steps``) replays each task's reference solution through the real agent loop and sandboxes, keeps
the episodes the verifier accepts, and trains on their assistant tokens; afterwards the policy is the KL reference and
the engine serves it as a new version.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable

from sandforge.job.checkpoint import save_checkpoint
from sandforge.job.console import JobError
from sandforge.job.rl_job import RLJob, training_rows
from sandforge.types import TrainingRow, Trajectory


def copy_source(job: RLJob, stream: str) -> Callable[[int], list[TrainingRow]]:
    """``n -> rows`` of generated copy exchanges over the job's tools (job/pretraining_data.py), from a seeded stream."""
    from sandforge.job.pretraining_data import copy_rows, env_tools
    from sandforge.models.build import load_chat

    chat = load_chat(job.cfg.model)
    tools = env_tools(sorted({e.name for e in job.cfg.environments}))
    rng = random.Random(f"{stream}/{job.cfg.run.seed}")
    return lambda n: copy_rows(chat, tools, rng, n, listed=job.cfg.pretrain.listed)


def pretrain(job: RLJob) -> None:
    """Synthetic pretraining: the policy learns to copy values into tool calls."""
    p = job.cfg.pretrain
    copies = copy_source(job, "pretrain")
    job.ranks.set_lr(p.lr)
    bar = job.bar.add_task("pretraining: copying into tool calls", total=p.steps)
    losses = []
    for step in range(p.steps):
        t0 = time.monotonic()
        m = job.ranks.train(copies(p.batch_size), mode="sft")
        job.tick("pretrain", 1, time.monotonic() - t0)
        losses.append(m["loss"])
        job.logger.log("pretrain", {"pretrain/step": step, "pretrain/loss": m["loss"]})
        job.bar.update(bar, advance=1, description=f"pretraining: loss {m['loss']:.3f}")
    job.bar.console.print(f"pretraining: {p.steps} steps of generated tool calls; loss {losses[0]:.3f} -> "
                          f"{losses[-1]:.3f}", soft_wrap=True)


def verified_demonstrations(job: RLJob) -> tuple[list, int]:
    """``warmup.episodes`` reference-solution episodes, logged: (the ones their verifier accepted, how many were run).
    Families with none are named, with the first reason. The demonstrations come in the order their tasks were drawn,
    not the order they finished in, so the SFT batches, and the warm start, follow from ``run.seed`` alone."""
    tasks = job.sampler.sample(job.cfg.warmup.episodes, phase="warmup")
    trajs = job.collect(tasks, [t.id for t in tasks], scripted=True, label="warm start: reference episodes")
    drawn = {t.id: i for i, t in reversed(list(enumerate(tasks)))}
    trajs = sorted(trajs, key=lambda t: drawn.get(t.task.id, len(tasks)))
    job.logger.log_trajectories(0, "warmup", trajs)
    demos = [t for t in trajs if not t.failed and t.reward and t.reward.success]
    if not demos:
        reasons = {why_not_verified(t) for t in trajs}
        raise JobError(f"warm start: no reference episode passed its verifier ({'; '.join(sorted(reasons))})")
    for family in sorted({f"{t.task.env}/{t.task.family}" for t in trajs}
                         - {f"{t.task.env}/{t.task.family}" for t in demos}):
        failed = [t for t in trajs if f"{t.task.env}/{t.task.family}" == family]
        job.bar.console.print(f"warm start: no verified demonstration of {family} ({len(failed)} tried; first: "
                              f"{why_not_verified(failed[0])}){replay_hint(failed, job.cfg.rollout)}",
                              soft_wrap=True, style="yellow", markup=False)
    long = [t for t in demos if len(t.token_ids) > job.cfg.rollout.max_context]
    if long:
        job.bar.console.print(f"warm start: {len(long)} verified demonstration(s) exceed rollout.max_context "
                              f"({job.cfg.rollout.max_context} tokens), e.g. {long[0].task.id} with "
                              f"{len(long[0].token_ids)}: they train as they are, longer than any episode can be",
                              soft_wrap=True, style="yellow", markup=False)
    return demos, len(trajs)


def imitated(traj: Trajectory) -> Trajectory:
    """``traj`` as the warm start trains on it: its loss mask cleared on every turn the environment rejected (a tool
    error, a call that did not parse). A reference solution may stumble on purpose, as a policy does (a value into
    the wrong field, a call missing an argument), and recover: the stumble stays in the context, so what is learnt
    is the recovery after an error, never the error itself. A trajectory recorded in several rows (a harness that
    rewrote its history) is returned as it is: its turns' spans do not index its rows."""
    stumbles = [t for t in traj.turns if t.tool_errors or t.parse_errors]
    if not stumbles or traj.earlier_rows:
        return traj
    mask = list(traj.loss_mask)
    for turn in stumbles:
        mask[turn.prompt_tokens : turn.prompt_tokens + turn.generated_tokens] = [0] * turn.generated_tokens
    return dataclasses.replace(traj, loss_mask=mask)


def why_not_verified(t) -> str:
    """One line: the task, why its reference episode did not verify, and the end of what its last command printed
    (a solve.sh's output, say)."""
    why = t.failure or (t.reward.reason if t.reward else "") or t.finish_reason or "unknown"
    outputs = [o for turn in t.turns for call, o in zip(turn.tool_calls, turn.observations)
               if call.name != "submit" and o.strip()]
    last = outputs[-1] if outputs else ""
    tail = " | ".join(x.strip() for x in last.strip().splitlines()[-3:] if x.strip())[-160:]
    return f"{t.task.id}: {why.strip().splitlines()[0] if why.strip() else why}" + (f" (output: {tail})" if tail else "")


def replay_hint(failed: list, rollout) -> str:
    """What to look at when a family's reference episodes did not verify, by how they ended: out of turns or
    context, a reference reading the task's /solution folder (what went wrong there `harbor check` shows),
    else nothing to add."""
    if any(t.finish_reason == "max_turns" for t in failed):
        return (f"; is rollout.max_turns ({rollout.max_turns}, or the environment's own max_turns) shorter than its "
                f"reference solution?")
    if any(t.finish_reason == "context" for t in failed):
        return f"; is rollout.max_context ({rollout.max_context} tokens) shorter than its reference episode?"
    said = " ".join(o for t in failed for turn in t.turns for o in turn.observations)
    if "/solution/" in said:
        return ("; its reference reads files beside solve.sh in /solution: `sandforge harbor check` runs it as Harbor "
                "does, and says whether it works there")
    return ""


def epoch_batches(n: int, batch_size: int, steps: int, rng: random.Random) -> list[list[int]]:
    """``steps`` batches of ``batch_size`` indices into ``n`` items, passing over them in epochs: each epoch a fresh
    shuffle cut into consecutive batches, so every item is seen once before any is seen again. A batch that straddles
    two epochs takes the first one's last items and the next one's first others (never one item twice). Independent
    draws per step would leave about a third of a one-pass budget's items unseen and show others twice."""
    size = min(batch_size, n)
    order: list[int] = []
    batches = []
    for _ in range(steps if n else 0):
        if len(order) < size:
            epoch = list(range(n))
            rng.shuffle(epoch)
            left = set(order)
            fill = [i for i in epoch if i not in left][: size - len(order)]
            taken = set(fill)
            order += fill + [i for i in epoch if i not in taken]
        batches.append(order[:size])
        order = order[size:]
    return batches


def warmup(job: RLJob) -> None:
    """SFT on verified reference episodes (``warmup.copy_rows`` generated exchanges mixed into each step), then the
    policy becomes the KL reference and a new version on the engine."""
    w = job.cfg.warmup
    demos, tried = verified_demonstrations(job) if w.episodes else ([], 0)
    items = [training_rows([imitated(d)]) for d in demos] + [[row] for row in conversation_rows(job)]
    job.ranks.set_lr(w.lr)
    what = " and ".join(x for x in (f"{len(demos)} verified episodes" * bool(w.episodes),
                                    f"{len(items) - len(demos)} conversations" * bool(w.data)) if x)
    bar = job.bar.add_task(f"warm start: SFT on {what}", total=w.steps)
    losses = []
    copies = copy_source(job, "warmup") if w.copy_rows else None
    for step, picks in enumerate(epoch_batches(len(items), w.batch_size, w.steps, job.rng)):
        batch = [row for i in picks for row in items[i]]
        t0 = time.monotonic()
        m = job.ranks.train(batch + (copies(w.copy_rows) if copies else []), mode="sft")
        job.tick("sft", 1, time.monotonic() - t0)
        losses.append(m["loss"])
        job.logger.log("warmup", {"warmup/step": step, "warmup/loss": m["loss"], "warmup/grad_norm": m["grad_norm"]})
        job.bar.update(bar, advance=1, description=f"warm start: SFT loss {m['loss']:.3f}")
    verified = f"{len(demos)}/{tried} reference episodes verified" if w.episodes else ""
    data = f"{len(items) - len(demos)} conversations from {w.data}" if w.data else ""
    job.bar.console.print(f"warm start: {'; '.join(x for x in (verified, data) if x)}; SFT loss {losses[0]:.3f} -> "
                          f"{losses[-1]:.3f} in {w.steps} steps", soft_wrap=True)
    job.ranks.set_lr(job.cfg.trainer.lr)
    job.ranks.each("reset_reference")
    job.version += 1
    job.push_weights()


def conversation_rows(job: RLJob) -> list[TrainingRow]:
    """``warmup.data``'s conversations as training rows (job/sft_data.py); those past ``rollout.max_context`` are
    left out, and the run says how many. JobError naming the file and line for one that cannot be read."""
    from sandforge.job.sft_data import DataError, data_rows
    from sandforge.models.build import load_chat

    path = job.cfg.warmup.data
    if path is None:
        return []
    try:
        rows, long = data_rows(load_chat(job.cfg.model), path, job.cfg.rollout.max_context)
    except DataError as e:
        raise JobError(f"warmup.data: {e}") from None
    if long:
        job.bar.console.print(f"warm start: {long} conversation(s) of {path} are longer than rollout.max_context "
                              f"({job.cfg.rollout.max_context} tokens) and are left out", soft_wrap=True,
                              style="yellow", markup=False)
    if not rows:
        raise JobError(f"warmup.data: every conversation of {path} is longer than rollout.max_context")
    return rows


def before_rl(job: RLJob, rl_follows: bool = True) -> None:
    """Pretraining and the warm start where configured, then checkpoint 0: the policy RL starts from, kept for
    comparison and evaluation."""
    if job.cfg.pretrain.steps:
        pretrain(job)
    if job.cfg.warmup.steps:
        warmup(job)
        job.bar.console.print(job.clock.line(), soft_wrap=True)
    # `sandforge sft` ends here: a train run started from its policy builds an optimizer of its own
    if (job.cfg.pretrain.steps or job.cfg.warmup.steps) and job.cfg.trainer.fresh_optimizer and rl_follows:
        fresh_optimizer(job)
    save_checkpoint(job, 0)


def fresh_optimizer(job: RLJob) -> None:
    """RL starts from a fresh optimizer (``trainer.fresh_optimizer``): the moments the supervised steps left would
    otherwise go on moving the policy SFT's way, and their second moment would shrink RL's own steps."""
    reset = job.ranks.each("reset_optimizer")
    job.logger.log("rl_start", {"rl_start/optimizer_states_reset": float(sum(reset))})
