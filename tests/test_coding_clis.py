"""Claude Code and Codex, unmodified, through the recording proxy (#58): each CLI, installed from the npm registry at
a pinned version, talks to a real ``EpisodeProxy`` (Anthropic's Messages API and OpenAI's Responses API, streamed, as
the CLIs call them) backed by a scripted policy that calls the CLI's own shell tool once, then says it is done. The CLI
runs the call (the file appears), gives the policy's turn back with its reasoning, and the two requests are recorded
as one row: what RL trains on.

The CLIs run on this machine, not in a sandbox (their harness images are not built yet): this test is about the
protocol the CLIs speak, which the sandbox path shares with every harness."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from agent_fakes import CHAT, limits

from sandforge.rollout.proxy import EpisodeProxy, ProxyBudget
from sandforge.types import Message, Sample, ToolCall

pytestmark = pytest.mark.slow

CLAUDE_CODE, CODEX = "2.1.197", "0.171.0"
CLIS = Path.home() / ".cache" / "sandforge" / "clis" / f"claude-code-{CLAUDE_CODE}-codex-{CODEX}"
BINARIES = {"claude": "node_modules/@anthropic-ai/claude-code-linux-x64/claude",  # what its postinstall would copy
            "codex": "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"}
TASK = "Create a file made_by_policy.txt containing hello."


@pytest.fixture(scope="module")
def clis() -> Path:
    """The two CLIs' native binaries (x86-64 Linux), from the npm registry (once; no install scripts run)."""
    if not all((CLIS / b).is_file() for b in BINARIES.values()):
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: the CLIs come from the npm registry")
        CLIS.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts", "--prefix", str(CLIS),
                               f"@anthropic-ai/claude-code@{CLAUDE_CODE}", f"@openai/codex@{CODEX}"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return CLIS


class ShellOncePolicy:
    """The policy: its first turn that sees ``shell`` among the declared tools calls it with ``arguments``, with a
    line of reasoning; every other turn says "done"."""

    def __init__(self, shell: str, arguments: dict):
        self.shell, self.arguments, self.called, self.requests = shell, arguments, False, 0

    async def generate(self, request) -> Sample:
        self.requests += 1
        if not self.called and f"{self.shell}(" in CHAT.tokenizer.decode(request.prompt_ids):
            self.called = True
            reply = Message(role="assistant", reasoning="I will write the file",
                            tool_calls=[ToolCall(self.shell, self.arguments)])
        else:
            reply = Message(role="assistant", content="done")
        ids = CHAT.render_assistant(reply)
        return Sample(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", version=1)

    async def close_session(self, session_id: str) -> None:
        pass


def run_cli(tmp_path: Path, policy: ShellOncePolicy, command, env: dict) -> tuple[EpisodeProxy, str]:
    """The proxy on loopback in a thread of its own (as the rollout worker serves it), the CLI in ``tmp_path/work``
    pointed at it by ``command(proxy)`` and ``env(proxy)``; the proxy and what the CLI printed."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    # the CLIs' system prompts and tool schemas run to tens of thousands of tokens (bytes, with the test's tokenizer)
    proxy = EpisodeProxy(None, "episode-token", policy, CHAT, limits(max_context=600_000, max_new_tokens=1024),
                         ProxyBudget(max_requests=8, max_tokens=50_000), "cli/1")
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    (home / ".codex").mkdir(parents=True)
    try:
        proc = subprocess.run(command(proxy), cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=180, env={"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
                                                **env(proxy)})
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return proxy, out


def test_claude_code_runs_unmodified_through_the_messages_surface(tmp_path, clis):
    policy = ShellOncePolicy("Bash", {"command": "echo hello > made_by_policy.txt"})
    proxy, out = run_cli(
        tmp_path, policy,
        lambda p: [str(clis / BINARIES["claude"]), "-p", TASK, "--dangerously-skip-permissions", "--model",
                   "claude-sonnet-4-5"],
        lambda p: {"ANTHROPIC_BASE_URL": p.url.removesuffix("/v1"), "ANTHROPIC_API_KEY": p.token,
                   "IS_SANDBOX": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    assert (tmp_path / "work" / "made_by_policy.txt").read_text() == "hello\n", out[-2000:]
    assert "done" in out and not proxy.refused and not proxy.failure
    assert len(proxy.recorder.turns) == 2 and len(proxy.recorder.rows) == 1  # its thinking given back whole


def test_codex_runs_unmodified_through_the_responses_surface(tmp_path, clis):
    policy = ShellOncePolicy("exec_command", {"cmd": "echo hello > made_by_policy.txt"})
    provider = 'model_providers.sandforge={name="sandforge", base_url="%s", env_key="OPENAI_API_KEY", ' \
               'wire_api="responses"}'
    proxy, out = run_cli(
        tmp_path, policy,
        lambda p: [str(clis / BINARIES["codex"]), "exec", "--skip-git-repo-check",
                   "--dangerously-bypass-approvals-and-sandbox", "-m", "gpt-5-codex",
                   "-c", 'model_provider="sandforge"', "-c", provider % p.url, TASK],
        lambda p: {"OPENAI_API_KEY": p.token, "CODEX_HOME": str(tmp_path / "home" / ".codex")})
    assert (tmp_path / "work" / "made_by_policy.txt").read_text() == "hello\n", out[-2000:]
    assert "done" in out and not proxy.refused and not proxy.failure
    assert len(proxy.recorder.turns) == 2 and len(proxy.recorder.rows) == 1  # its reasoning item given back whole
