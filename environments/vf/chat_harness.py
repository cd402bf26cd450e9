"""verifiers' own chat program, run in the rollout worker's event loop instead of a process per episode (#54).

verifiers' ``null`` harness runs each episode's chat loop as a ``uv run`` script in its subprocess runtime: a Python
process per episode that imports openai, httpx and their kin (about 0.9 CPU-s) to send a handful of chat
completions. verifiers' ``Harness.launch`` contract allows a harness to run its loop in-process instead, as long as
every model call goes through the episode's interception endpoint and secret. ``InProcessChatHarness`` does that
with the same program: ``CHAT_PROGRAM_SOURCE`` (the library's bundled chat loop) is executed once into a module of
its own, and each episode runs its ``main()`` with the argv verifiers' own ``launch_chat_program`` builds, so the
loop, its retries, its handling of replies and of context overflow are verifiers' code, not a copy. Nothing the
policy writes runs either way: the program is tool-less (sandforge refuses tasks that declare tool servers), and its
model calls reach sandforge's recording proxy through verifiers' interception server as before.

The subprocess harness (``null``) stays the reference: tests/test_vf_envs.py runs the same episodes under both and
compares the recorded rows and rewards; ``bench/vf_episodes.py`` times them.

verifiers finds a harness by importing the module its id names, so ``register()`` makes this module importable as
``ID`` (a flat name: verifiers looks a dotted id up under its own package first and fails).
"""

from __future__ import annotations

import contextvars
import sys
import tempfile
import traceback
import types
from functools import cache
from pathlib import Path
from typing import Any

from sandforge.environments.vf.library import vf

ID = "sandforge_vf_chat"  # the harness id verifiers' config names
_PROGRAM = "<sandforge: verifiers' chat program, in-process>"  # the argv[0] that stands for it
_ARGV: contextvars.ContextVar[list[str]] = contextvars.ContextVar("sandforge_vf_chat_argv")
_CLIENTS: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("sandforge_vf_chat_clients")


def register() -> str:
    """Make this harness importable under ``ID`` (verifiers imports a harness by its id); returns ``ID``."""
    sys.modules.setdefault(ID, sys.modules[__name__])
    return ID


@cache
def program() -> types.ModuleType:
    """verifiers' bundled chat program as a module of its own (its ``__main__`` entry stays inert), with two seams:
    ``parse_args`` reads this episode's argv instead of ``sys.argv``, and every OpenAI client it opens is kept so
    that it can be closed when the episode's loop ends (a process would have closed them by exiting)."""
    vf()
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    module = types.ModuleType("sandforge_vf_chat_program")
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), module.__dict__)
    parse_args, open_client = module.parse_args, module.AsyncOpenAI

    def episode_args():
        saved = sys.argv  # parse_args runs before main()'s first await: no other episode runs in between
        sys.argv = ["chat", *_ARGV.get()]
        try:
            return parse_args()
        finally:
            sys.argv = saved

    def tracked_client(*args: Any, **kwargs: Any) -> Any:
        client = open_client(*args, **kwargs)
        _CLIENTS.get().append(client)
        return client

    module.parse_args, module.AsyncOpenAI = episode_args, tracked_client
    return module


async def run_program(argv: list[str]) -> Any:
    """Run the chat program's ``main()`` with ``argv`` (its options) here; a ``ProgramResult`` as its process would
    have returned: exit 0 when the loop ends, the code of a ``SystemExit`` (97: the model's endpoint failed), 1 with
    the traceback for any other error."""
    vf()  # the library loaded as itself
    from verifiers.v1.runtimes import ProgramResult

    module = program()
    argv_token, clients_token = _ARGV.set(list(argv)), _CLIENTS.set([])
    clients = _CLIENTS.get()
    try:
        await module.main()
        return ProgramResult(exit_code=0, stdout="", stderr="")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return ProgramResult(exit_code=code, stdout="", stderr=traceback.format_exc()[-4000:])
    except Exception:
        return ProgramResult(exit_code=1, stdout="", stderr=traceback.format_exc()[-4000:])
    finally:
        for client in clients:
            await client.close()
        _ARGV.reset(argv_token)
        _CLIENTS.reset(clients_token)


class _InProcessRuntime:
    """What the null harness's launch sees as its runtime: the program it prepares is ``run_program`` here, and the
    one file it writes (a conversation too long for argv) goes to a folder of this episode's own."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._files = tempfile.TemporaryDirectory(prefix="sandforge-vf-chat-")

    async def prepare_uv_script(self, source: str, env: dict[str, str], activate: bool = True) -> list[str]:
        return [_PROGRAM]

    async def write(self, path: str, data: bytes) -> None:
        target = Path(self._files.name, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def run_program(self, argv: list[str], env: dict[str, str]) -> Any:
        if argv[:1] != [_PROGRAM]:  # only the chat program is run here; anything else is the real runtime's
            return await self.runtime.run_program(argv, env)
        option = "--initial-messages-file="
        args = [option + str(Path(self._files.name, a[len(option):])) if a.startswith(option) else a
                for a in argv[1:]]
        try:
            return await run_program(args)
        finally:
            self._files.cleanup()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


def _harness_class() -> type:
    vf()
    from verifiers.v1.harnesses.null import NullHarness

    class InProcessChatHarness(NullHarness):
        """verifiers' null harness with its chat program run in this process (see the module's docstring)."""

        async def setup(self, runtime: Any) -> None:
            """Nothing to provision: no ``uv`` script environment is prepared for a program that is not launched."""

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            return await super().launch(ctx, trace, _InProcessRuntime(runtime), endpoint, secret, mcp_urls, data,
                                        tool_interception_url)

    return InProcessChatHarness


def __getattr__(name: str) -> Any:  # verifiers reads the class through ``__all__`` once the library is loaded
    if name == "InProcessChatHarness":
        cls = _harness_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["InProcessChatHarness"]
