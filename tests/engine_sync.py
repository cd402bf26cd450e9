"""A weight push into an ``EngineActor`` over the collective channel, as job/fleet/weight_sync.py makes it: the engine
receives in a thread of its own while ``send(port)`` sends from this one; returns the version the engine then serves."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from sandforge.job.fleet.lifecycle import free_port


def push_over_channel(engine, send: Callable[[int], object]) -> int:
    port, served = free_port(), []

    async def receive():
        try:
            return await engine.receive_weights()
        finally:
            await engine.core.shutdown()

    def engine_side():
        engine.open_weight_channel("127.0.0.1", port)
        served.append(asyncio.run(receive()))

    thread = threading.Thread(target=engine_side)
    thread.start()
    send(port)
    thread.join(60)
    return served[0]
