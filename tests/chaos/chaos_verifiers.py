"""Verifiers that break, for the chaos suite: imported into every Ray worker of the in-process job
(``worker_process_setup_hook``), so rollout workers grade with them as they would with a plugin's verifier."""

from __future__ import annotations

import time

from sandforge.verifiers.checks import VERIFIERS, register


def register_all() -> None:
    if "chaos_raise" in VERIFIERS:
        return

    @register("chaos_raise")
    def _raise(sandbox, args):
        raise RuntimeError("the verifier's own bug")

    @register("chaos_hang")
    def _hang(sandbox, args):
        time.sleep(600)
        return 1.0, "never"
