"""The job schema: one YAML file, validated before any Ray actor or container starts.

Every section forbids unknown keys, so a typo fails fast with the dotted key and the file it came from. Dotted
``key=value`` overrides from the command line are applied to the raw YAML before validation and are reported the same way.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


# ZeRO stages that combine with trainer.expert_parallel > 1 (docs/trainer.md "Expert parallelism"). 0: DeepSpeed's non-ZeRO
# gradient clipping averages each rank's own norm, wrong once ranks hold different experts. 3: parameters are gathered
# and reduced by per-parameter hooks that fire only on ranks whose tokens used the expert, so ranks hang (DeepSpeed
# rejects its own MoE layers with stage 3 for that reason).
EXPERT_PARALLEL_ZERO_STAGES = (1, 2)

# trainer.reward_signal tiebreak adds partial credit to one advantage per episode from its group (grpo's, dr_grpo's or
# rloo's); the whitened per-token advantages of ppo and reinforce_pp have no group gap to keep it under
TIEBREAK_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "gspo", "cispo", "dapo")


class ConfigError(ValueError):
    """A config that cannot run. The message is one line that names the file and the dotted key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "sandforge"
    output_dir: Path = Path("runs/default")
    seed: int = 0


class RayConfig(Section):
    address: str | None = None  # None starts a local Ray; "auto" or "ray://host:port" joins a cluster
    num_cpus: int | None = None


class SandboxConfig(Section):
    base_image: str | None = None  # a local image to build env images FROM; None: Debian bookworm bootstrapped locally
    mirror: str = "http://deb.debian.org/debian"
    memory: str = "512m"  # memory+swap; the tmpfs workspace, /tmp and output spool count towards it
    cpus: float = Field(0.5, gt=0)
    pids_limit: int = Field(128, ge=16)
    network: str | None = None  # name of an `internal` Docker network to join; None: no network at all
    runtime: str | None = None  # e.g. runsc where gVisor is installed
    read_only: bool = True  # read-only root filesystem
    workspace_size: str | None = "192m"  # with tmp_size, both spools and 64m to spare: 512m (spec.py fitted_caps)
    tmp_size: str = "128m"
    nofile: int = Field(4096, ge=64)
    max_file_size: str = "256m"
    exec_timeout: float = Field(10.0, gt=0)
    warm_pool: int = Field(4, ge=0)  # started sandboxes each rollout worker keeps ready, per image
    max_live: int = Field(32, ge=1)  # containers one rollout worker may hold at once (ready + in use + starting)
    creates_per_second: float = Field(8.0, gt=0)  # per rollout worker, so the daemon is never flooded
    # a Harbor task's FROM image that is neither here nor pullable -> the local base: {"debian:bookworm*": "base",
    # "python:*": "base+python", ...}, added to environments/harbor/dockerfile.py DEFAULT_BASE_MAP (its own patterns
    # are tried first)
    base_map: dict[str, Literal["base", "base+python"]] | None = None


    @model_validator(mode="after")
    def _pool_fits(self) -> SandboxConfig:
        if self.warm_pool > self.max_live:
            raise ValueError(f"warm_pool ({self.warm_pool}) cannot exceed max_live ({self.max_live})")
        return self


DrawPhase = Literal["warmup", "rl"]  # which weight draws an environment's tasks: the warm start's or RL's


class EnvironmentConfig(Section):
    name: str = "terminal"
    families: list[str] = Field(default_factory=list)  # empty: every family the environment has
    # how often the warm start draws its tasks (and RL, where ``rl_weight`` is unset); 0: the warm start replays none of
    # them (an environment whose tasks bring no reference solution: a verifiers environment's only have a rubric)
    weight: float = Field(1.0, ge=0)
    # how often RL draws its tasks, when it differs from the warm start's ``weight``; 0: the environment is
    # warm-started and evaluated but RL trains on none of its tasks (a family at the floor gives RL groups that all
    # fail: rollouts that cost a step's time and carry no signal)
    rl_weight: float | None = Field(None, ge=0)
    # held-out tasks per family of this environment in each evaluation, when it differs from eval.tasks_per_family
    # (more where RL trains, so the paired comparison can see its gain; fewer for a family at its floor or ceiling)
    eval_tasks_per_family: int | None = Field(None, ge=0)
    # turns an episode of this environment may take, when it differs from rollout.max_turns (an env whose answers take
    # 2-3 calls beside one whose take 7: a wandering episode of the short kind would hold its step's batch to the end)
    max_turns: int | None = Field(None, ge=1)
    # the temperature RL rollouts of this environment sample at, when it differs from rollout.temperature (a family
    # whose groups all fail at 0.7 explores at 1.0 while one with long arguments keeps 0.7); the trainer scores each
    # episode at its own. Held-out evaluation samples every environment at eval.temperature.
    temperature: float | None = Field(None, ge=0)
    # None: the environment's seeded generators. Else a JSONL file (one Task per line) or, for `harbor`, a Harbor task
    # directory or a folder of them. Relative to the working directory, like run.output_dir.
    tasks: Path | None = None
    # Training tasks' checks that can give credit for a near miss (file_equals, sql, json_match) do so: a denser reward
    # for GRPO. Success, and so held-out success, still needs the exact answer.
    partial_credit: bool = False
    # Harbor tasks: root runs the agent as the task's user (root by default, Harbor's contract); hardened as a non-root
    # user given the WORKDIR, which cannot rewrite what test.sh runs (docs/harbor.md: train in hardened)
    harbor_mode: Literal["root", "hardened"] = "root"
    # how a check with several named rewards (Harbor's reward.json) makes the training reward: auto (the one named
    # "reward", else the only one, else the mean), mean, min, or a reward's name; a check's own "reward" wins
    reward_rule: str = Field("auto", min_length=1)
    # task files and folders: the fraction of tasks without a split of their own held out, by a stable hash of the name
    # (for a verifiers environment, of each task's key)
    heldout: float = Field(0.0, ge=0, le=1)
    # the reward at or above which an episode counts as a success (held-out success, success-based advantages,
    # pass@k), for an environment whose reward is continuous; null: the verifiers' own verdict (every check scored 1)
    success_at: float | None = Field(None, gt=0, le=1)
    # name: verifiers only (docs/verifiers-envs.md): the installed verifiers environment module to run, and its
    # taskset's arguments
    id: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)

    def draw_weight(self, phase: DrawPhase) -> float:
        """How often this environment's tasks are drawn: ``weight`` for the warm start (``phase`` "warmup"), RL's
        ``rl_weight`` where set (``phase`` "rl")."""
        if phase not in get_args(DrawPhase):
            raise ValueError(f"draw phase {phase!r}: one of {', '.join(get_args(DrawPhase))}")
        return self.weight if phase == "warmup" or self.rl_weight is None else self.rl_weight

    def eval_tasks(self, default: int) -> int:
        """Held-out tasks per family in an evaluation: ``eval_tasks_per_family``, else ``default`` (the eval's)."""
        return default if self.eval_tasks_per_family is None else self.eval_tasks_per_family

    @model_validator(mode="after")
    def _id_for_library_envs(self) -> EnvironmentConfig:
        from sandforge.registry import LIBRARY_ENVIRONMENTS  # noqa: PLC0415 - core, but imported where it is used

        if self.name in LIBRARY_ENVIRONMENTS:
            if not self.id:
                raise ValueError(f"the {self.name} environment needs `id`: the installed environment module to run "
                                 "(e.g. id: reverse_words)")
            if self.tasks is not None or self.families:
                raise ValueError(f"the {self.name} environment takes its tasks from `id` and `args`, not `tasks` or "
                                 "`families`")
        elif self.id is not None or self.args:
            raise ValueError(f"`id` and `args` name a verifiers environment (name: verifiers); the {self.name!r} "
                             "environment takes neither")
        return self

    @field_validator("tasks")
    @classmethod
    def _tasks_exist(cls, tasks: Path | None) -> Path | None:
        if tasks is not None and not tasks.exists():
            raise ValueError(f"no such file or directory (from {Path.cwd()}): give a JSONL task file or a Harbor "
                             "task directory")
        return tasks


# the projections of llama, qwen and mistral models: attention and MLP (LoRA on every linear layer learns the most per
# adapter parameter; the output head and embeddings stay frozen)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters (peft) on a pretrained (``arch: hf``) policy: only the adapters train and sit in the optimizer,
    only they travel to the engine (which merges them into its copy of the base), and checkpoints still save the merged
    model. Not for ``arch: k3``, which trains from scratch: a low-rank update of a random base does not teach it."""

    r: int = Field(16, ge=1)  # the adapters' rank
    alpha: float = Field(32.0, gt=0)  # the update is scaled by alpha / r
    # the linear layers to adapt, by name (a suffix of the module's path)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    # on the adapters' input, in training forwards only: above 0 the on-policy ratio is no longer exactly 1
    dropout: float = Field(0.0, ge=0, lt=1)
    # adapters in the model's last N layers only (null: all): the backward pass then stops below them, which on a CPU is
    # most of a step's cost
    top_layers: int | None = Field(None, ge=1)
    # the adapted layers merge W + s B A once per call and compute with one matmul (models/lora_fused.py; forward and
    # backward 2x peft's on a CPU in bf16); false: peft's forward, the reference
    fused: bool = True


class ModelConfig(Section):
    init_from: Path | None = None  # a directory written by save_pretrained (config.json + model.safetensors)
    tokenizer: str = "bpe"  # "bpe" (shipped, trained on task text), "bytes", or a tokenizer.json path; ignored with init_from
    arch: Literal["k3", "hf"] = "k3"  # k3: the K3-shaped model at `preset` size; hf: the pretrained model at `path`
    preset: Literal["k3-nano", "k3-mini", "k3-1b"] = "k3-nano"  # with arch k3
    k3: dict[str, Any] = Field(default_factory=dict)  # with arch k3: K3Config fields that override the preset's
    # with arch hf (set path alone: arch becomes hf): a local Hugging Face model directory, a .gguf file (converted once,
    # cached) or a catalogue name such as smollm2-135m (`sandforge models pull NAME` first; `sandforge models list`)
    path: str | None = None
    parser: str = "hermes"  # with arch hf: how its tool calls are written (hermes/qwen or kimi_k2)
    # with arch hf: template: tools and calls as the model's chat template writes them; hermes: sandforge declares the
    # tools in a system block and reads <tool_call> JSON (models/tool_declaration.py); auto: hermes when the template
    # shows no tools it is given (SmolLM2's, plain ChatML)
    tool_format: Literal["auto", "template", "hermes"] = "auto"
    chat_template: Path | None = None  # with arch hf: a .jinja file that replaces the model's own chat template
    lora: LoraConfig | None = None  # with arch hf: train LoRA adapters instead of every weight; null: full fine-tuning

    @model_validator(mode="before")
    @classmethod
    def _path_chooses_hf(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("path") is not None:
            if data.get("arch", "hf") != "hf":
                raise ValueError(f"'model.path' = {str(data['path'])!r} is a pretrained model but 'model.arch' is "
                                 f"{data['arch']!r}: drop model.arch (model.path alone chooses hf) or model.path")
            data = {**data, "arch": "hf"}
        return data

    @model_validator(mode="after")
    def _lora_needs_hf(self) -> ModelConfig:
        if self.lora is not None and self.arch != "hf":
            raise ValueError(f"'model.lora' needs a pretrained policy (model.arch hf, or model.path), not "
                             f"{self.arch!r}: a K3 model trains from scratch, where adapters on a random base do not "
                             "help; drop model.lora")
        return self

    def tokenizer_source(self) -> str:
        """A checkpoint carries its own tokenizer; a fresh model uses ``tokenizer``."""
        return str(self.init_from) if self.init_from else self.tokenizer


class RolloutConfig(Section):
    workers: int = Field(2, ge=1)  # rollout worker actors
    concurrency: int = Field(4, ge=1)  # episodes each worker runs at once
    tasks_per_step: int = Field(2, ge=1)
    group_size: int = Field(4, ge=1)  # samples per task (GRPO group)
    max_turns: int = Field(4, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    max_context: int = Field(2048, ge=64)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    episode_timeout: float | None = Field(600.0, gt=0)  # wall-clock seconds per episode (null: none); still graded
    max_tool_calls: int = Field(8, ge=1)  # tool calls run per turn; the rest get an error observation
    max_tool_output: int = Field(4096, ge=64)  # characters of each observation kept (head + tail, with a marker)
    # a reply of prose alone (no tool call, none malformed; cut off or not) ends the episode, graded as it stands
    # (finish reason "text"), as a chat agent's final message does; a malformed call still gets its error to fix.
    # false: prose gets "no tool call found" and the episode goes on
    end_on_text: bool = False


class AgentConfig(Section):
    """Who drives an episode: sandforge's own agent loop (``harness: null``), or an unmodified agent harness run
    inside the sandbox whose model calls go through the episode's recording proxy (docs/harnesses.md)."""

    harness: str | None = None  # bash-loop, mini-swe-agent, claude-code, codex, opencode or a plugin's
    options: dict[str, Any] = Field(default_factory=dict)  # given to the harness's factory
    max_requests: int = Field(30, ge=1)  # completions per episode; the next request ends it
    max_tokens: int = Field(8192, ge=1)  # generated tokens per episode, every request's

    @field_validator("harness")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None:
            from sandforge.registry import harness_names  # noqa: PLC0415 - plugins are looked up lazily

            if v not in harness_names():
                raise ValueError(f"unknown harness {v!r}; known: {', '.join(harness_names())}")
        return v


class RemoteEngineConfig(Section):
    """A separate inference server the rollout workers generate through instead of the embedded engine
    (engine/remote.py): token ids in and out over OpenAI's ``/v1/completions``. After each step the trainer
    writes the policy to ``weights_dir`` and the server loads it by its own mechanism (``api``)."""

    url: str  # the server's base URL, e.g. http://10.0.0.5:8000 (a trailing /v1 is fine)
    # sandforge: `sandforge serve`; sglang: an SGLang server (both load weights at POST /update_weights_from_disk);
    # vllm: `vllm serve` started with VLLM_SERVER_DEV_MODE=1 (POST /collective_rpc reload_weights)
    api: Literal["sandforge", "sglang", "vllm"] = "sandforge"
    model: str | None = None  # the served model name; null: the first one GET /v1/models lists
    api_key: str | None = None
    timeout: float = Field(600.0, gt=0)  # seconds one request may take
    retries: int = Field(3, ge=0)  # further attempts when the server cannot be reached or answers 5xx, with backoff
    # where the trainer writes each version's policy for the server to load: a path the server sees the same way
    # (a shared filesystem when it runs elsewhere); null: <run.output_dir>/weights. Only the newest version is kept.
    weights_dir: Path | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise ValueError("expected the server's base URL, http://HOST:PORT (e.g. the one `sandforge serve` "
                             "prints)")
        return url


class EngineConfig(Section):
    # a separate inference server instead of the embedded engine (the keys below then do not apply)
    remote: RemoteEngineConfig | None = None
    max_batch_size: int = Field(16, ge=1)  # sequences decoded together
    session_memory_mb: float = Field(1024, gt=0)  # idle episode caches kept between turns; least recently used go first
    # the dtype the engine serves in; the trainer keeps fp32 weights and sends them, cast on load (LoRA merges in fp32
    # first). bfloat16: 1.4x the rollout tokens/s of float32 with SmolLM2 on a 2-core CPU with AMX (bench/rollout.py
    # engine_dtype); the trainer recomputes every log-prob it trains on, so the sampler's rounding only moves the
    # importance ratio it reports (tis/*). auto: bfloat16 on a GPU or a CPU with AMX or AVX-512 BF16, else float32 (a
    # CPU without native bf16 emulates it, many times slower: models/device.py fast_bf16)
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    # where the engine runs (job/fleet/placement.py): auto is cuda when Ray has a GPU to give it, else cpu
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # share trainer rank 0's GPU instead of taking one of its own (verl's hybrid engine): the engine frees its episode
    # caches while the trainer steps, and weights reach it by a direct copy from the rank's GPU memory
    colocate: bool = False
    # a Hugging Face policy's KV cache. fast: each new token written into room kept after the cached ones
    # (models/hf_kv_cache.py), rows compacted by slicing where they end in their tokens; reference: transformers' own
    # DynamicLayer, which copies the whole cache every token, and compaction by gather (bench/rl_step.py's baseline)
    kv_cache: Literal["fast", "reference"] = "fast"
    # how the engine runs the policy. auto: on a CPU, the fused decode path where it covers the policy (Llama, Mistral
    # without a sliding window, Qwen2, Qwen3: engine/llama.py; its attention, small linear layers and sampling are C
    # kernels built on first use, engine/native.py), else the policy's own forward; fused: that path or an error;
    # model: the policy's own forward always (the reference, and what kv_cache applies to)
    decoder: Literal["auto", "fused", "model"] = "auto"
    # how a sampled token is drawn from its probabilities. cdf: one uniform per row against the cumulative sum
    # (models/sampling.py draw); multinomial: torch.multinomial, one exponential per vocabulary entry (the reference,
    # 100x the time for a 49k vocabulary on a CPU). The same distribution; seeded draws differ between the two
    sampler: Literal["cdf", "multinomial"] = "cdf"
    # CPU threads of the engine's torch ops; 0: one per core. On a CPU shared with sandboxes, rollout workers and the
    # trainer, fewer threads than cores can be faster: an op's threads wait for its slowest, one descheduled thread
    # stalls them all
    threads: int = Field(0, ge=0)


class PretrainConfig(Section):
    """Synthetic pretraining (job/pretraining_data.py): generated one-call exchanges over the job's tools teach a policy
    built from scratch to copy names, phrases and values into tool calls, as a pretrained base model would. Runs
    before the warm start; 0 steps for a policy loaded from ``model.init_from``."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    listed: float = Field(0.0, ge=0, le=1)  # share of exchanges whose prompt first lists the environment's tools


class WarmupConfig(Section):
    """Supervised warm start on verified reference-solution episodes, so RL starts from a policy that calls tools."""

    steps: int = Field(0, ge=0)
    episodes: int = Field(16, ge=0)  # reference-solution episodes replayed (0: none, with ``data``)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(3e-3, gt=0)
    # chat conversations to learn from beside the reference episodes (job/sft_data.py): JSONL with ``messages`` (and
    # optionally ``tools``), as TRL's and prime-rl's SFT take them, or a Hugging Face dataset saved with save_to_disk;
    # rendered with the policy's own template, trained on the assistant tokens only
    data: Path | None = None
    # generated copy exchanges (as in pretrain) mixed into each step: reference episodes drawn from small word pools
    # otherwise teach a small policy to recite the pools' words instead of copying the task's
    copy_rows: int = Field(0, ge=0)


class EvalConfig(Section):
    """Held-out evaluation: the same fixed held-out tasks (seeds 0..tasks_per_family-1 of every family, split
    "heldout") before RL (after the SFT warm start), every ``every`` RL steps, and at the end; ``samples`` episodes per
    task give success (pass@1) and pass@k with k = samples. Results: ``eval`` rows in metrics.jsonl and eval.json."""

    tasks_per_family: int = Field(0, ge=0)  # 0: no evaluation
    samples: int = Field(4, ge=1)
    every: int = Field(0, ge=0)  # RL steps between evaluations; 0: only before and after
    # the sampled episodes' temperature; null: rollout.temperature. Rollouts may explore at 1.0 while the held-out
    # number is read at 0.7; greedy episodes stay at 0
    temperature: float | None = Field(None, ge=0)
    greedy: bool = False  # each evaluation also decodes greedily (one episode per task): what the policy's mode solves
    base: bool = False  # also evaluate the policy as loaded, before pretraining or the warm start ("base" in eval.json)
    # held-out tasks per family of every environment for that base evaluation; null: as the others. A pretrained model
    # that cannot call the tools yet scores 0 on any number of tasks, and its episodes run to their limits
    base_tasks_per_family: int | None = Field(None, ge=1)
    base_samples: int | None = Field(None, ge=1)  # its sampled episodes per task; null: ``samples``


class TrainerConfig(Section):
    steps: int = Field(10, ge=0)  # RL steps
    # trainer/algorithms/registry.py; null values below take the algorithm's default (docs/algorithms.md)
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "gspo", "cispo",
                       "dapo"] = "grpo"
    # what advantages are computed from (docs/algorithms.md "Reward signal"): reward, the verifier's value with partial
    # credit; success, 1 or 0; tiebreak, success, with partial credit only ordering episodes of equal success in a
    # group, scaled by tiebreak_weight and never divided by the group's std
    reward_signal: Literal["reward", "success", "tiebreak"] = "reward"
    # tiebreak: at most half dr_grpo's gap between a success and a failure, so partial credit stays a tie-break
    tiebreak_weight: float = Field(0.1, ge=0, le=0.5)
    # success and tiebreak: an RL episode the policy did not end itself (cut at its turn limit, its context or its
    # timeout) trains as a failure whatever its verifier said (held-out evaluation still grades it as it stands): a
    # success that idled to the limit would reinforce its idle turns (docs/algorithms.md "Reward signal")
    unended_fails: bool = False
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] | None = None
    lr: float = Field(1e-4, gt=0)
    # over the RL run's optimizer steps (trainer.steps x trainer.mini_batches); the warm start keeps warmup.lr
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)  # optimizer steps of linear ramp-up before the schedule
    weight_decay: float = Field(0.0, ge=0)
    # RL starts from a fresh AdamW: the moments and step counts pretraining and the warm start left are zeroed when RL
    # begins (false: RL goes on with them; SFT's momentum then carries on moving the policy, and its second moment
    # shrinks RL's steps)
    fresh_optimizer: bool = True
    grad_clip: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)  # symmetric PPO clip; clip_eps_low / clip_eps_high override either side
    clip_eps_low: float | None = Field(None, gt=0)
    clip_eps_high: float | None = Field(None, gt=0)
    kl_coef: float = Field(0.0, ge=0)  # KL(policy || frozen reference), the reference being the policy RL starts from
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    # with kl_coef 0, still run the reference forward to log ``kl``; false skips it (a third of a CPU RL step)
    log_kl: bool = True
    tis_cap: float | None = Field(2.0, gt=0)  # truncated importance sampling, engine vs trainer log-probs; null: off
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus
    value_coef: float = Field(0.5, ge=0)  # ppo: weight of the value head's loss
    gamma: float = Field(1.0, ge=0, le=1)  # ppo and reinforce_pp: discount over policy tokens
    gae_lambda: float = Field(0.95, ge=0, le=1)  # ppo
    dynamic_sampling: bool | None = None  # drop groups with nothing to learn from and sample more tasks (dapo)
    # a group is informative when its episodes' success differs (success), or their reward values (reward: partial
    # credit then keeps groups where nobody succeeded)
    dynamic_sampling_on: Literal["success", "reward"] = "success"
    dynamic_sampling_max_rounds: int = Field(3, ge=1)  # sampling rounds per step at most, the first one included
    overlong_buffer: int | None = Field(None, ge=0)  # soft overlong penalty over the budget's last N tokens (0: off)
    overlong_penalty: float = Field(1.0, ge=0)  # the penalty at the budget: -overlong_penalty
    world_size: int = Field(1, ge=1)
    # where the ranks run (job/fleet/placement.py): auto is cuda when Ray has GPUs for them (one each), else cpu
    device: Literal["auto", "cpu", "cuda"] = "auto"
    zero_stage: Literal[0, 1, 2, 3] = 2  # 3: parameters partitioned too (not with expert_parallel nor model.lora)
    # bf16 weights and activations, fp32 master weights; null: on with CUDA or a CPU with AMX or AVX-512 BF16
    # (models/device.py)
    bf16: bool | None = None
    grad_accum_steps: int = Field(2, ge=1)
    # which tokens a forward computes logits at. policy_tokens: only where a loss-mask token is predicted (the lm_head
    # and the fp32 log-softmax over the vocabulary shrink to the policy's own tokens); all_tokens: every token, the
    # reference (the same log-probs and gradients: tests/test_token_scores.py)
    scoring: Literal["policy_tokens", "all_tokens"] = "policy_tokens"
    # the KL reference's forward of a LoRA policy with adapters on its top layers. shared_trunk: it resumes from the
    # hidden states the policy's own forward had below the first adapted layer (the same frozen layers, the same
    # tokens: trainer/shared_trunk.py); full: every layer again, the reference (tests/test_shared_trunk.py)
    reference_forward: Literal["shared_trunk", "full"] = "shared_trunk"
    # K3 policies: a micro-batch's sequences share forward rows instead of padding to the longest (models/packing.py);
    # Hugging Face policies always pad
    pack_sequences: bool = True
    # optimizer steps per RL step: the batch is split in this many mini-batches, each one step against the log-probs the
    # trainer had before the first (PPO-style; with 1 the ratio is 1 and the clip never acts)
    mini_batches: int = Field(1, ge=1)
    # PPO epochs: passes over each RL step's batch, each reshuffled and split in mini_batches, all against the log-probs
    # the trainer had before the first; epochs x mini_batches optimizer steps per RL step
    epochs: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)  # ranks the routed experts are split over (docs/trainer.md "Expert parallelism")
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    # trainer -> engine weights: the Ray object store; a broadcast over a process group of their own (NCCL on GPU,
    # Gloo on CPU); or, with engine.colocate, a direct copy out of rank 0's memory (no serialisation). auto: colocated
    # when the engine shares rank 0's GPU, collective with a GPU, object store without
    weight_sync: Literal["auto", "object_store", "collective", "colocated"] = "auto"
    routing_replay: bool = False  # R3: the training forward uses the experts the engine routed each token to
    # sync: each step rolls out, then trains; async: rollouts go on while the trainer steps (docs/trainer.md "Async mode")
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)  # async: an episode may start only if consumed within this many versions

    @field_validator("reward_signal")
    @classmethod
    def _tiebreak_has_a_group_gap(cls, signal: str, info: ValidationInfo) -> str:
        algorithm = info.data.get("algorithm", "grpo")
        if signal == "tiebreak" and algorithm not in TIEBREAK_ALGORITHMS:
            raise ValueError(f"tiebreak needs one advantage per episode from its group "
                             f"({', '.join(TIEBREAK_ALGORITHMS)}), not trainer.algorithm {algorithm}: use "
                             "reward_signal success or one of those algorithms")
        return signal

    @model_validator(mode="after")
    def _unended_fails_on_success(self) -> "TrainerConfig":
        if self.unended_fails and self.reward_signal == "reward":
            raise ValueError("unended_fails turns an unended episode's success into a failure, and reward_signal "
                             "reward trains on the verifier's value, not its success: use reward_signal success or "
                             "tiebreak")
        return self

    @field_validator("expert_parallel")
    @classmethod
    def _expert_parallel_fits(cls, ep: int, info: ValidationInfo) -> int:
        world, stage = info.data.get("world_size", 1), info.data.get("zero_stage", 2)
        if ep > 1 and world % ep:
            raise ValueError(f"{ep} must divide trainer.world_size ({world}): each group of {ep} ranks holds every "
                             "expert once")
        if ep > 1 and stage == 3:
            raise ValueError("needs trainer.zero_stage 1 or 2 (got 3): ZeRO-3 gathers an expert only on the ranks "
                             "whose tokens chose it, so ranks that hold different experts wait on each other")
        if ep > 1 and stage not in EXPERT_PARALLEL_ZERO_STAGES:
            raise ValueError(f"needs trainer.zero_stage 1 or 2 (got {stage}): without ZeRO, DeepSpeed clips gradients "
                             "by the mean of the ranks' norms, which is not the model's norm when ranks hold "
                             "different experts")
        return ep


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "sandforge"
    entity: str | None = None
    tags: list[str] = Field(default_factory=list)


class LoggingConfig(Section):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    sample_trajectories: int = Field(4, ge=0)  # per step, into wandb's table


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    environments: list[EnvironmentConfig] = Field(default_factory=lambda: [EnvironmentConfig()], min_length=1)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


def apply_override(raw: dict, assignment: str) -> None:
    """Set ``a.b.c=value`` in the raw config; the value is parsed as YAML (``2``, ``true``, ``[a, b]``, ``null``). In a
    list (``environments``) a part picks an item by its position (``environments.0.weight=2``) or by its ``name``
    (``environments.browser.eval_tasks_per_family=1``)."""
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {assignment!r}: expected KEY=VALUE with a dotted key, e.g. trainer.steps=2")
    node = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            child = _list_item(node, part, key, ".".join(parts[:i]))
        else:
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    if isinstance(node, list):
        raise ConfigError(f"override {key}: {'.'.join(parts[:-1])} is a list; name an item of it, by position or "
                          f"name, e.g. {'.'.join(parts[:-1])}.0.{parts[-1]}")
    node[parts[-1]] = yaml.safe_load(value) if value.strip() else None


def _list_item(items: list, part: str, key: str, where: str) -> Any:
    """The item of a config list an override's ``part`` names: a position, or the one item whose ``name`` it is."""
    if part.isdigit():
        if int(part) < len(items):
            return items[int(part)]
        raise ConfigError(f"override {key}: {where} has {len(items)} item(s); there is no item {part}")
    named = [item for item in items if isinstance(item, dict) and item.get("name") == part]
    if len(named) == 1:
        return named[0]
    names = [str(item.get("name")) for item in items if isinstance(item, dict)]
    why = "several items are" if named else "no item is"
    raise ConfigError(f"override {key}: {why} named {part!r} in {where} (its items: {', '.join(names) or 'none'}); "
                      "name one, or give its position")


def _dotted(loc: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")


def _section_keys(loc: tuple) -> list[str]:
    model: Any = JobConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):  # list[Section], Section | None: the section
            ann = next((a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        model = ann
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _describe(err: dict, source: str) -> str:
    key = _dotted(err["loc"])
    if err["type"] == "extra_forbidden":
        leaf = str(err["loc"][-1])
        close = difflib.get_close_matches(leaf, _section_keys(err["loc"]), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{source}: unknown key '{key}'{hint}"
    got = err.get("input")
    got_text = f", got {got!r}" if not isinstance(got, dict) else ""
    return f"{source}: invalid value for '{key}': {err['msg']}{got_text}"


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read, override and validate a job. Raises ConfigError with one readable line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run:, trainer:, ...)")
    return config_from_raw(raw, f"{path}", overrides)


def config_from_raw(raw: dict, source: str, overrides: list[str] | None = None) -> JobConfig:
    """``raw`` (a job's YAML as read, from ``source``) with ``overrides`` applied, validated. Raises ConfigError with
    one readable line naming the key and ``source``."""
    for assignment in overrides or []:
        apply_override(raw, assignment)
    source = source + (" (with command-line overrides)" if overrides else "")
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        first = _describe(errors[0], source)
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(first + more) from None
    from sandforge.config_checks import combination_problems, path_problems

    for problem in [*path_problems(cfg, source), *combination_problems(cfg, source)]:
        raise ConfigError(problem)
    return cfg


def dump_config(cfg: JobConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
