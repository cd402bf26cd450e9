"""A tiny llama GGUF file written with the ``gguf`` package, as llama.cpp's converter lays one out (Q and K rows
permuted for its rotary layout, a byte-level BPE vocabulary, a ChatML template), beside the Hugging Face model whose
weights it holds: what the GGUF loading tests compare against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HEADS, KV_HEADS, LAYERS, WIDTH = 4, 2, 2, 32
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte tokens (each byte as the printable character byte-level BPE maps it to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in sorted(chars)]


def _gguf_name(key: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if key in fixed:
        return fixed[key]
    _, _, layer, *rest = key.split(".")
    part = ".".join(rest)
    return f"blk.{layer}." + {
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight"}[part]


def _to_gguf_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's Q/K row order -> llama.cpp's (which transformers undoes when it loads the file)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path: Path, seed: int = 0):
    """Write the file; return the Hugging Face ``LlamaForCausalLM`` (fp32, eval) whose weights it holds."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = [*byte_tokens(), "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(2 * WIDTH)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])  # 3: control (special) tokens
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHATML)
    for key, value in model.state_dict().items():
        weight = value.numpy().astype(np.float32)
        if key.endswith("q_proj.weight"):
            weight = _to_gguf_rotary(weight, HEADS)
        elif key.endswith("k_proj.weight"):
            weight = _to_gguf_rotary(weight, KV_HEADS)
        writer.add_tensor(_gguf_name(key), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
