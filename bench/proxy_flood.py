"""One sandbox floods the recording proxy: how much does another episode's latency move?

    python bench/proxy_flood.py [--seconds 8] [--max-context 32768] [--model smollm2-135m | bpe] [--flooders 2]

The rollout worker serves every episode's proxy on one event loop. Here a victim episode sends small honest chat
requests in a loop while ``--flooders`` other episodes on the same loop send the largest bodies their context lets
through, shaped to cost the most to read and render: as many tiny messages as the body's caps allow. A flooding
episode whose budget or context ends it is replaced by a fresh one, as a new episode of the same sandbox would be.
The engine answers at once, so what is timed is the proxy. Measured in the same run: the victim's latencies with no
flood (the baseline) and under the flood; prints their medians and worst cases and one JSON line (the last line)
with ``worst_added_s`` (the flood's worst latency less the baseline's) and the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.proxy import EpisodeProxy, ProxyBudget, max_body
from sandforge.types import GenerateRequest, Message, Sample

TOKEN = "bench-token"


class AnsweringEngine:
    """Answers every request at once with a short reply."""

    def __init__(self, chat):
        self.ids = chat.render_assistant(Message("assistant", "done"))

    async def generate(self, request: GenerateRequest) -> Sample:
        return Sample(token_ids=list(self.ids), logprobs=[-0.1] * len(self.ids), finish_reason="stop", version=0)

    async def close_session(self, session_id: str) -> None:
        pass


def load_chat(model: str):
    if model == "bpe":
        from sandforge.models.bpe import load_tokenizer
        from sandforge.models.chat import ChatFormat

        return ChatFormat(load_tokenizer("bpe"))
    from transformers import AutoTokenizer

    from sandforge.models.hf_chat import HFChatFormat
    from sandforge.models.sources import local_model_dir

    return HFChatFormat(AutoTokenizer.from_pretrained(str(local_model_dir(model)), local_files_only=True))


def flood_body(max_context: int) -> bytes:
    """The costliest body the proxy reads and renders at ``max_context``: as many tiny messages as its size cap
    (``max_body``) and its cap on JSON objects and arrays (one per token of the context) let through."""
    one = {"role": "user", "content": "x"}
    n = min((max_body(max_context) - 64) // (len(json.dumps(one)) + 2), max_context - 2)
    return json.dumps({"model": "m", "messages": [one] * n}).encode()


class Loop:
    """The rollout worker's shape: one event loop in a thread, serving every episode's proxy."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def proxy(self, folder: Path, name: str, chat, max_context: int, requests: int = 40) -> EpisodeProxy:
        limits = EpisodeLimits(max_turns=requests, max_context=max_context, max_new_tokens=64, stop_ids=chat.stop_ids)
        proxy = EpisodeProxy(str(folder / f"{name}.sock"), TOKEN, AnsweringEngine(chat), chat, limits,
                             ProxyBudget(max_requests=requests, max_tokens=10**9), name)
        self.run(proxy.start())
        return proxy


def victim_latencies(socket: str, seconds: float) -> list[float]:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=120)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        r = http.post("http://proxy/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        out.append(time.monotonic() - t0)
        time.sleep(0.02)
    return out


def flood(loop: Loop, folder: Path, chat, max_context: int, index: int, stop: threading.Event, sent: list) -> None:
    body = flood_body(max_context)
    proxy, n = None, 0
    while not stop.is_set():
        if proxy is None or proxy.ended is not None:
            if proxy is not None:
                loop.run(proxy.close())
            n += 1
            proxy = loop.proxy(folder, f"flood{index}-{n}", chat, max_context)
            http = httpx.Client(transport=httpx.HTTPTransport(uds=proxy.socket_path), timeout=300)
        http.post("http://proxy/v1/chat/completions", content=body,
                  headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        sent.append(len(body))
    loop.run(proxy.close())


def summary(name: str, latencies: list[float]) -> dict:
    row = {"requests": len(latencies), "median_s": statistics.median(latencies), "worst_s": max(latencies)}
    print(f"{name:>9}: {row['requests']} requests, median {row['median_s'] * 1000:.1f} ms, "
          f"worst {row['worst_s'] * 1000:.1f} ms", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--model", default="smollm2-135m", help="a pulled catalogue model's tokenizer, or bpe")
    parser.add_argument("--flooders", type=int, default=2)
    args = parser.parse_args()
    chat = load_chat(args.model)
    loop = Loop()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        victim = loop.proxy(folder, "victim", chat, args.max_context, requests=10**9)  # its budget is not timed
        print(f"flood body: {len(flood_body(args.max_context)) / 2**20:.2f} MiB (max_body at max_context "
              f"{args.max_context}); {args.flooders} flooding episode(s)", flush=True)
        base = summary("baseline", victim_latencies(victim.socket_path, args.seconds))
        stop, sent = threading.Event(), []
        threads = [threading.Thread(target=flood, args=(loop, folder, chat, args.max_context, i, stop, sent))
                   for i in range(args.flooders)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        flooded = summary("flooded", victim_latencies(victim.socket_path, args.seconds))
        stop.set()
        for t in threads:
            t.join(600)
        loop.run(victim.close())
    print(f"flood: {len(sent)} bodies, {sum(sent) / 2**20:.0f} MiB", flush=True)
    print(json.dumps({"bench": "proxy_flood", "max_context": args.max_context, "model": args.model,
                      "baseline": base, "flooded": flooded,
                      "worst_added_s": round(flooded["worst_s"] - base["worst_s"], 4),
                      "cpu": platform.processor() or cpu_model()}))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
