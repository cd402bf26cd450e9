"""models/hf_kv_cache.py: a Hugging Face cache that appends in place decodes exactly as transformers' own (DynamicLayer,
which copies the whole cache per token), copies only once per ROOM tokens, and never lets two caches that share a
buffer write into each other."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from sandforge.engine.batch import DecodeBatch, Prefill, prefill
from sandforge.models import hf_kv_cache as kv_room
from sandforge.models.hf import HFCache, HFPolicy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    m = HFPolicy(transformers.AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():  # sharpen: a fresh model predicts nearly one token everywhere
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(8)
    return m


def decode(model, prompts, steps, in_place):
    """Prefill ``prompts`` one by one, merge them in a decode batch (left padding), then greedy-decode ``steps``
    tokens; a row leaves half-way and the rest go on, as the engine's batch does. Logits of every step."""
    model.fast_cache = in_place
    items = [Prefill(None, p) for p in prompts]
    out = []
    with torch.no_grad():
        prefill(model, items, CPU)
        batch = DecodeBatch()
        for i, it in enumerate(items):
            batch.add([i], it.out_cache.select([it.out_row]).compact())
        tokens = [int(it.logits.argmax()) for it in items]
        for s in range(steps):
            if s == steps // 2:
                batch.remove([0])
                tokens = tokens[1:]
            logits, _ = batch.step(model, tokens, CPU)
            out.append(logits.clone())
            tokens = logits.argmax(-1).tolist()
    model.fast_cache = True
    return out


def test_in_place_decode_equals_transformers_own_cache_and_copies_once_per_room(model, monkeypatch):
    prompts = [list(range(3, 3 + n)) for n in (20, 9, 33)]
    steps = 2 * kv_room.ROOM + 10  # the room runs out twice, and the batch changes rows once
    reference = decode(model, prompts, steps, in_place=False)
    copies = []
    real = kv_room._with_room
    monkeypatch.setattr(kv_room, "_with_room", lambda *a: copies.append(a[2]) or real(*a))
    got = decode(model, prompts, steps, in_place=True)
    assert len({tuple(x.argmax(-1).tolist()) for x in reference}) > 3, "the model is too flat to mean anything"
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    layers = model.hf_config.num_hidden_layers
    # per layer: the prefill's, the first step's, one per ROOM steps, the batch change's; never one per step
    assert 0 < len(copies) <= layers * (4 + steps // kv_room.ROOM), len(copies)
    assert len(copies) < layers * steps / 8


def test_two_caches_sharing_a_buffer_never_write_into_each_other(model):
    prompt = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        a = model(prompt, use_cache=True).cache
        a = model(torch.tensor([[7]]), cache=a, use_cache=True).cache  # a's keys are now views into its room
        b = HFCache(copy.copy(a.past), a.mask)  # a shallow copy: the same room, the same views
        b.past.layers = [copy.copy(layer) for layer in a.past.layers]
        assert b._kv()[0][0].data_ptr() == a._kv()[0][0].data_ptr() and b.past.layers[0].room is a.past.layers[0].room
        b1 = model(torch.tensor([[11]]), cache=b, use_cache=True)  # b takes the room first...
        a1 = model(torch.tensor([[13]]), cache=a, use_cache=True)  # ...so a must copy, not overwrite b's token
        b2 = model(torch.tensor([[17]]), cache=b1.cache, use_cache=True).logits[:, -1]
        a2 = model(torch.tensor([[19]]), cache=a1.cache, use_cache=True).logits[:, -1]
        full = lambda *t: model(torch.cat([prompt, torch.tensor([list(t)])], 1)).logits[:, -1]  # noqa: E731
        torch.testing.assert_close(b2, full(7, 11, 17), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a2, full(7, 13, 19), atol=1e-5, rtol=1e-5)


def test_select_cat_and_compact_keep_working_on_views(model):
    """The engine's row operations take the views as they are; a cache built from their result decodes right."""
    prompts = [torch.tensor([list(range(4, 4 + n))]) for n in (12, 17)]
    with torch.no_grad():
        caches = []
        for p in prompts:
            c = model(p, use_cache=True).cache
            caches.append(model(torch.tensor([[9]]), cache=c, use_cache=True).cache)
        merged = HFCache.cat(caches).compact()
        second = merged.select(torch.tensor([1]))  # before merged is fed: a forward extends the cache it is given
        logits = model(torch.tensor([[21], [22]]), cache=merged, use_cache=True).logits[:, -1]
        again = model(torch.tensor([[23]]), cache=second, use_cache=True).logits[:, -1]
        full = [model(torch.cat([p, torch.tensor([[9, t]])], 1)).logits[:, -1] for p, t in zip(prompts, (21, 22))]
    torch.testing.assert_close(logits, torch.cat(full), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, model(torch.cat([prompts[1], torch.tensor([[9, 23]])], 1)).logits[:, -1],
                               atol=1e-5, rtol=1e-5)


def test_compact_of_right_aligned_rows_equals_the_gather(model):
    """compact's slice (rows that end in their tokens) against compact_by_gather, the reference for any layout; a
    cache whose rows do not end in their tokens (a continuation's left-padded prefill) still takes the gather."""
    prompts = [list(range(3, 3 + n)) for n in (6, 14, 9)]
    items = [Prefill(None, p) for p in prompts]
    with torch.no_grad():
        prefill(model, items, CPU)  # one left-padded forward: rows end in their tokens
        cache = items[0].out_cache
        ids = torch.tensor([[0, 0, 41, 41], [0, 42, 42, 42], [43, 43, 43, 43]])
        mask = (torch.arange(4) >= torch.tensor([[2], [1], [0]])).long()  # left-padded new tokens after each row's
        raw = model(ids, attention_mask=mask, cache=HFCache.cat([cache.select([i]) for i in range(3)]),
                    use_cache=True).cache  # cached tokens: padding, tokens, padding, tokens
        assert not torch.equal(raw.compact().mask, raw.mask[:, -raw.compact().seq_len :])
    padded = HFCache.cat([cache.select([0]), cache.select([1])])  # wider than either row needs after a select
    for c in (cache, padded, padded.select(torch.tensor([0])), raw):
        fast, ref = c.compact(), c.compact_by_gather()
        assert torch.equal(fast.mask, ref.mask)
        for (a, b), (x, y) in zip(fast._kv(), ref._kv()):
            assert torch.equal(a, x) and torch.equal(b, y)
    assert padded.select(torch.tensor([0])).compact().seq_len == 6  # the padding columns went


def test_keep_rows_equals_select_then_compact(model):
    """The rows a decode batch keeps, copied straight into room, against select then compact (the reference)."""
    model.fast_cache = True
    with torch.no_grad():
        items = [Prefill(None, list(range(3, 3 + n))) for n in (7, 15, 11, 4)]
        prefill(model, items, CPU)
        batch = DecodeBatch()
        for i, it in enumerate(items):
            batch.add([i], it.out_cache.select([it.out_row]).compact())
        batch.step(model, [5, 6, 7, 8], CPU)
        cache = batch.cache
        for rows in ([0, 2, 3], [2], [0, 3]):  # without the longest row: its leading columns go
            fast, ref = cache.keep_rows(rows), cache.select(torch.tensor(rows)).compact()
            assert torch.equal(fast.mask, ref.mask)
            assert 1 in rows or fast.seq_len < cache.seq_len
            for (a, b), (x, y) in zip(fast._kv(), ref._kv()):
                assert torch.equal(a, x) and torch.equal(b, y)
            t = torch.tensor([[9]] * len(rows))
            torch.testing.assert_close(model(t, cache=fast, use_cache=True).logits,
                                       model(t, cache=ref, use_cache=True).logits, atol=1e-6, rtol=1e-6)


def test_copies_of_a_cache_let_its_buffer_go(model):
    """A row selected, compacted or merged out of a room-backed cache holds new tensors: it must not keep the
    original's (batch-wide) buffer alive, which the session store's memory budget would never see."""
    with torch.no_grad():
        c = model(torch.tensor([list(range(5, 25)), list(range(30, 50))]), use_cache=True).cache
        c = model(torch.tensor([[7], [8]]), cache=c, use_cache=True).cache
        assert all(layer.room is not None for layer in c.past.layers)
        for copy_ in (c.select(torch.tensor([0])), c.select(torch.tensor([1])).compact(), c.compact_by_gather()):
            assert all(layer.room is None for layer in copy_.past.layers)
        assert all(layer.room is not None for layer in c.past.layers)  # the original keeps its own
