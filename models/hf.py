"""Any local Hugging Face causal LM as a sandforge policy: the model, its tokenizer and its own chat template.

``HFPolicy`` answers ``forward`` like the built-in model (``HFOutput``, shaped like ``K3Output``: fp32 logits, a cache
with ``select``, the router aux loss), so ``generate`` and ``token_logprobs`` work unchanged.

``HFChatFormat`` has ``ChatFormat``'s methods. It renders the first prompt with the model's chat template and
afterwards only token deltas, so the sequence is never re-rendered (DESIGN.md, token-in, token-out). A delta is the
suffix of [fixed prefix + tool messages] over [fixed prefix]; when the template would not extend the prefix tokens
exactly, ``TemplateDeltaError`` says so rather than silently training on tokens the model never saw. Tool calls are
read by a parser from ``PARSERS``: "hermes" (Qwen-style ``<tool_call>`` JSON) or "kimi_k2".

No hub access: everything loads with ``local_files_only=True``.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from sandforge.types import Message, ToolCall


# ---------------------------------------------------------------- model
@dataclass
class HFPolicyConfig:
    """What sandforge reads from a policy's config; the model's own config stays at ``HFPolicy.hf_config``."""

    vocab_size: int
    max_seq_len: int | None


@dataclass
class HFCache:
    """HF ``past_key_values`` plus the attention mask of every cached position ([B, S]), like ``KVCache``."""

    past: Any
    mask: Tensor

    @property
    def seq_len(self) -> int:
        return self.mask.shape[1]

    def select(self, rows: Tensor) -> HFCache:
        """The cache of batch rows ``rows`` only. The original is left intact (layers are copied shallowly, and HF
        caches replace their tensors rather than write into them)."""
        past = copy.copy(self.past)
        if hasattr(past, "layers"):  # transformers >= 4.54: a list of cache layers
            past.layers = [copy.copy(layer) for layer in past.layers]
        elif hasattr(past, "key_cache"):  # older DynamicCache: parallel lists of tensors
            past.key_cache, past.value_cache = list(past.key_cache), list(past.value_cache)
        elif isinstance(past, tuple):  # legacy tuple of (k, v) per layer
            return HFCache(tuple(tuple(t[rows] for t in kv) for kv in past), self.mask[rows])
        past.batch_select_indices(rows)
        return HFCache(past, self.mask[rows])

    def _kv(self) -> list[tuple[Tensor, Tensor]]:
        """(keys, values) per layer, each [B, heads, S, head_dim]."""
        past = self.past
        if hasattr(past, "layers"):
            return [(layer.keys, layer.values) for layer in past.layers]
        if hasattr(past, "key_cache"):
            return list(zip(past.key_cache, past.value_cache))
        return [(k, v) for k, v in past]

    def _with_kv(self, kv: list[tuple[Tensor, Tensor]], mask: Tensor) -> HFCache:
        """A new cache object of the same kind holding ``kv``; this one is left intact."""
        past = copy.copy(self.past)
        if hasattr(past, "layers"):
            past.layers = [copy.copy(layer) for layer in past.layers]
            for layer, (k, v) in zip(past.layers, kv):
                layer.keys, layer.values = k, v
        elif hasattr(past, "key_cache"):
            past.key_cache, past.value_cache = [k for k, _ in kv], [v for _, v in kv]
        else:
            past = tuple((k, v) for k, v in kv)
        return HFCache(past, mask)

    @classmethod
    def cat(cls, caches: list[HFCache]) -> HFCache:
        """One batch from the rows of several caches: each left-padded (mask 0) to the longest. Positions come from the
        mask's cumsum, so padding shifts no row's positions."""
        width = max(c.seq_len for c in caches)
        pad = [width - c.seq_len for c in caches]
        left_pad = torch.nn.functional.pad
        layers = zip(*(c._kv() for c in caches))
        kv = [
            tuple(torch.cat([left_pad(t, (0, 0, p, 0)) for t, p in zip(ts, pad)]) for ts in zip(*layer))
            for layer in layers
        ]
        mask = torch.cat([left_pad(c.mask, (p, 0)) for c, p in zip(caches, pad)])
        return caches[0]._with_kv(kv, mask)

    def compact(self) -> HFCache:
        """Each row's cached tokens moved to the right end, in order, and all-padding columns dropped. Keys carry
        their rotary positions already and new positions count real tokens, so attention is unchanged."""
        order = torch.argsort((self.mask != 0).to(torch.int8), dim=1, stable=True)  # pads first
        keep = int((self.mask != 0).sum(1).max()) if self.mask.numel() else 0
        order = order[:, order.shape[1] - keep :]

        def take(t: Tensor) -> Tensor:  # [B, heads, S, d] -> [B, heads, keep, d]
            return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))

        return self._with_kv([(take(k), take(v)) for k, v in self._kv()], self.mask.gather(1, order))

    @property
    def nbytes(self) -> int:
        return self.mask.nbytes + sum(k.nbytes + v.nbytes for k, v in self._kv())


@dataclass
class HFOutput:
    logits: Tensor  # [B, T, V] float32
    cache: HFCache | None
    aux_loss: Tensor  # the model's router auxiliary loss (scaled by its own coefficient), or 0
    router_ids: Tensor | None  # HF models do not report routing
    hidden: Tensor | None = None  # [B, T, D] the last layer's (normed) hidden state, with return_hidden


class HFPolicy(nn.Module):
    """A local ``AutoModelForCausalLM`` behind the built-in policy's ``forward``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.hf_config = model.config
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(text.vocab_size)
        self.config = HFPolicyConfig(self.vocab_size, getattr(text, "max_position_embeddings", None))
        self._moe = hasattr(text, "router_aux_loss_coef") and hasattr(text, "output_router_logits")
        self.aux_loss_coef = float(getattr(text, "router_aux_loss_coef", 0.0))

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFPolicy:
        from transformers import AutoModelForCausalLM

        import transformers

        old = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 56)  # renamed torch_dtype -> dtype
        if "dtype" not in kwargs and "torch_dtype" not in kwargs:
            kwargs["torch_dtype" if old else "dtype"] = torch.float32
        return cls(AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs))

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(str(path))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: HFCache | None = None,
        use_cache: bool = False,
        return_hidden: bool = False,
    ) -> HFOutput:
        """input_ids [B, T] (left padding allowed) -> HFOutput(logits [B, T, V] fp32, cache, aux_loss, None).

        Positions count real tokens only (cumsum of the mask), so a left-padded row sees the positions it would see
        alone and batched decoding equals unbatched. ``aux_loss`` is the router balance loss times
        ``router_aux_loss_coef`` on a full forward of an MoE config, else 0.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.long()
        if cache is not None:
            mask = torch.cat([cache.mask.to(mask.device), mask], dim=1)
        if position_ids is None:
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        want_aux = self._moe and cache is None and not use_cache
        extra = {"output_router_logits": True} if want_aux else {}
        if return_hidden:
            extra["output_hidden_states"] = True
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache.past if cache is not None else None,
            use_cache=use_cache,
            **extra,
        )
        aux = getattr(out, "aux_loss", None)
        if want_aux and aux is not None:
            aux = self.aux_loss_coef * aux.float()
        else:
            aux = torch.zeros((), device=out.logits.device)
        new_cache = HFCache(out.past_key_values, mask) if use_cache else None
        hidden = out.hidden_states[-1].float() if return_hidden else None
        return HFOutput(logits=out.logits.float(), cache=new_cache, aux_loss=aux, router_ids=None, hidden=hidden)


# ---------------------------------------------------------------- tool-call parsers
Parser = Callable[[str], tuple[Message, list[str]]]

_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>", re.DOTALL)


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest). Templates may open ``<think>`` in the prompt, so a bare ``</think>`` also closes it."""
    m = _THINK.match(text)
    if m is None:
        if text.lstrip().startswith("<think>"):
            return text.lstrip()[len("<think>") :].strip(), ""  # never closed: all of it was reasoning
        return "", text
    return m.group(1).strip(), text[m.end() :]


def _call_from_json(body: str, where: str, name: str | None = None) -> tuple[ToolCall | None, str]:
    """A ToolCall from ``{"name":..,"arguments":{..}}`` (or from bare arguments when ``name`` is given)."""
    try:
        obj = json.loads(body)
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, RecursionError, huge ints
        snippet = body if len(body) <= 80 else body[:77] + "..."
        return None, f"{where}: invalid JSON ({e}) in {snippet!r}"
    if name is None:
        if not isinstance(obj, dict):
            got = type(obj).__name__
            return None, f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {got}'
        name, obj = obj.get("name"), obj.get("arguments", {})
        if isinstance(obj, str):  # some models double-encode the arguments
            try:
                obj = json.loads(obj)
            except Exception:  # noqa: BLE001
                pass
    if not isinstance(name, str) or not name:
        return None, f'{where}: the tool name must be a non-empty string, got {json.dumps(name)[:40]}'
    if not isinstance(obj, dict):
        return None, f"{where} ({name}): arguments must be a JSON object, got {type(obj).__name__}"
    return ToolCall(name=name, arguments=obj), ""


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[Message, list[str]]:
    """Qwen / Hermes: ``<think>..</think>``, then content and ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
    blocks."""
    reasoning, rest = _split_reasoning(text)
    errors: list[str] = []
    calls: list[ToolCall] = []
    for n, m in enumerate(_HERMES_CALL.finditer(rest), start=1):
        if not m.group(2):
            errors.append(f"tool call {n}: <tool_call> was not closed with </tool_call>; it was not run")
            continue
        call, err = _call_from_json(m.group(1).strip(), f"tool call {n}")
        if err:
            errors.append(err + '; write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')
        else:
            call.id = f"call_{len(calls)}"
            calls.append(call)
    content = _HERMES_CALL.sub("", rest).strip()
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls), errors


_K2_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)(<\|tool_calls_section_end\|>|$)", re.DOTALL)
_K2_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)(<\|tool_call_end\|>|$)", re.DOTALL
)
_K2_ID = re.compile(r"^(?:functions\.)?([^\s:]+)(?::(\d+))?$")
_K2_FORMAT = (
    "write <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}"
    "<|tool_call_end|><|tool_calls_section_end|>"
)


def parse_kimi_k2(text: str) -> tuple[Message, list[str]]:
    """Kimi K2: tool calls in a ``<|tool_calls_section_begin|>`` section, ids ``functions.NAME:IDX``, JSON arguments."""
    reasoning, rest = _split_reasoning(text)
    errors: list[str] = []
    calls: list[ToolCall] = []
    n = 0
    for section in _K2_SECTION.finditer(rest):
        if not section.group(2):
            errors.append("the tool-call section was not closed with <|tool_calls_section_end|>")
        found = list(_K2_CALL.finditer(section.group(1)))
        if not found:
            errors.append(f"a tool-call section held no complete call; {_K2_FORMAT}")
        for m in found:
            n += 1
            where = f"tool call {n}"
            if not m.group(3):
                errors.append(f"{where}: not closed with <|tool_call_end|>; it was not run")
                continue
            ident = _K2_ID.match(m.group(1))
            if ident is None:
                errors.append(f"{where}: bad call id {m.group(1)[:40]!r}; {_K2_FORMAT}")
                continue
            call, err = _call_from_json(m.group(2).strip(), where, name=ident.group(1))
            if err:
                errors.append(f"{err}; {_K2_FORMAT}")
            else:
                call.id = m.group(1)
                calls.append(call)
    content = _K2_SECTION.sub("", rest).strip()
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls), errors


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "qwen": parse_hermes, "kimi_k2": parse_kimi_k2}


# ---------------------------------------------------------------- chat format
class TemplateDeltaError(ValueError):
    """The chat template would not extend the token sequence exactly (it re-renders history, or tokens merge across
    the boundary), so appending a rendered delta would train on tokens that differ from a full render."""


# A fixed conversation the deltas are cut from: an assistant turn with reasoning and a call, as in an episode.
_BASE_USER = {"role": "user", "content": "Begin."}
_BASE_ASSISTANT = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "Plan.",
    "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "noop", "arguments": {}}}],
}


def _tool_schema(tool: dict) -> dict:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _message_dict(m: Message) -> dict:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id or f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(m.tool_calls)
            ]
    if m.role == "tool":
        d["name"] = m.name
        d["tool_call_id"] = m.tool_call_id or m.name  # templates that print it (Kimi K2) need one even for errors
    return d


class HFChatFormat:
    """``ChatFormat``'s methods for a Hugging Face tokenizer and its chat template.

    ``stop_ids`` are the template's end-of-turn token (the last special token of a rendered assistant turn) and the
    tokenizer's eos. ``template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, parser: str = "hermes", **template_kwargs: Any) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; choose one of {sorted(PARSERS)}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; add one to the checkpoint's tokenizer_config.json")
        self.tokenizer = tokenizer
        self.parser = PARSERS[parser]
        self.template_kwargs = template_kwargs
        self._special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        turn = self._assistant_turn(_BASE_ASSISTANT)
        ends = [i for i in turn if i in self._special]
        if not ends:
            raise ValueError("the chat template ends assistant turns with no special token; cannot tell where to stop")
        self.end_of_turn = ends[-1]
        eos = tokenizer.eos_token_id
        self.stop_ids: list[int] = list(dict.fromkeys([self.end_of_turn] + ([eos] if eos is not None else [])))

    def _render(self, messages: list[dict], tools: list[dict] | None = None, gen: bool = False) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen, tokenize=True, **self.template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _extension(self, prefix: list[int], full: list[int], what: str) -> list[int]:
        if full[: len(prefix)] != prefix:
            k = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            got = self.tokenizer.decode(full[k : k + 8])
            want = self.tokenizer.decode(prefix[k : k + 8])
            raise TemplateDeltaError(
                f"the chat template does not extend the sequence exactly when {what}: token {k} renders as {got!r} "
                f"instead of {want!r}. Appended tokens would differ from what the model sees on a full render; use a "
                "template that never rewrites earlier turns (e.g. keeps reasoning) and ends turns with a special token"
            )
        return full[len(prefix) :]

    def _cut(self, ids: list[int]) -> int:
        """Length up to and including the last end-of-turn token: what the policy itself generated ends there."""
        ends = [k for k, i in enumerate(ids) if i == self.end_of_turn]
        return ends[-1] + 1 if ends else len(ids)

    def _assistant_turn(self, assistant: dict) -> list[int]:
        header = self._render([_BASE_USER], gen=True)
        turn = self._extension(header, self._render([_BASE_USER, assistant]), "an assistant message is added")
        ends = [k for k, i in enumerate(turn) if i in self._special]
        return turn[: ends[-1] + 1] if ends else turn

    # ---------------------------------------------------------------- rendering
    def render_prompt(self, tools: list[dict], messages: list[Message]) -> list[int]:
        """Prompt tokens from the model's template, ending with the assistant header."""
        for m in messages:
            if m.role not in ("system", "user"):
                raise ValueError(
                    f"render_prompt takes system and user messages, got role {m.role!r}; append assistant turns with "
                    "render_assistant and tool results with render_observations instead of re-rendering history"
                )
        return self._render([_message_dict(m) for m in messages], [_tool_schema(t) for t in tools], gen=True)

    def render_assistant(self, msg: Message) -> list[int]:
        """The tokens the policy generates for ``msg`` (for SFT data), ending with the end-of-turn token."""
        return self._assistant_turn(_message_dict(msg))

    def render_observations(self, results: list[Message], closed: bool) -> list[int]:
        """Only the tokens appended after a generation: tool results, then the next assistant header.

        ``closed`` says whether the generation ended with the end-of-turn token; a truncated one is closed here.
        Raises ``TemplateDeltaError`` when the template would not extend the sequence exactly.
        """
        prefix = self._render([_BASE_USER, _BASE_ASSISTANT])
        tools = [_message_dict(Message(role="tool", content=r.content, name=r.name, tool_call_id=r.tool_call_id))
                 for r in results]
        full = self._render([_BASE_USER, _BASE_ASSISTANT, *tools], gen=True)
        cut = self._cut(prefix)
        delta = self._extension(prefix[:cut], full, "tool results follow an assistant turn")
        return delta if closed else [self.end_of_turn, *delta]

    # ---------------------------------------------------------------- parsing
    def parse_assistant(self, token_ids: list[int]) -> tuple[Message, list[str]]:
        """The assistant message in ``token_ids`` and one readable error per problem. Never raises."""
        try:
            ids = [int(i) for i in token_ids]
            errors: list[str] = []
            stops = [k for k, i in enumerate(ids) if i in self.stop_ids]
            if stops:
                if stops[0] < len(ids) - 1:
                    errors.append(f"{len(ids) - stops[0] - 1} tokens after the end of the turn were ignored")
                ids = ids[: stops[0]]
            else:
                errors.append("the reply was cut off before the end of the turn (length limit); write shorter replies")
            msg, parse_errors = self.parser(self.tokenizer.decode(ids, skip_special_tokens=False))
            return msg, errors + parse_errors
        except Exception as e:  # noqa: BLE001 - the parser must never crash a run
            return Message(role="assistant"), [f"the reply could not be parsed ({type(e).__name__}: {e})"]


def load_hf_policy(path: str, parser: str = "hermes", **model_kwargs: Any) -> tuple[HFPolicy, HFChatFormat]:
    """The model and chat format saved in the local directory ``path`` (no hub access)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return HFPolicy.from_pretrained(path, **model_kwargs), HFChatFormat(tokenizer, parser=parser)
