"""GPU check (run on a lent GPU machine, not in CI): fla-core's chunk_kda agrees with kda_chunked and kda_recurrent.

    python tests/gpu/check_fla_kda.py      # needs CUDA and the fla-core package
"""

import json
import sys
from pathlib import Path

import torch

try:
    from sandforge.models.k3.kda import fla_chunk_kda, kda_chunked, kda_recurrent
except ImportError:  # a bare checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from models.k3.kda import fla_chunk_kda, kda_chunked, kda_recurrent


def inputs(B, T, H, K, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V).to(dtype)
    gate = -5 * torch.sigmoid(r(B, T, H, K))  # log decay in [-5, 0]
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(B, H, K, V) * 0.1
    return q, k, v, gate, beta, h0


def main() -> None:
    chunk_kda = fla_chunk_kda()
    assert chunk_kda is not None, "fla-core is not importable"
    result = {}
    for dtype, T in [(torch.float32, 300), (torch.bfloat16, 1000)]:
        q, k, v, gate, beta, h0 = inputs(2, T, 4, 64, 64, dtype)
        o_f, s_f = chunk_kda(q, k, v, gate, beta.to(dtype), initial_state=h0, output_final_state=True)
        o_c, s_c = kda_chunked(q, k, v, gate, beta, initial_state=h0, output_final_state=True)
        o_r, s_r = kda_recurrent(q.float(), k.float(), v.float(), gate, beta, initial_state=h0, output_final_state=True)
        name = str(dtype).replace("torch.", "")
        result[f"{name}_fla_vs_recurrent_out"] = (o_f.float() - o_r).abs().max().item()
        result[f"{name}_fla_vs_recurrent_state"] = (s_f.float() - s_r).abs().max().item()
        result[f"{name}_chunked_vs_recurrent_out"] = (o_c.float() - o_r).abs().max().item()
    print(json.dumps(result))
    assert result["float32_fla_vs_recurrent_out"] < 1e-3 and result["float32_fla_vs_recurrent_state"] < 1e-3, result


if __name__ == "__main__":
    main()
