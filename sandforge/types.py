"""Plain data exchanged between the parts of sandforge, and the ``Sandbox`` protocol graders act through.

Environments, the rollout, verifiers and the trainer talk only through these dataclasses, never through each other's
objects. Every type round-trips through ``to_dict``/``from_dict`` so it can cross Ray and be written as JSON lines.
``Sandbox`` is what a verifier may do with an episode's sandbox; Docker's implementation lives in
``sandforge.sandbox.docker_sandbox``, which graders never import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]


@dataclass
class ToolCall:
    """One call the policy asked for: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""


@dataclass
class Message:
    """One chat message. Assistant messages keep their reasoning; tool messages name the tool (and call) they answer."""

    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str = ""  # for role == "tool": which tool produced this observation ("error" for a reply that did not parse)
    tool_call_id: str = ""  # for role == "tool": the ToolCall.id it answers ("" when it answers no call)

    @classmethod
    def from_dict(cls, d: dict) -> Message:
        calls = [ToolCall(**c) for c in d.get("tool_calls", [])]
        return cls(**{**d, "tool_calls": calls})


# --- agent <-> engine: what an episode asks the policy for, and what one sample of it is ---------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """Sample ``n`` continuations of ``prompt_ids`` (the episode's whole token sequence so far). ``session_id`` lets the
    engine keep the episode's cache between turns; ``seed`` makes sample i draw from a generator seeded (seed, i),
    whatever else is batched with it. The in-process ``EngineCore``, the Ray ``EngineActor``, ``RemoteEngine`` and
    ``sandforge serve`` all answer it; over HTTP it travels as ``to_dict()``."""

    prompt_ids: list[int]
    session_id: str | None = None
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: list[int] = field(default_factory=list)
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:  # copies: the caller's sequence goes on growing while the request is in flight
        for name in ("prompt_ids", "stop_ids"):  # anything else is left for the engine to refuse by name
            if isinstance(getattr(self, name), (list, tuple)):
                object.__setattr__(self, name, list(getattr(self, name)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GenerateRequest:
        """A request from JSON; unknown keys are refused by name (ValueError), missing ones take the defaults."""
        if not isinstance(d, dict) or "prompt_ids" not in d:
            raise ValueError(f"a request is an object with prompt_ids and sampling keys {sorted(_REQUEST_KEYS)}; "
                             f"got {d!r:.80}")
        unknown = sorted(set(d) - _REQUEST_KEYS)
        if unknown:
            raise ValueError(f"unknown request keys {unknown}; a request has {sorted(_REQUEST_KEYS)}")
        try:
            return cls(**{k: v for k, v in d.items() if v is not None or k == "session_id"})
        except TypeError as e:  # e.g. prompt_ids not a list
            raise ValueError(f"bad request: {e}") from e


_REQUEST_KEYS = frozenset(GenerateRequest.__dataclass_fields__)


@dataclass(frozen=True)
class Sample:
    """One sampled continuation: the token ids the engine produced (the stop id included when ``finish_reason`` is
    "stop"), their log-probabilities, the weight version that sampled them (``token_versions`` per token, where the
    weights changed mid-reply), how much of the prompt came from the session's cache, and the experts each fed token
    was routed to (``[tokens][moe layers][top_k]``, for routing replay; None when the policy has no MoE or the engine
    does not say). Construction checks the shape, so a broken engine fails its episode with a readable reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    version: int = -1
    token_versions: list[int] | None = None
    cached_tokens: int = 0
    prefill_tokens: int = 0
    routed_experts: list | None = None

    def __post_init__(self) -> None:
        ids, logprobs = self.token_ids, self.logprobs
        if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
            got = {k: (len(v) if isinstance(v, list) else type(v).__name__) for k, v in
                   (("token_ids", ids), ("logprobs", logprobs))}
            raise ValueError(f"a sample needs token_ids and logprobs of equal length, got {got}")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        return cls(**{k: v for k, v in d.items() if k in _SAMPLE_KEYS})


_SAMPLE_KEYS = frozenset(Sample.__dataclass_fields__)


@dataclass
class Reward:
    """What a verifier concluded. ``value`` is the scalar the trainer uses; ``breakdown`` explains it."""

    value: float
    success: bool
    breakdown: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    zero_causes: list[str] = field(default_factory=list)  # ZERO_CAUSES of the checks the policy's leavings zeroed


# Why a check scored 0 without judging an answer, because of what the policy left: ``reward/zero_<cause>`` counts
# them (a failed episode is infrastructure's fault, ``episodes/failed_<kind>``; these are verdicts). service_stopped:
# the policy left a service listening, which the stop before grading ended, and the task did not score. broke_check: a
# check's verifier raised what it did not mean, or hung, on what the policy left, and runs on a fresh sandbox
# (verifiers/checks.py ``failure_rule``).
ZERO_CAUSES = ("missing", "not_a_file", "link", "too_large", "malformed", "timeout", "state", "service_stopped",
               "broke_check")


class ZeroScore(Exception):
    """What the policy left makes a check unanswerable: a missing or malformed answer, a FIFO or a device where a
    file should be, a link out of the workspace, a file too large, a read or command that ran out of the check's time,
    a reward file the task's tests wrote from the policy's answer that is not a reward. A verifier (or any grader: an
    environment's own, Harbor's) raises it or returns 0 itself; the check scores 0 with ``reason``, never fails the
    episode, and ``cause`` (one of ``ZERO_CAUSES``) is counted in ``reward/zero_<cause>``."""

    def __init__(self, cause: str, reason: str):
        if cause not in ZERO_CAUSES:
            raise ValueError(f"unknown zero cause {cause!r} (known: {', '.join(ZERO_CAUSES)})")
        super().__init__(reason)
        self.cause, self.reason = cause, reason


@dataclass(frozen=True)
class TaskSandbox:
    """What one task asks of its sandbox beyond the job's ``sandbox`` section and its environment's needs (a Harbor
    task's ``[agent] user`` and ``[environment]`` settings): the ``SandboxSpec`` fields it sets, None where it sets
    none. ``sandbox/job_spec.py`` lays them over the job's."""

    user: str | None = None
    workdir: str | None = None
    cpus: float | None = None
    memory: str | None = None  # "512m"
    workspace_size: str | None = None  # the workspace tmpfs's cap, "256m"
    home: str | None = None
    scratch: tuple[str, ...] | None = None  # capped tmpfs folders a non-root agent may write

    def overrides(self) -> dict[str, Any]:
        """The fields the task sets, by name."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskSandbox:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"task sandbox: unknown setting(s) {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        return cls(**{**d, **({"scratch": tuple(d["scratch"])} if d.get("scratch") is not None else {})})


STEP_REWARDS = ("mean", "final")  # how a multi-step task's steps make its reward (Harbor's multi_step_reward_strategy)


@dataclass
class TaskStep:
    """One step of a multi-step task (Harbor's ``[[steps]]``): the policy acts on ``instruction`` in a fresh context, in
    the sandbox the steps before left; then ``checks`` grade the step, as a task's checks grade it. Before the step
    starts, ``place`` (bash, or "") runs as the policy's own user (the files the step adds to its working directory:
    a link the policy left there leads only where it could write anyway), then ``setup`` (bash, or "") as root, with
    the graders' start-up (the step's set-up script). ``min_reward``: a step scoring below it ends the episode there
    (the steps after it do not run)."""

    name: str
    instruction: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    place: str = ""
    setup: str = ""
    min_reward: float | None = None
    agent_timeout: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> TaskStep:
        return d if isinstance(d, TaskStep) else cls(**d)


@dataclass
class Task:
    """One task instance, as plain data: what the policy is told, how the sandbox is prepared, how it is graded.

    ``setup`` is environment-specific (e.g. files to create before the episode). ``checks`` lists verifier calls as
    ``{"verifier": name, **arguments}``; verifiers run them after the episode, from outside the policy's reach.
    ``solution`` is a reference sequence of tool calls that solves the task. What generic code reads of a task is a
    field: ``image`` (the image it runs in where that is not its environment's: a Harbor task's own), ``sandbox``
    (its own sandbox settings) and ``agent_timeout`` (seconds the agent may act, where the task sets it).
    """

    id: str
    env: str
    family: str
    seed: int
    instruction: str
    setup: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    solution: list[ToolCall] = field(default_factory=list)
    split: Literal["train", "heldout"] = "train"
    # the reward at or above which the episode counts as a success (an environment's ``success_at``, for a continuous
    # reward); None: the verifiers' own verdict (every check scored 1)
    success_at: float | None = None
    image: str | None = None
    sandbox: TaskSandbox = field(default_factory=TaskSandbox)
    agent_timeout: float | None = None
    # the image a separate grader's sandbox starts from (a name the job builds, like ``image``): the task's checks get
    # a sandbox of it from ``Sandbox.grading_sandbox`` (a Harbor task's ``[verifier] environment_mode = "separate"``)
    grading_image: str | None = None
    # a multi-step task's steps, in order (``instruction`` is the first's, ``checks`` the last's, ``solution`` every
    # step's calls, each ending in submit); ``step_reward``: the episode's reward is their "mean" or the "final" one's
    steps: list[TaskStep] = field(default_factory=list)
    step_reward: str = "mean"

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        """A task from its JSON form (``dataclasses.asdict``'s). Rows written before ``image``, ``sandbox`` and
        ``agent_timeout`` were fields held them in ``setup``: they are read from there too."""
        d = dict(d)
        setup = dict(d.get("setup") or {})
        for key in ("image", "sandbox", "agent_timeout"):
            if key in setup and d.get(key) is None:
                d[key] = setup.pop(key)
        d["setup"] = setup
        d["sandbox"] = TaskSandbox.from_dict(d.get("sandbox") or {}) if not isinstance(d.get("sandbox"), TaskSandbox) \
            else d["sandbox"]
        d["steps"] = [TaskStep.from_dict(step) for step in d.get("steps") or []]
        return cls(**{**d, "solution": [ToolCall(**c) if isinstance(c, dict) else c for c in d.get("solution", [])]})


@dataclass
class Turn:
    """What happened in one policy turn. Token spans index into ``Trajectory.token_ids``: the turn generated
    ``token_ids[prompt_tokens : prompt_tokens + generated_tokens]`` and appended the next ``observation_tokens``.

    ``finish_reason``: "stop" (the policy ended its reply), "length" (``rollout.max_new_tokens``), "context" (cut at
    ``rollout.max_context``) or "timeout" (the episode's time ran out during generation; nothing was generated).
    """

    index: int
    prompt_tokens: int  # length of the sequence before this turn's generation
    generated_tokens: int
    observation_tokens: int  # tokens appended after generation (tool results, next assistant header)
    finish_reason: str  # "stop" | "length" | "context" | "timeout"
    tool_calls: list[ToolCall] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)  # calls the environment rejected, calls over the cap
    executed: int = 0  # tool calls that ran in the sandbox
    truncated_outputs: int = 0  # observations cut to rollout.max_tool_output
    version: int = -1  # policy version that generated this turn (-1: none)
    cached_tokens: int = 0  # prompt tokens the engine had cached (prefix / session cache)
    prefill_tokens: int = 0  # prompt tokens the engine had to compute
    seconds_generate: float = 0.0
    seconds_tools: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> Turn:
        return cls(**{**d, "tool_calls": [ToolCall(**c) for c in d.get("tool_calls", [])]})


@dataclass
class TokenRow:
    """One training sequence of an episode whose history was rewritten (a harness behind the recording proxy that
    summarised, dropped reasoning or edited a message): the same fields as ``Trajectory``'s tokens, with the same
    meaning. ``loss_mask`` is 1 on exactly the tokens the engine generated within this row."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    routed_experts: list | None = None


@dataclass
class Trajectory:
    """One episode, token for token.

    ``token_ids`` is exactly the sequence the engine consumed and produced. ``loss_mask[i]`` is 1 only where the policy
    generated token i; ``logprobs[i]`` is the engine's log-probability for that token (0.0 elsewhere);
    ``token_versions[i]`` is the policy version that generated it (-1 for prompt, tool-result and header tokens, and
    for tokens of an engine that holds no trainer weights yet: ``loss_mask`` says which tokens are the policy's).
    ``routed_experts`` is None unless the engine reported routing; then ``routed_experts[p]`` is the ``[layer][k]``
    expert ids computed when token p was fed to the model (None where the engine did not report it: prefix-cached
    positions, the last token). A position computed again in a later turn keeps the latest routing.

    ``finish_reason`` says how the episode ended: "submit" (a tool ended it), "text" (a reply without a tool call,
    with ``rollout.end_on_text``), "max_turns", "context" (no room left in
    ``rollout.max_context``), "timeout" (``rollout.episode_timeout``; still graded: the verifier judges the sandbox as
    it is) or "error". A failed episode (broken sandbox, engine or verifier) keeps ``failed=True`` and its reason, and
    is excluded from the gradient.

    ``earlier_rows``: where a harness behind the recording proxy rewrote its history, the sequences before each
    rewrite, oldest first; the fields above are then the last one. ``rows()`` is every one of them: each trains as its
    own sequence with the episode's one advantage, and no generated token is in two.

    ``temperature``: what the policy sampled at (``rollout.temperature`` or the environment's own; None where no
    policy sampled, a scripted episode): the trainer scores the episode's tokens at it, or the ratio is off.
    """

    task: Task
    group: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    routed_experts: list | None = None
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: Reward | None = None
    failed: bool = False
    failure: str = ""
    finish_reason: str = ""
    policy_version: int = 0  # the driver's version when the episode started; per token see token_versions
    temperature: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    earlier_rows: list[TokenRow] = field(default_factory=list)

    @property
    def response_tokens(self) -> int:
        """Tokens the policy generated in the whole episode, every row's."""
        return sum(self.loss_mask) + sum(sum(r.loss_mask) for r in self.earlier_rows)

    def rows(self) -> list[TokenRow]:
        """The episode's training sequences in the order they were generated: ``earlier_rows``, then its own."""
        return [*self.earlier_rows, TokenRow(self.token_ids, self.loss_mask, self.logprobs, self.token_versions,
                                             self.routed_experts)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        return cls(
            **{
                **d,
                "task": Task.from_dict(d["task"]),
                "messages": [Message.from_dict(m) for m in d.get("messages", [])],
                "turns": [Turn.from_dict(t) for t in d.get("turns", [])],
                "reward": Reward(**d["reward"]) if d.get("reward") else None,
                "earlier_rows": [TokenRow(**r) for r in d.get("earlier_rows", [])],
            }
        )


# --- driver <-> trainer ranks: the rows a step learns from, and what the trainer scores of them first --------------


@dataclass(frozen=True)
class TrainingRow:
    """One sequence of a trainer step, as the driver hands it to the ranks (pickled over Ray, lists as they are).

    ``token_ids`` and ``loss_mask`` (1 on the tokens the loss covers) are all an SFT row has: a verified
    demonstration or a generated copy exchange. An RL row adds the engine's ``logprobs`` (0.0 off the policy's tokens),
    per-token ``advantages``, PPO's value targets ``returns``, and, when a step takes several optimizer steps
    (mini-batches or epochs), ``old_logprobs``: the trainer's own log-probs at the step's start (``RowScores``), the
    ratio's denominator.
    ``routed_experts`` is the engine's routing as ``Trajectory.routed_experts`` holds it (None: none known).
    ``temperature``: the one its tokens were sampled at, which the trainer scores them under (None: the run's
    ``rollout.temperature``)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    returns: list[float] | None = None
    old_logprobs: list[float] | None = None
    routed_experts: list | None = None
    temperature: float | None = None


@dataclass(frozen=True)
class RowScores:
    """What the trainer ranks know of a row before its step (``TrainerRank.score``), per token: ``kl_penalty`` (kl_coef
    times the KL to the reference with ``trainer.kl_in: reward``; zeros otherwise), PPO's value estimates ``values``
    (None without a value head) and ``old_logprobs``, the policy's log-probs now. KL and log-probs are scored on the
    loss-mask tokens only (0 elsewhere): nothing reads them on the prompt or tool outputs."""

    kl_penalty: list[float]
    values: list[float] | None
    old_logprobs: list[float]


# --- sandboxes ------------------------------------------------------------------------------------------------------


@dataclass
class ExecResult:
    """What a command run in a sandbox did."""

    exit_code: int
    output: str  # stdout and stderr merged, head + tail kept within the sandbox's output cap, plus markers
    timed_out: bool
    seconds: float
    oom_killed: bool = False  # the memory limit killed a process during the command


class SandboxError(RuntimeError):
    """The sandbox is broken, dead or unreachable: the episode using it has failed."""


@dataclass(frozen=True)
class PolicyStop:
    """What stopping the policy before grading found: how many of its processes were killed, and the TCP ports they
    were listening on (a service it left running, which no check can reach once it is stopped)."""

    killed: int
    listening: tuple[int, ...] = ()


@runtime_checkable
class Sandbox(Protocol):
    """An episode's sandbox as graders and environments use it, whatever runs it.

    Paths are inside the sandbox; relative ones are under ``workdir``. ``user`` defaults to the sandbox's unprivileged
    user; graders pass ``user="root"`` and ``session=False`` so nothing the policy left in its shell plays a part.
    """

    @property
    def workdir(self) -> str:
        """The working directory: where relative paths and one-off commands start."""
        ...

    def stop_policy(self) -> PolicyStop:
        """Kill every process the policy's user left running and confirm none remains; how many there were and the
        TCP ports they listened on. ``score_task`` calls it before any check (a sandbox without it is graded as it
        is)."""
        ...

    def exec(self, command: str, timeout: float = 10.0, user: str | None = None, workdir: str | None = None,
             session: bool = True) -> ExecResult:
        """Run ``command`` with bash; killed inside the sandbox after ``timeout`` seconds (``timed_out``).
        ``session=False``: a fresh one-off shell that neither sees nor changes the policy's session."""
        ...

    def put_file(self, path: str, data: bytes, user: str | None = None, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` with ``user``'s permissions, creating parent folders; OSError if refused."""
        ...

    def get_file(self, path: str, user: str | None = None, max_bytes: int | None = None) -> bytes | None:
        """The file's bytes, or None if it does not exist; OSError if unreadable or larger than ``max_bytes``."""
        ...

    def write_file(self, path: str, content: str, user: str | None = None) -> None:
        """``put_file`` for UTF-8 text."""
        ...

    def read_file(self, path: str, user: str | None = None) -> str | None:
        """The file's text (undecodable bytes replaced), or None if it does not exist; OSError if unreadable."""
        ...

    def fresh(self) -> Sandbox:
        """A new sandbox from the same image, with the same limits and owner, and nothing of this one's state: for a
        grader that must not trust what the policy left. The caller closes it (``close()``)."""
        ...

    def grading_sandbox(self) -> Sandbox:
        """A new sandbox for a separate grader, from the task's ``grading_image``, with nothing of this one's state
        (a Harbor task's separate verifier). The caller closes it. SandboxError where the task has none."""
        ...

    def get_tree(self, path: str, exclude: tuple[str, ...] = (), max_bytes: int = 64 << 20,
                 timeout: float = 60.0) -> bytes | None:
        """A tar archive of the absolute ``path`` and all under it, read as root, links kept as links, less what
        matches ``exclude``; None if nothing is there; past ``max_bytes``, more than ``max_bytes`` of it, cut short.
        OSError if tar fails."""
        ...

    def put_tree(self, archive: bytes, timeout: float = 60.0) -> None:
        """Extract a tar ``archive`` (names relative to /) as root, replacing what is at its paths, never writing
        through an existing link."""
        ...

    def close(self) -> None:
        """Remove the sandbox. Idempotent; never raises."""
        ...
