"""One episode driven by an unmodified agent harness inside the sandbox, its model calls recorded by the proxy.

The sandbox is reset as for the agent loop, then the episode's proxy starts on the socket in the sandbox's proxy
folder (the only one mounted into it), the harness's files go in, and its command runs as the policy's user. The
episode ends when the harness exits, when a budget of the proxy is spent, or at ``rollout.episode_timeout``: the
policy's processes are stopped and the verifiers grade the sandbox as it stands. The trajectory's rows are the
proxy's (rollout/rows.py): exactly the tokens the engine produced, split where the harness rewrote its history.
Like ``run_episode``, this never raises: a harness that crashes or hangs scores what it left; a broken sandbox, engine
or verifier fails this episode only.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import time
import uuid
from typing import Any, Callable

from sandforge.rollout.episode import EpisodeLimits, ended, fail, fill_rows, release
from sandforge.rollout.harnesses import HARNESS_DIR, PROXY_MOUNT, PROXY_PORT, SOCKET_NAME, Harness, runtime_files
from sandforge.rollout.policy_client import Policy, PolicyError
from sandforge.rollout.proxy import EpisodeProxy, ProxyBudget
from sandforge.rollout.tool_calls import ToolHang
from sandforge.types import Reward, SandboxError, Task, Trajectory
from sandforge.verifiers.checks import score_task

FORWARDER_DOWN = 97  # start.sh's exit status when the loopback forwarder never listened
STOP_GRACE = 30.0  # seconds the harness's exec may take to return once its processes are stopped


def harness_command(harness: Harness, token: str, workdir: str) -> str:
    """The bash line that starts ``harness`` through start.sh with the variables the module docstring of
    rollout/harnesses.py lists."""
    env = {
        "OPENAI_BASE_URL": f"http://127.0.0.1:{PROXY_PORT}/v1", "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PROXY_PORT}", "ANTHROPIC_API_KEY": token,
        "SANDFORGE_PROXY_SOCKET": f"{PROXY_MOUNT}/{SOCKET_NAME}", "SANDFORGE_PROXY_PORT": str(PROXY_PORT),
        "SANDFORGE_HARNESS_DIR": HARNESS_DIR, "SANDFORGE_INSTRUCTION": f"{HARNESS_DIR}/instruction.md",
        "SANDFORGE_WORKDIR": workdir, "SANDFORGE_HARNESS_COMMAND": harness.command,
    }
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"env {exports} bash {HARNESS_DIR}/start.sh"


def _install(sandbox, harness: Harness, instruction: str) -> None:
    """The harness's files into HARNESS_DIR. The folder is root's and sticky (1777): the harness may add files there
    (its logs, a trajectory), but sandforge's runtime files (start.sh, the forwarder) and the instruction are root's
    and read-only to the policy, so nothing it writes changes how the episode starts or what start.sh reports. The
    harness's own files stay the policy's user's: they run as it anyway."""
    made = sandbox.exec(f"install -d -m 1777 -o root -g root {HARNESS_DIR}", timeout=10, user="root", session=False)
    if made.exit_code != 0:
        raise SandboxError(f"cannot make {HARNESS_DIR} in the sandbox: {made.output.strip()[-200:]}")
    own = {**runtime_files(), "instruction.md": instruction.encode()}
    for path, data in own.items():
        sandbox.put_file(f"{HARNESS_DIR}/{path}", data, user="root", mode=0o755 if path.endswith(".sh") else 0o644)
    for path, data in harness.files.items():
        sandbox.put_file(f"{HARNESS_DIR}/{path}", data, mode=0o755 if path.endswith(".sh") else 0o644)
    for need in harness.needs:
        found = sandbox.exec(f"command -v {shlex.quote(need)}", timeout=10, session=False)
        if found.exit_code != 0:
            raise SandboxError(f"harness {harness.name} needs {need} in the sandbox's image, which has none: add it "
                               "to the environment's image")


async def run_harness_episode(task: Task, env, policy: Policy, chat, limits: EpisodeLimits, harness: Harness,
                              budget: ProxyBudget, group: str, version: int = 0, session_id: str | None = None,
                              score: Callable[[Any, Task], Reward] = score_task,
                              seed: int | None = None) -> Trajectory:
    """Run ``task`` in ``env`` (a ToolEnv, not yet reset) with ``harness`` driving and ``policy`` behind the proxy;
    always returns a Trajectory, never raises."""
    traj = Trajectory(task=task, group=group, policy_version=version)
    session = session_id or f"{group}/{uuid.uuid4().hex[:12]}"
    traj.metadata |= {"session": session, "harness": harness.name}
    start = time.monotonic()
    proxy: EpisodeProxy | None = None
    try:
        if task.steps:
            raise SandboxError(f"task {task.id} has {len(task.steps)} steps; a harness episode runs one instruction "
                               "(multi-step tasks run with sandforge's own agent loop: no agent.harness)")
        observation, info = await env.areset()
        sandbox = env.sandbox
        traj.metadata["sandbox"] = info.get("sandbox", "") if isinstance(info, dict) else ""
        folder = getattr(sandbox, "proxy_dir", None)
        if not folder:
            raise SandboxError("the sandbox has no proxy folder (its spec needs proxy=True): a harness cannot reach "
                               "the policy")
        proxy = EpisodeProxy(os.path.join(folder, SOCKET_NAME), secrets.token_urlsafe(24), policy, chat, limits,
                             budget, session, version, seed)
        await proxy.start()
        await asyncio.to_thread(_install, sandbox, harness, observation)
        traj.metadata["seconds_reset"] = time.monotonic() - start
        traj.finish_reason = await _drive(sandbox, harness, proxy, limits, traj)
        proxy.end()  # before grading: nothing the policy left running is answered, nothing more is recorded
        await proxy.close()
        if proxy.failure:
            raise PolicyError(proxy.failure)
        if not proxy.recorder.turns:  # nothing to train on, and nothing the policy chose: the harness's fault
            exit_code = traj.metadata.get("harness_exit_code")
            raise SandboxError(f"the harness {harness.name} made no request to the policy (exit code {exit_code}): "
                               f"{traj.metadata.get('harness_output', '')[-300:]}")
        fill_rows(traj, proxy)
        traj.reward = await asyncio.to_thread(score, sandbox, task)
    except Exception as e:  # one episode fails, never the run (a bug's traceback is kept)
        fail(traj, e)
    finally:
        await release(proxy, policy, session)
        await env.aclose()
    return ended(traj, start)


async def _drive(sandbox, harness: Harness, proxy: EpisodeProxy, limits: EpisodeLimits, traj: Trajectory) -> str:
    """Run the harness until it exits, the proxy ends the episode or time runs out; the episode's finish reason."""
    timeout = limits.episode_timeout
    command = harness_command(harness, proxy.token, sandbox.workdir)
    run = asyncio.ensure_future(asyncio.to_thread(sandbox.exec, command, timeout=(timeout or 86400) + STOP_GRACE,
                                                  session=False))
    over = asyncio.ensure_future(proxy.over.wait())
    done, _ = await asyncio.wait({run, over}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    over.cancel()
    if run in done:  # the harness ended: on its own, or on the 400 of a budget the proxy had just spent
        result = run.result()
        reason = proxy.ended or "submit"
    else:
        reason = proxy.ended or "timeout"
        await asyncio.to_thread(sandbox.stop_policy)  # the harness and everything it started
        try:
            result = await asyncio.wait_for(run, STOP_GRACE)
        except asyncio.TimeoutError as e:
            raise ToolHang(f"the harness's exec did not return {STOP_GRACE:.0f} s after its processes were stopped") \
                from e
    if result.exit_code == FORWARDER_DOWN and not proxy.recorder.turns:
        # no request reached the proxy, so the policy never acted: the forwarder's fault, a host-side fact. Once the
        # policy has made a request the forwarder demonstrably worked, and any exit status is graded as it stands
        raise SandboxError("the proxy's loopback forwarder did not start in the sandbox: "
                           f"{result.output[-300:]}")
    traj.metadata["harness_exit_code"] = result.exit_code
    traj.metadata["harness_output"] = result.output[-2000:]
    if proxy.refused:
        traj.metadata["proxy_refused"] = proxy.refused[-10:]
    return "error" if reason == "engine" else reason


