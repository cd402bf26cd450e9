"""A Harbor task's separate verifier: test.sh in a fresh sandbox that receives only the task's artifacts.

With ``[verifier] environment_mode = "separate"`` (or a ``[verifier.environment]``), Harbor grades in a container of
its own: the verifier's image (``tests/Dockerfile``, ``[verifier.environment] docker_image``, or a fresh container of
the task's image) gets the files task.toml's ``artifacts`` name, copied from the agent's container, and Harbor's
convention folder ``/logs/artifacts``. Nothing else of the agent's reaches it: a ``conftest.py`` or a doctored tool
the policy planted elsewhere is simply not there.

Here, after the episode (``score_task`` has stopped the policy's processes), in the agent's sandbox: each
``[[verifier.collect]]`` hook runs (as the agent's user in hardened mode: its output is the policy's to shape anyway,
and no root process runs over what the policy left), then each artifact is taken as a tar archive, read as root with
links kept as links, and rebuilt on the host with nothing in it that reaches outside its own path
(sandbox/trees.py ``confine``: a link to ``/tests/expected.txt`` would hand the grader its own answer). Then the
grader's sandbox starts (``Sandbox.grading_sandbox``), /tests and /logs are made afresh there, the archives are
extracted (never through an existing link), and test.sh runs as in the shared case (grading.py). The grader's sandbox
is removed afterwards.

Whatever the policy can cause scores 0 or is named, never fails the episode: artifacts past ``ARTIFACTS_MAX_BYTES``
together score 0 (``too_large``); a hook that fails or runs out of time, an artifact that is not there and members
that were not passed on are named in the check's reason, and test.sh decides (Harbor runs the verifier whatever its
hooks did).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from sandforge.environments.harbor.settings import Artifact, CollectHook
from sandforge.policy_text import bounded
from sandforge.sandbox.trees import confine
from sandforge.types import Sandbox, ZeroScore

ARTIFACTS_MAX_BYTES = 128 << 20  # every artifact's archive together, as tar writes it
CONVENTION = "/logs/artifacts"  # Harbor's folder for files an agent or a hook leaves for the verifier: always taken
TRANSFER_TIMEOUT = 60.0  # each artifact's archive, out of the agent's sandbox and into the grader's
# what a check adds to test.sh's own timeout for a separate verifier: the archives out and in, the grader's start
OVERHEAD = 4 * TRANSFER_TIMEOUT


@dataclass(frozen=True)
class SeparateArgs:
    """The ``separate`` argument of a harbor_tests check (environments/harbor/tasks.py ``separate_check``)."""

    artifacts: tuple[Artifact, ...] = ()
    collect: tuple[CollectHook, ...] = ()
    test_timeout: float = 600.0

    @classmethod
    def of(cls, raw) -> SeparateArgs:
        """From the check's plain data; ValueError names what is wrong."""
        if not isinstance(raw, dict) or set(raw) - {"artifacts", "collect", "test_timeout"}:
            raise ValueError(f"harbor_tests' separate takes artifacts, collect and test_timeout; got {raw!r}")
        try:
            artifacts = tuple(Artifact(str(a["source"]), tuple(map(str, a.get("exclude", ()))))
                              for a in raw.get("artifacts", ()))
            collect = tuple(CollectHook(str(h["command"]), float(h.get("timeout", 60.0)),
                                        None if h.get("user") is None else str(h["user"]))
                            for h in raw.get("collect", ()))
            return cls(artifacts, collect, float(raw.get("test_timeout", 600.0)))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"harbor_tests' separate: {type(e).__name__}: {e}") from None

    def budget(self) -> float:
        """The check's timeout: test.sh's, every hook's and the transfers'."""
        return self.test_timeout + sum(h.timeout for h in self.collect) + OVERHEAD


@dataclass
class Received:
    """What the grader's sandbox gets: confined archives, and notes for the check's reason."""

    archives: list[bytes] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def received(sandbox: Sandbox, args: SeparateArgs) -> Received:
    """Run the collect hooks in the agent's ``sandbox``, then take every artifact (and ``CONVENTION``) out of it,
    confined to its path. ZeroScore ``too_large`` past ``ARTIFACTS_MAX_BYTES``."""
    got = Received()
    for i, hook in enumerate(args.collect):
        result = sandbox.exec(hook.command, timeout=hook.timeout, user=hook.user, session=False)
        if result.timed_out:
            got.notes.append(f"collect hook {i} timed out after {hook.timeout:g}s")
        elif result.exit_code != 0:
            got.notes.append(f"collect hook {i} exited {result.exit_code}: {bounded(result.output.strip(), 200)}")
    used = 0
    convention = () if any(a.source == CONVENTION for a in args.artifacts) else (Artifact(CONVENTION),)
    for artifact in (*args.artifacts, *convention):
        room = ARTIFACTS_MAX_BYTES - used
        raw = sandbox.get_tree(artifact.source, artifact.exclude, max_bytes=room, timeout=TRANSFER_TIMEOUT)
        if raw is not None and len(raw) > room:
            raise ZeroScore("too_large", f"the artifacts are larger than {ARTIFACTS_MAX_BYTES >> 20} MiB together "
                                         f"(at {artifact.source}); the verifier was not run")
        if raw is None:
            if artifact.source != CONVENTION:
                got.notes.append(f"artifact {artifact.source}: nothing there")
            continue
        used += len(raw)
        kept = confine(raw, artifact.source)
        if kept.dropped:
            shown = ", ".join(kept.dropped[:3]) + (", ..." if len(kept.dropped) > 3 else "")
            got.notes.append(f"artifact {artifact.source}: {len(kept.dropped)} member(s) not passed on: {shown}")
        if kept.archive:
            got.archives.append(kept.archive)
    return got


def graded_apart(sandbox: Sandbox, args: SeparateArgs, run: Callable[..., tuple]) -> tuple:
    """``run`` (grading.py ``harbor_tests`` with the check's other arguments) in a fresh grader's sandbox that
    received ``sandbox``'s artifacts; its result, with ``received``'s notes in the reason."""
    got = received(sandbox, args)
    grader = sandbox.grading_sandbox()
    try:
        outcome = run(grader, timeout=args.test_timeout, artifacts=tuple(got.archives))
    finally:
        grader.close()
    if not got.notes:
        return outcome
    reward, reason, *parts = outcome
    return (reward, f"{reason} [separate verifier: {'; '.join(got.notes)}]", *parts)
