"""A remote engine: any OpenAI-compatible ``/v1/completions`` server that takes token-id prompts and returns token ids
and logprobs (vLLM, SGLang, ``sandforge serve``), behind the embedded engine's ``generate`` so a rollout worker can use
either.

Token-in, token-out holds across the wire: the prompt goes as token ids, the completion comes back as token ids
(``choices[i].token_ids`` with ``return_token_ids``: vLLM >= 0.10.2, recent SGLang, ``sandforge serve``; or older vLLM's
``return_tokens_as_token_ids``, which spells each logprobs token as ``"token_id:123"``), never as re-tokenized text.

Weights: ``update_weights`` makes the server load a policy directory the trainer wrote, by the server's own mechanism:
``POST /update_weights_from_disk`` for ``sandforge serve`` and SGLang, ``POST /collective_rpc`` ``reload_weights`` for
vLLM (started with ``VLLM_SERVER_DEV_MODE=1``). ``sandforge serve`` reports the version of the weights behind every
token (and the routed experts, for routing replay); for the others each answer is taken to come from the last version
pushed.

Failures: a server that cannot be reached or answers 5xx is asked again ``retries`` times (with backoff); what is left
is a ``RemoteEngineError`` of one line naming the URL and the status.

Logprobs: the embedded engine reports log_softmax(logits / temperature). vLLM reports the raw model's logprobs unless
started with ``--logprobs-mode processed_logprobs``; the trainer recomputes logprobs anyway, but an importance ratio
against the engine's is only meaningful when both use the same definition.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from sandforge.types import GenerateRequest, Sample

RETRY_BACKOFF_S = 0.5  # the first retry's wait; each further one waits twice as long

# What each server needs to send token ids back, for the error a server without them gets.
TOKEN_ID_HELP = (
    "start a server that returns them: vLLM >= 0.10.2 or SGLang with `return_token_ids` (this client asks for it), "
    "an older vLLM with `return_tokens_as_token_ids` and `logprobs` (also asked for), or `sandforge serve CHECKPOINT`"
)


class RemoteEngineError(RuntimeError):
    """The server could not be reached, refused the request, or answered without what the trainer needs."""


class RemoteEngine:
    """``generate(GenerateRequest) -> list[Sample]`` like ``EngineCore``, against a server at ``base_url``.

    ``model``: the served model name; by default the first one ``GET /v1/models`` lists. ``session_ids``: send each
    request's ``session_id`` so ``sandforge serve`` reuses that episode's cache between turns; by default only when
    ``/v1/models`` says the server is sandforge (other servers give the field their own meaning: SGLang ties it to
    sessions opened through its own API).

    ``retries``: further attempts at a request the server could not answer (unreachable, 5xx). ``version``: the
    version an answer is taken to come from when the server does not say (vLLM, SGLang): the one pushed last.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 session_ids: bool | None = None, retries: int = 3):
        base_url = base_url.rstrip("/")
        self.base_url = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url  # the openai client's form
        self.model = model
        self.session_ids = session_ids
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.retries = retries
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests = 0
        self.version = -1

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        """One completion per sample (``request.n``), in the embedded engine's result format."""
        prompt = [int(t) for t in request.prompt_ids]
        n = int(request.n)
        if self.model is None or self.session_ids is None:
            await self._discover()
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(request.max_tokens),
            "temperature": float(request.temperature),
            "top_p": float(request.top_p),
            "top_k": int(request.top_k) or -1,  # off: -1 on every server (0 is refused by older vLLM)
            "n": n,
            "stop_token_ids": [int(t) for t in request.stop_ids],
            **({"seed": int(request.seed)} if request.seed is not None else {}),  # vLLM and sandforge serve honour it
            "ignore_eos": True,  # stop exactly at stop_ids, as the embedded engine does; the caller lists EOS there
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.session_ids and request.session_id:
            body["session_id"] = request.session_id
        data = await self._call("POST", "/v1/completions", body)
        self.requests += 1
        results = parse_completion(data, prompt, n, self.base_url + "/v1/completions", self.version)
        self.version = max([self.version] + [r.version for r in results])
        return results

    def close_session(self, session_id: str) -> None:
        """Nothing to do: the server keeps (and evicts) its own cache."""

    async def load_weights(self, state_dict: dict, version: int) -> int:
        raise NotImplementedError(
            f"the remote engine at {self.base_url} takes weights from disk, not as a state dict: write the policy "
            "(models.build.save_policy) and call update_weights(directory, version, api)"
        )

    async def update_weights(self, directory: str, version: int, api: str, admin_token: str | None = None) -> int:
        """Make the server serve the policy in ``directory`` (a path the server can read) as ``version``; returns the
        version it then serves. ``api``: "sandforge" or "sglang" (``POST /update_weights_from_disk``), or "vllm"
        (``POST /collective_rpc`` ``reload_weights``, then the prefix cache is reset: it holds the old weights' KV).
        ``admin_token``: sent as the request's bearer token (`sandforge serve` loads weights only for it)."""
        if api == "vllm":
            await self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                         "kwargs": {"weights_path": str(directory)}})
            await self._call("POST", "/reset_prefix_cache", allow_empty=True)
            self.version = int(version)  # vLLM keeps no version of its own
            return self.version
        body = {"model_path": str(directory), "weight_version": str(version), "flush_cache": True}
        admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
        data = await self._call("POST", "/update_weights_from_disk", body, headers=admin)
        if data.get("success") is False:
            raise RemoteEngineError(f"POST {self.base_url}/update_weights_from_disk: the server did not load "
                                    f"{directory}: {_server_message(data, '')}")
        served = data.get("weight_version")
        if served is None:  # SGLang answers without it: ask
            served = (await self._call("GET", "/get_weight_version")).get("weight_version")
        try:
            self.version = int(served)
        except (TypeError, ValueError):
            raise RemoteEngineError(f"{self.base_url} reports weight version {served!r} after loading {directory}; "
                                    "expected the integer version sent") from None
        return self.version

    def stats(self) -> dict:
        return {"version": self.version, "requests": self.requests, "base_url": self.base_url}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _discover(self) -> None:
        try:
            data = await self._call("GET", "/v1/models")
        except RemoteEngineError:
            if self.model is None:
                raise
            self.session_ids = False  # the model is known; a server without /v1/models is not sandforge
            return
        models = data.get("data") if isinstance(data, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise RemoteEngineError(f"GET {self.base_url}/v1/models listed no model; pass RemoteEngine(model=...)")
        if self.model is None:
            self.model = models[0]["id"]
        if self.session_ids is None:
            self.session_ids = models[0].get("owned_by") == "sandforge"

    async def _call(self, method: str, path: str, body: dict | None = None, allow_empty: bool = False,
                    headers: dict | None = None) -> dict:
        """One request (``headers`` over the session's), asked again ``retries`` times while the server cannot be
        reached or answers 5xx."""
        url = self.base_url + path
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._loop is not loop:  # a session belongs to one event loop
            self._http, self._loop = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers), loop
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
            tried = f" ({attempt + 1} attempts)" if attempt else ""
            try:
                async with self._http.request(method, url, json=body, headers=headers) as resp:
                    text = await resp.text()
                    status = resp.status
            except asyncio.TimeoutError:
                raise RemoteEngineError(f"{method} {url}: no answer within {self.timeout.total:g} s") from None
            except aiohttp.ClientError as e:
                error = RemoteEngineError(f"{method} {url}: cannot reach the server ({_one_line(e)}); is it "
                                          f"running?{tried}")
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = None
            if status >= 500:
                error = RemoteEngineError(f"{method} {url} -> HTTP {status}: {_server_message(data, text)}{tried}")
                continue
            if status != 200:
                raise RemoteEngineError(f"{method} {url} -> HTTP {status}: {_server_message(data, text)}")
            if allow_empty and not text.strip():
                return {}
            if not isinstance(data, dict):
                raise RemoteEngineError(f"{method} {url} answered with something other than a JSON object: "
                                        f"{text[:200]!r}")
            return data
        raise error


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _server_message(data, text: str) -> str:
    """The error text of an OpenAI-style (``{"error": {"message"}}``), vLLM/SGLang or FastAPI error body."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return " ".join(str(data[key]).split())[:500]
    return " ".join(text.split())[:500] or "(empty body)"


def _token_ids(choice: dict) -> list[int] | None:
    if isinstance(choice.get("token_ids"), list):
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t[len("token_id:"):]) for t in tokens]
    return None


def parse_completion(data: dict, prompt: list[int], n: int, url: str, version: int = -1) -> list[Sample]:
    """A ``/v1/completions`` response to one prompt -> the embedded engine's results, one per choice (by index).
    ``version``: the weights' version where the server does not report one (``sandforge serve`` does, per token)."""
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise RemoteEngineError(f"{url} returned {len(choices)} choices for n={n}")
    ext = data.get("sandforge") or {}  # sandforge serve: versions, cache use and routed experts per choice
    per_choice = ext.get("choices") if len(ext.get("choices") or ()) == n else [{}] * n
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    results = []
    for i, (choice, mine) in enumerate(zip(choices, per_choice)):
        ids = _token_ids(choice)
        if ids is None:
            raise RemoteEngineError(
                f"{url} returned no token ids for choice {i} (neither choices[].token_ids nor 'token_id:N' logprobs "
                f"tokens); the trainer needs the exact tokens, not re-tokenized text: {TOKEN_ID_HELP}"
            )
        seen = choice.get("prompt_token_ids")
        if seen is not None and list(seen) != prompt:
            raise RemoteEngineError(
                f"{url} generated from prompt token ids that differ from the ones sent ({len(seen)} vs {len(prompt)} "
                "tokens): the server changed the prompt (added special tokens?)"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise RemoteEngineError(
                f"{url} returned {'no' if logprobs is None else len(logprobs)} logprobs for {len(ids)} tokens in "
                f"choice {i}; the server must honour the `logprobs` request field"
            )
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise RemoteEngineError(f"{url} finished choice {i} with {reason!r} (expected 'stop' or 'length')")
        hit = int(mine.get("cached_tokens", cached))
        versions = mine.get("token_versions")
        results.append(Sample(
            token_ids=ids,
            logprobs=[float(lp) for lp in logprobs],
            finish_reason=reason,
            version=int(mine.get("version", ext.get("version", version))),
            token_versions=[int(v) for v in versions] if isinstance(versions, list) and len(versions) == len(ids)
            else None,
            cached_tokens=hit,
            prefill_tokens=int(mine.get("prefill_tokens", len(prompt) - hit)),
            # one [layer][k] entry per token fed (prompt[cached_tokens:] + token_ids[:-1]), as the embedded engine's
            routed_experts=mine.get("routed_experts"),
        ))
    return results
