"""The K3 model's configuration and its named sizes. Plain data, no torch: the CLI checks configs with it in a blink."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass
class K3Config:
    vocab_size: int = 1024
    d_model: int = 128
    groups: int = 1  # each group: 3 KDA layers + 1 MLA layer; one more MLA layer tops the stack
    n_heads: int = 4
    head_dim: int = 32
    kda_low_rank: int = 16
    conv_kernel: int = 4
    q_latent: int = 64
    kv_latent: int = 32
    d_ff: int = 256  # the dense first layer
    n_experts: int = 8
    top_k: int = 2
    n_shared: int = 1
    d_expert: int = 64
    balancing: str = "quantile"
    attnres_block_layers: int = 4  # layers per AttnRes block (4 lines blocks up with the 3:1 groups)
    max_seq_len: int = 8192  # no positional encoding limits this; it bounds generation only
    tie_embeddings: bool = True
    arch: str = field(default="k3", init=False)

    @property
    def layer_kinds(self) -> list[str]:
        return ["kda", "kda", "kda", "mla"] * self.groups + ["mla"]

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> K3Config:
        names = {f.name for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in d.items() if k in names})


PRESETS = {
    # under 1M parameters: unit tests
    "k3-nano": K3Config(d_model=64, groups=1, n_heads=2, head_dim=32, q_latent=32, kv_latent=16, d_ff=128,
                        n_experts=4, top_k=2, d_expert=32, kda_low_rank=8),
    # around 10M parameters: CPU runs
    "k3-mini": K3Config(d_model=256, groups=2, n_heads=4, head_dim=64, q_latent=128, kv_latent=64, d_ff=768,
                        n_experts=16, top_k=2, d_expert=128, kda_low_rank=32),
    # around 1B parameters: GPU runs
    "k3-1b": K3Config(vocab_size=32768, d_model=1536, groups=4, n_heads=12, head_dim=128, q_latent=768, kv_latent=512,
                      d_ff=4096, n_experts=24, top_k=4, n_shared=1, d_expert=768, kda_low_rank=64),
}


def preset_config(preset: str, overrides: dict | None = None, vocab_size: int | None = None) -> K3Config:
    """The named preset with some fields replaced; errors name the bad key as ``model.k3.<field>``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown K3 preset {preset!r}; known: {', '.join(PRESETS)}")
    overrides = dict(overrides or {})
    known = {f.name for f in fields(K3Config) if f.init and f.name != "vocab_size"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model.k3.{unknown[0]}: not a K3Config field; known: {', '.join(sorted(known))}")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return replace(PRESETS[preset], **overrides)
