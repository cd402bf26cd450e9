"""Agent harnesses that run unmodified inside the sandbox, their model calls going through the recording proxy.

A harness is plain data (``Harness``): the files it needs copied into the sandbox, and the bash command that starts
it with the task's instruction. The command runs as the policy's user in the task's working directory, with

- ``OPENAI_BASE_URL`` (``http://127.0.0.1:PORT/v1``, the sandbox's own loopback, relayed to the proxy's socket) and
  ``OPENAI_API_KEY`` (the episode's token), the variables OpenAI clients read (chat completions or Responses);
  ``ANTHROPIC_BASE_URL`` (``http://127.0.0.1:PORT``) and ``ANTHROPIC_API_KEY`` (the same token), Anthropic's;
  ``SANDFORGE_PROXY_SOCKET`` for a client that speaks HTTP over a Unix socket itself;
- ``SANDFORGE_INSTRUCTION``: a file holding the task's instruction; ``SANDFORGE_HARNESS_DIR``: where its files are.

Harnesses are found by name (sandforge/registry.py): the built-ins below, then plugins under the
``sandforge.harnesses`` entry-point group, each a callable ``(options: dict) -> Harness`` (``agent.options`` in the
job YAML).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from sandforge.sandbox.spec import PROXY_MOUNT  # noqa: F401 - in the sandbox: the proxy socket's folder
from sandforge.registry import harness_factory

HARNESS_DIR = "/tmp/.sandforge-harness"  # in the sandbox: root's and sticky; sandforge's files in it read-only to the policy
SOCKET_NAME = "proxy.sock"
PROXY_PORT = 8391  # the forwarder's port on the sandbox's own loopback


@dataclass(frozen=True)
class Harness:
    """``files``: path under HARNESS_DIR -> content. ``command``: bash, run as described in the module docstring.
    ``needs``: what the sandbox's image must have (``python3`` for the forwarder), checked before the episode.
    ``image``: what the harness installs, as a Dockerfile built FROM each image the job's tasks run in (build arg
    BASE), its pip requirements downloaded on the host into a wheelhouse first (the build reaches no index)."""

    name: str
    command: str
    files: dict[str, bytes] = field(default_factory=dict)
    needs: tuple[str, ...] = ("python3",)
    image: str | None = None  # a folder under rollout/harness_images: a layer built on every image the job uses
    # the tokens its first request takes before the task (system prompt, tool declarations), as SmolLM2's tokenizer
    # counts them: a job whose rollout.max_context is below it is refused at start (job/preflight.py)
    prompt_tokens: int = 0

    def image_folder(self) -> Path | None:
        """The build context of the harness's image layer (Dockerfile, requirements.txt), or None."""
        if self.image is None:
            return None
        return Path(str(resources.files("sandforge.rollout").joinpath("harness_images", self.image)))


def _file(name: str) -> bytes:
    return resources.files("sandforge.rollout").joinpath("harness_files", name).read_bytes()


def _options(name: str, options: dict[str, Any], known: set[str]) -> None:
    """ValueError naming the options ``name`` does not take."""
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"agent.options: {name} takes {', '.join(sorted(known))}, got {unknown}")


def bash_loop(options: dict[str, Any]) -> Harness:
    """The minimal harness written here (rollout/harness_files/bash_loop.py): one ``bash`` tool and ``submit``."""
    _options("bash-loop", options, {"max_steps"})
    steps = int(options.get("max_steps", 30))
    return Harness(name="bash-loop", files={"bash_loop.py": _file("bash_loop.py")},
                   command=f'python3 "$SANDFORGE_HARNESS_DIR/bash_loop.py" "$SANDFORGE_INSTRUCTION" --max-steps {steps}')


MINI_SWE_AGENT = "/opt/sandforge-harness/mini-swe-agent"  # its venv in the image (harness_images/mini-swe-agent)
MINI_ENV = {  # offline and unattended: no set-up prompt, no cost-map download, no cost lookup of an unknown model
    "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
}


def mini_swe_agent(options: dict[str, Any]) -> Harness:
    """mini-swe-agent 2.4.6 (PyPI), unmodified: its default agent (no confirmation prompts) with its own mini.yaml
    config, tool calling, and litellm pointed at the proxy. It finishes by running
    ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; its trajectory file is left in the harness folder."""
    _options("mini-swe-agent", options, {"step_limit", "command_timeout"})
    env = " ".join(f"{k}={v}" for k, v in MINI_ENV.items())
    command = (f'{env} MSWEA_GLOBAL_CONFIG_DIR="$SANDFORGE_HARNESS_DIR/mswea" OPENAI_API_BASE="$OPENAI_BASE_URL" '
               f'{MINI_SWE_AGENT}/bin/mini --agent-class default -m openai/sandforge-policy '
               f'-t "$(cat "$SANDFORGE_INSTRUCTION")" -c mini.yaml '
               f'-c agent.step_limit={int(options.get("step_limit", 30))} '
               f'-c environment.timeout={int(options.get("command_timeout", 60))} -l 0 '
               f'-o "$SANDFORGE_HARNESS_DIR/trajectory.json" </dev/null')
    return Harness(name="mini-swe-agent", command=command, image="mini-swe-agent")


CLAUDE_CODE = "/opt/sandforge-harness/claude-code/claude"  # its native binary in the image (harness_images/claude-code)
QUIET = "DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1"


def claude_code(options: dict[str, Any]) -> Harness:
    """Claude Code 2.1.197 (npm), unmodified, in print mode: the task's instruction as its prompt, every tool allowed
    without asking (``IS_SANDBOX=1`` lets it do so as root too), its Anthropic client pointed at the proxy by
    ``ANTHROPIC_BASE_URL``. ``model``: the name it asks for (any is answered by the policy); ``max_turns``: its own
    limit of agentic turns."""
    _options("claude-code", options, {"model", "max_turns"})
    model = shlex.quote(str(options.get("model", "claude-sonnet-4-5")))
    command = (f'HOME="$SANDFORGE_HARNESS_DIR/home" IS_SANDBOX=1 {QUIET} {CLAUDE_CODE} '
               f'-p "$(cat "$SANDFORGE_INSTRUCTION")" --dangerously-skip-permissions --model {model} '
               f'--max-turns {int(options.get("max_turns", 30))} </dev/null')
    # 2026-12-07, Claude Code 2.1.197's first request: 117 KB of JSON, 82 KB of it its tools
    return Harness(name="claude-code", command=command, image="claude-code", prompt_tokens=29_450)


CODEX = "/opt/sandforge-harness/codex/codex"  # its native binary in the image (harness_images/codex)
# -c's value in bash's double quotes, so that the proxy's URL is the sandbox's $OPENAI_BASE_URL
CODEX_PROVIDER = (r'"model_providers.sandforge={name=\"sandforge\", base_url=\"$OPENAI_BASE_URL\", '
                  r'env_key=\"OPENAI_API_KEY\", wire_api=\"responses\"}"')


def codex(options: dict[str, Any]) -> Harness:
    """Codex 0.171.0 (npm), unmodified: ``codex exec`` on the task's instruction, no approvals and no sandbox of its
    own (the episode's sandbox is the boundary), a model provider of its own pointing its Responses client at the
    proxy (Codex does not read ``OPENAI_BASE_URL``). ``model``: the name it asks for (any is answered by the
    policy)."""
    _options("codex", options, {"model"})
    model = shlex.quote(str(options.get("model", "gpt-5-codex")))
    command = (f'mkdir -p "$SANDFORGE_HARNESS_DIR/codex" && HOME="$SANDFORGE_HARNESS_DIR/home" '
               f'CODEX_HOME="$SANDFORGE_HARNESS_DIR/codex" {CODEX} exec --skip-git-repo-check '
               f'--dangerously-bypass-approvals-and-sandbox -m {model} -c \'model_provider="sandforge"\' '
               f'-c {CODEX_PROVIDER} "$(cat "$SANDFORGE_INSTRUCTION")" </dev/null')
    # 2026-12-07, Codex 0.171.0's first request: 41 KB of JSON
    return Harness(name="codex", command=command, image="codex", prompt_tokens=10_400)


OPENCODE = "/opt/sandforge-harness/opencode/opencode"  # its native binary in the image (harness_images/opencode)


def opencode(options: dict[str, Any]) -> Harness:
    """OpenCode 1.18.33 (npm), unmodified: ``opencode run`` on the task's instruction, with a config of its own
    (harness_files/opencode.json: an OpenAI-compatible provider whose base URL and key are the sandbox's
    ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, no auto-update, no sharing) and no fetch of its model catalogue."""
    _options("opencode", options, set())
    command = ('HOME="$SANDFORGE_HARNESS_DIR/home" OPENCODE_CONFIG="$SANDFORGE_HARNESS_DIR/opencode.json" '
               f'OPENCODE_DISABLE_MODELS_FETCH=1 {OPENCODE} run -m sandforge/policy "$(cat "$SANDFORGE_INSTRUCTION")" '
               '</dev/null')
    # 2026-12-07, OpenCode 1.18.33's first request with tools: 31 KB of JSON (its title request is smaller)
    return Harness(name="opencode", command=command, files={"opencode.json": _file("opencode.json")},
                   image="opencode", prompt_tokens=7_732)


def runtime_files() -> dict[str, bytes]:
    """What every harness gets beside its own files: the start script and the loopback forwarder."""
    return {"start.sh": _file("start.sh"), "forward.py": _file("forward.py")}


def find_harness(name: str, options: dict[str, Any] | None = None) -> Harness:
    """The harness ``name`` made with ``options``; ValueError if there is none or its options are wrong."""
    try:
        make = harness_factory(name)
    except KeyError as e:
        raise ValueError(str(e).strip("'\"")) from None
    harness = make(dict(options or {}))
    if not isinstance(harness, Harness):
        raise ValueError(f"harness {name!r} made a {type(harness).__name__}, not a sandforge Harness")
    return harness
