"""Every bench/ script still runs: each as a subprocess of this venv's python (DS_ACCELERATOR=cpu, no CUDA device) at
its smallest setting, to its last line, the JSON object it promises, with the keys it promises. No timing is
asserted: at these sizes, on a shared machine, the numbers mean nothing; what fails here is a benchmark that rotted
(a renamed import, a config it can no longer build, a section that crashes). The GPU scripts are checked for their
refusal on a machine without CUDA and run their CPU smoke settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def bench(script: str, *args: str, timeout: float = 240, expect_rc: int = 0) -> subprocess.CompletedProcess:
    """Run ``bench/<script>`` with ``args`` on CPU; fail with its output's tail unless it exits ``expect_rc``."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "160"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != expect_rc:
        pytest.fail(f"bench/{script} {' '.join(args)} exited {proc.returncode} (expected {expect_rc})\n"
                    f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}")
    return proc


def last_json(proc: subprocess.CompletedProcess, *keys: str) -> dict:
    """The JSON object on the last line of stdout, which must hold ``keys``."""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr tail:\n{proc.stderr[-2000:]}"
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"the last line is not JSON: {lines[-1][:300]!r}")
    assert isinstance(result, dict), result
    missing = [k for k in keys if k not in result]
    assert not missing, f"keys {missing} missing from {sorted(result)}"
    return result


def test_generation():
    out = last_json(bench("generation.py", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "4"),
                    "batched_vs_naive", "identical_greedy_outputs", "batched_tokens_per_s", "naive_tokens_per_s")
    assert out["identical_greedy_outputs"] is True  # greedy: the batched reference decodes what the naive one does
    assert out["batched_vs_naive"] > 0


def test_proxy_flood():
    result = last_json(bench("proxy_flood.py", "--seconds", "0.5", "--max-context", "2048", "--model", "bpe",
                             "--flooders", "1"), "baseline", "flooded", "worst_added_s", "cpu")
    assert result["baseline"]["requests"] > 0 and result["flooded"]["requests"] > 0


def test_model():
    out = last_json(bench("model.py", "--T", "128", "--chunk", "32", "--repeats", "1", "--threads", "1",
                          "--model-len", "64"),
                    "kda_chunked_vs_recurrent", "kda_max_err", "kda_chunked_vs_recurrent_strong_decay",
                    "kda_layer_prefill_tokens_per_s", "kda_layer_decode_tokens_per_s", "k3_nano_tokens_per_s",
                    "k3_mini_tokens_per_s")
    assert out["kda_max_err"] < 1e-3  # chunked KDA agrees with its recurrent reference
    assert out["kda_chunked_vs_recurrent"] > 0


def test_engine_roofline(tmp_path):
    """bench/engine.py on a tiny Llama: both engines and the roofline's keys for each batch."""
    pytest.importorskip("peft")
    from test_lora import save_tiny_llama

    llama = save_tiny_llama(tmp_path / "llama")
    out = last_json(bench("engine.py", "--models", str(llama), "--batches", "1,2", "--context", "16",
                          "--new-tokens", "4", "--rounds", "1", "--dtype", "float32"),
                    "cpu", "amx", "machine", "decode_vs_roofline_b1", "decode_vs_roofline_b2", "old_vs_roofline_b2")
    assert 0 < out["decode_vs_roofline_b2"] and out["llama_b2"]["new_tok_s"] > 0


def test_rollout_engine_sections():
    out = last_json(bench("rollout.py", "--sections", "prefill", "decode", "--prefill-episodes", "1", "--episodes", "1",
                          "--turns", "1", "--batch", "2"),
                    "prefill_ratio_10_turns", "prefill_ratio_reprefill", "fed_ratio_10_turns", "decode_vs_hf_generate",
                    "decode_vs_hf_generate_wall", "engine_tokens_per_s", "hf_generate_tokens_per_s",
                    "decode_outputs_identical")
    assert out["decode_outputs_identical"] is True
    assert out["prefill_ratio_10_turns"] < out["prefill_ratio_reprefill"]  # sessions prefill less than re-prefilling


def test_engine_replay(tmp_path):
    """The engine replaying synthetic quickstart-shaped episodes on the fused path, with the model path's fast cache and
    with its reference; the three runs decode exactly the tokens the episodes ask for."""
    pytest.importorskip("peft")
    from test_lora import save_tiny_llama

    llama = save_tiny_llama(tmp_path / "llama")
    out = last_json(bench("engine_replay.py", "--model", str(llama), "--episodes", "3", "--concurrency", "3",
                          "--baseline-concurrency", "2", "--prompt-tokens", "40", "--max-generated", "8",
                          "--tool-s", "0", "--dtype", "float32"),
                    "fused_vs_fast", "fast_vs_reference", "fused", "fast", "reference", "cpu")
    assert out["fused"]["decode_tokens"] == out["fast"]["decode_tokens"] == out["reference"]["decode_tokens"] > 0
    assert [out[k]["engine"] for k in ("fused", "fast", "reference")] == ["fused", "fast", "reference"]
    assert set(out["fast"]["parts_s"]) == set(out["fused"]["parts_s"]) == {"decode", "add", "remove", "prefill",
                                                                            "other"}
    assert out["fused"]["prefill_tokens"] <= out["fast"]["prefill_tokens"]


@pytest.mark.docker
def test_rollout_sandbox_episodes(docker_client):
    out = last_json(bench("rollout.py", "--sections", "sandbox_episodes", "--sandbox-concurrency", "1"),
                    "episodes_per_s_c1", "episodes_per_s_c1_engine")
    assert out["episodes_per_s_c1"] > 0 and out["episodes_per_s_c1_engine"] > 0


@pytest.mark.docker
def test_sandbox(docker_client):
    out = last_json(bench("sandbox.py", "--calls", "3", "--cli-calls", "3", "--acquires", "1", "--sandboxes", "2",
                          "--commands", "2", "--create-workers", "2"),
                    "exec_vs_sdk_p50", "exec_vs_cli_p50", "reference_vs_sdk_p50", "acquire_warm_vs_cold", "concurrent",
                    "failures", "throughput_cmd_per_s", "exec_p50_ms", "sdk_p50_ms", "cli_p50_ms")
    assert (out["concurrent"], out["failures"]) == (2, 0)


def test_trainer_cpu_sections(tmp_path):
    """Every section but async_vs_sync, in one process; the SmolLM2 sections on a tiny llama built here."""
    pytest.importorskip("peft")
    from test_lora import save_tiny_llama

    llama = save_tiny_llama(tmp_path / "llama")
    out = last_json(bench("trainer.py", "--sections", "weight_sync", "deepspeed_vs_torch", "packing", "lora_vs_full",
                          "precision", "shared_trunk", "padding_mask", "--sync-preset", "k3-nano",
                          "--sync-repeats", "1", "--train-rows", "2", "--train-len", "48", "--train-steps", "1",
                          "--pack-rows", "4", "--pack-longest", "96", "--smollm2", str(llama), "--lora-rows", "2", "--lora-len", "32", "--lora-threads", "1",
                          "--lora-top-layers", "1"),
                    "weight_sync_s_per_gb", "weight_sync_object_store_vs_collective", "deepspeed_vs_torch",
                    "train_tokens_per_s", "packed_vs_padded", "packing_slot_use", "lora_vs_full", "lora_top_vs_full",
                    "lora_trainable_params", "no_kl_vs_kl", "bf16_vs_fp32", "shared_trunk_vs_full",
                    "causal_vs_mask")
    assert set(out["weight_sync_s_per_gb"]) == {"object_store", "collective", "colocated"}
    trainable = out["lora_trainable_params"]
    assert trainable["lora_top"] < trainable["lora"] < trainable["full"]


@pytest.mark.docker
@pytest.mark.slow
def test_trainer_async_vs_sync(docker_client):
    """Two whole jobs (sync, then async) on Docker, Ray and DeepSpeed: about a minute even at one step."""
    out = last_json(bench("trainer.py", "--sections", "async_vs_sync", "--steps", "1", "--delay", "0", "--workers", "1",
                          "--concurrency", "2", "--tasks-per-step", "1", "--tokens", "4", timeout=400),
                    "async_vs_sync", "async_wall_s", "sync_wall_s", "async_staleness_mean", "async_staleness_max",
                    "async_staleness_histogram", "async_trainer_idle_frac", "async_engine_idle_frac")
    # async never trains on episodes more than trainer.max_staleness (2 by default) versions old
    assert out["async_staleness_max"] <= 2 and all(int(k) <= 2 for k in out["async_staleness_histogram"])


@pytest.mark.docker
@pytest.mark.slow
def test_rl_step(docker_client, tmp_path):
    """One RL step twice (two fleets: Ray, the engine, a rollout worker, a DeepSpeed rank, sandboxes) on a tiny llama:
    about three minutes. Its split must account for the step's wall time exactly, part by part."""
    pytest.importorskip("peft")
    from test_lora import save_tiny_llama

    llama = save_tiny_llama(tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # the quickstart's prompts (tool declarations) outgrow its 256
    (llama / "config.json").write_text(json.dumps(config))
    out = last_json(bench("rl_step.py", "--model", str(llama), "--tasks-per-step", "1", "--group-size", "2",
                          "--max-new-tokens", "4", "--gemm-size", "512", "--set", "model.lora.top_layers=1",
                          "rollout.max_turns=2", "rollout.workers=1", timeout=600),
                    "rl_step_s", "split_s", "covered_s", "tokens_per_s", "engine_flops_vs_gemm", "speedup",
                    "speedup_note", "baseline", "cpu")
    assert set(out["split_s"]) == {"engine_prefill", "engine_decode", "engine_other", "sandbox_exec", "grading",
                                   "sandbox_setup", "trainer_forward", "trainer_backward", "weight_sync", "idle"}
    assert sum(out["split_s"].values()) == pytest.approx(out["rl_step_s"], abs=0.02)
    # every actor process was timed (the hook reached the engine, the worker and the rank); a random tiny model may
    # call no tool, so sandbox_exec may be 0
    timed = ("engine_prefill", "engine_busy", "trainer_step", "trainer_backward", "grading", "sandbox_setup",
             "weight_sync")
    assert all(out["covered_s"][part] > 0 for part in timed), out["covered_s"]
    assert out["episodes"] == 2 and out["tokens"]["prefill"] > 0 and out["tokens"]["decode"] > 0
    assert set(out["engine_flops_vs_gemm"]) == {"bf16", "fp32"}
    assert "noise" in out["speedup_note"]  # no --baseline overrides: the same step twice, no speed-up claimed
    assert {"model", "amx_bf16"} <= set(out["cpu"])


@pytest.mark.parametrize("script", ["gpu_e2e.py", "gpu_model.py"])
def test_gpu_script_refuses_without_cuda(script):
    proc = bench(script, expect_rc=1)  # imports, parses its arguments, then says what to do
    assert "no CUDA device here" in proc.stderr and "--device cpu" in proc.stderr, proc.stderr[-2000:]


def test_gpu_model_on_cpu():
    out = last_json(bench("gpu_model.py", "--device", "cpu", "--preset", "k3-nano", "--batch", "1", "--seq", "16",
                          "--steps", "1", "--warmup", "1"),
                    "tokens_per_s", "baseline_step_ms", "grouped_vs_loop", "mfu", "active_params", "loss_last")
    assert out["device"] == "cpu"


def test_gpu_e2e_on_cpu():
    out = last_json(bench("gpu_e2e.py", "--device", "cpu", "--models", "k3-nano", "--batch", "2", "--prompt", "8",
                          "--new-tokens", "4", "--grad-accum", "1"),
                    "device", "batch", "k3-nano")
    assert {"engine_decode_tokens_per_s", "baseline_decode_tokens_per_s", "engine_vs_baseline", "train_tokens_per_s",
            "train_mfu", "weight_sync_s_per_gb", "rl_step_s"} <= set(out["k3-nano"])
