"""The KL reference resumed from the policy's frozen trunk (trainer/shared_trunk.py, ``trainer.reference_forward``)
against the full reference forward (the naive path), on a tiny Hugging Face llama of 4 layers with adapters on the top
2: the same log-probs, the same RL step; the trunk's layers really are skipped; and the cases where nothing may be
shared run the reference whole."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_hf import build_tokenizer  # noqa: E402
from test_lora import make_rows, step  # noqa: E402

from sandforge.config import LoraConfig, ModelConfig, TrainerConfig  # noqa: E402
from sandforge.job.fleet.lifecycle import free_port  # noqa: E402
from sandforge.trainer.batches import forward_scores  # noqa: E402
from sandforge.trainer.rank import RolloutShape  # noqa: E402
from sandforge.trainer.shared_trunk import capture, find_trunk, resumed  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAINER = TrainerConfig(lr=1e-2, zero_stage=2, grad_accum_steps=2, kl_coef=0.1)
SHAPE = RolloutShape(temperature=0.7, response_budget=64)


def save_llama(path, **config):
    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True, **config)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama4"))


def new_rank(path, trainer=TRAINER, top_layers=2):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from sandforge.trainer.rank import TrainerRank

    lora = LoraConfig(r=4, alpha=8.0, target_modules=TARGETS, top_layers=top_layers)
    return TrainerRank(0, 1, "127.0.0.1", free_port(), ModelConfig(path=str(path), lora=lora), trainer, SHAPE, seed=0,
                       num_threads=2)


@pytest.fixture(scope="module")
def moved(llama):
    """A rank whose adapters have moved away from the reference's (two RL steps)."""
    rank = new_rank(llama)
    for _ in range(2):
        step(rank, make_rows(rank, [1.0, -1.0, 1.0]))
    return rank


def test_the_trunk_is_every_layer_below_the_first_adapted_one(moved):
    assert moved.trunk is not None and moved.trunk.first == 2 and len(moved.trunk.layers) == 4


def test_the_reference_resumed_from_the_trunk_scores_as_its_full_forward(moved):
    """Rows of different lengths (padding in the micro-batch): the resumed reference's log-probs are the full
    reference's, and differ from the policy's (the adapters moved, so the test sees the reference, not the policy)."""
    rows = make_rows(moved, [1.0, -1.0, 0.5])
    layout = moved.layout(rows)
    trunk = moved.trunk
    with torch.no_grad():
        with capture(trunk):
            policy = forward_scores(moved.engine, rows, layout, 0.7).logprobs
        full = forward_scores(moved.reference, rows, layout, 0.7).logprobs
        with resumed(trunk):
            shared = forward_scores(moved.reference, rows, layout, 0.7).logprobs
    torch.testing.assert_close(shared, full, atol=1e-6, rtol=1e-6)
    assert (policy - full).abs().max() > 1e-4


def test_a_resumed_forward_skips_the_trunks_layers(moved):
    """The fast path is taken: no module of the trunk runs in the resumed forward; the adapted layers all do."""
    rows = make_rows(moved, [1.0, 1.0])
    layout, trunk = moved.layout(rows), moved.trunk
    ran = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(trunk.layers)]
    try:
        with torch.no_grad():
            with capture(trunk):
                forward_scores(moved.engine, rows, layout, 0.7)
            assert ran == [0, 1, 2, 3]
            ran.clear()
            with resumed(trunk):
                forward_scores(moved.reference, rows, layout, 0.7)
            assert ran == [2, 3]
            ran.clear()
            forward_scores(moved.reference, rows, layout, 0.7)  # the layers' own forwards again after it
            assert ran == [0, 1, 2, 3]
    finally:
        for h in hooks:
            h.remove()


def test_resuming_another_micro_batch_is_refused(moved):
    rows = make_rows(moved, [1.0, 1.0])
    trunk = moved.trunk
    with torch.no_grad():
        with capture(trunk):
            forward_scores(moved.engine, rows[:1], moved.layout(rows[:1]), 0.7)
        with pytest.raises(RuntimeError, match="not the same micro-batch"), resumed(trunk):
            forward_scores(moved.reference, rows, moved.layout(rows), 0.7)


def test_an_rl_step_with_the_shared_trunk_is_the_full_reference_step(llama):
    """``trainer.reference_forward: shared_trunk`` (the default) against ``full``: the same loss, KL, gradient norm
    and adapters after each of two steps (the second with the policy away from its reference)."""
    ranks = [new_rank(llama, TRAINER.model_copy(update={"reference_forward": mode})) for mode in ("shared_trunk",
                                                                                                   "full")]
    assert ranks[0].trunk is not None and ranks[1].trunk is None
    for advantages in ([1.0, -1.0, 0.5], [-1.0, 1.0, 1.0]):
        rows = make_rows(ranks[1], advantages)
        got = [step(rank, rows) for rank in ranks]
        for key in ("loss", "kl", "grad_norm"):
            assert got[0][key] == pytest.approx(got[1][key], rel=1e-5, abs=1e-7)
        assert got[0]["kl"] > 0 or advantages[0] == 1.0
    for k, v in ranks[1].get_weights().items():
        torch.testing.assert_close(ranks[0].get_weights()[k], v, atol=1e-6, rtol=1e-5)


def test_nothing_is_shared_where_the_trunk_could_differ(llama, tmp_path):
    """Adapters from layer 0, dropout in the trunk (train and eval forwards differ), and full fine-tuning: the
    reference runs whole."""
    assert new_rank(llama, top_layers=None).trunk is None
    assert new_rank(save_llama(tmp_path / "dropout", attention_dropout=0.1)).trunk is None
    assert find_trunk(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
