"""Checks of a validated job that span sections or look outside the config (files it names). ``load_config`` runs
them and raises the first problem as a ConfigError: one line naming the file and the keys. (This module does not
import sandforge.config, which imports it.)"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


def combination_problems(cfg, source: str) -> Iterator[str]:
    """Keys of different sections that cannot go together."""
    if cfg.trainer.steps > 0 and not any(e.draw_weight("rl") for e in cfg.environments):
        yield (f"{source}: every environment has 'rl_weight' 0 (or 'weight' 0 and no rl_weight), so RL has no tasks "
               f"to draw for its {cfg.trainer.steps} 'trainer.steps': give one environment an rl_weight above 0, or "
               "trainer.steps=0")
    if cfg.warmup.steps > 0 and cfg.warmup.episodes > 0 and not any(e.draw_weight("warmup") for e in cfg.environments):
        yield (f"{source}: every environment has 'weight' 0, so the warm start has no tasks to draw its "
               f"{cfg.warmup.episodes} 'warmup.episodes' from: give one environment a weight above 0, or "
               "warmup.episodes=0 (with 'warmup.data'), or warmup.steps=0")
    if cfg.model.lora is not None and cfg.trainer.zero_stage == 3:
        yield (f"{source}: 'model.lora' with 'trainer.zero_stage' 3 is not supported (the KL reference runs "
               "the policy under other adapters, which ZeRO-3's partitioned parameters do not allow): use "
               "zero_stage 2, which with LoRA already keeps only the adapters' optimizer state")
    if cfg.warmup.steps > 0 and cfg.warmup.episodes == 0 and cfg.warmup.data is None:
        yield (f"{source}: 'warmup.steps' is {cfg.warmup.steps} with 'warmup.episodes' 0 and no 'warmup.data': the "
               "warm start has nothing to learn from; give it reference episodes or a file of conversations")
    if cfg.warmup.data is not None and not cfg.warmup.data.exists():
        yield f"{source}: 'warmup.data' {cfg.warmup.data}: no such file or folder"
    if cfg.agent.harness is not None and cfg.warmup.steps > 0:
        yield (f"{source}: 'warmup.steps' with 'agent.harness' is not supported: the warm start replays reference "
               "solutions through sandforge's own agent loop, whose format the harness does not speak; set "
               "warmup.steps=0 (or start from a checkpoint)")
    remote = cfg.engine.remote
    if cfg.engine.colocate and remote is not None:
        yield (f"{source}: 'engine.colocate' with 'engine.remote' cannot go together (a separate server "
               "shares no GPU with the trainer): drop one")
    if cfg.engine.colocate and "cpu" in (cfg.trainer.device, cfg.engine.device):
        yield (f"{source}: 'engine.colocate' shares trainer rank 0's GPU, but 'trainer.device' is "
               f"{cfg.trainer.device} and 'engine.device' {cfg.engine.device}: use auto or cuda for both, "
               "or engine.colocate=false")
    if cfg.engine.colocate and cfg.trainer.mode == "async":
        yield (f"{source}: 'engine.colocate' with 'trainer.mode' async is not supported (the engine would "
               "keep generating on the GPU the trainer steps on): use trainer.mode sync, or give the engine "
               "a GPU of its own")
    if cfg.trainer.weight_sync == "colocated" and not cfg.engine.colocate:
        yield (f"{source}: 'trainer.weight_sync' colocated copies weights out of the GPU the engine "
               "shares with rank 0, so it needs engine.colocate=true (or weight_sync auto)")
    if remote is not None and cfg.trainer.mode == "async":
        yield (f"{source}: 'engine.remote' with 'trainer.mode' async is not supported (async RL swaps "
               "weights under running sequences, which only the embedded engine does): use trainer.mode "
               "sync, or drop engine.remote")
    if remote is not None and remote.api != "sandforge" and cfg.trainer.routing_replay:
        yield (f"{source}: 'trainer.routing_replay' with 'engine.remote.api' {remote.api} is not "
               "supported: only `sandforge serve` sends the routed experts back in a form the trainer "
               "replays; use engine.remote.api sandforge or trainer.routing_replay=false")


def path_problems(cfg, source: str) -> Iterator[str]:
    """Files a config points at must exist before any work starts."""
    init = cfg.model.init_from
    if init is not None and not (Path(init) / "config.json").is_file():
        yield (f"{source}: 'model.init_from' = {str(init)!r}: no checkpoint there (expected config.json)")
    template = cfg.model.chat_template
    if template is not None and not Path(template).is_file():
        yield (f"{source}: 'model.chat_template' = {str(template)!r}: no such file (expected a .jinja chat "
               "template)")
    if cfg.model.arch == "hf" and not pretrained_source(cfg.model.path):
        from sandforge.registry import MODEL_CATALOG

        yield (f"{source}: 'model.path' = {cfg.model.path!r}: model.arch hf needs a local Hugging Face model "
               f"directory (with config.json), a .gguf file or a catalogue name ({', '.join(MODEL_CATALOG)})")


def pretrained_source(path: str | None) -> bool:
    """Does ``model.path`` name something a pretrained policy can come from (models/sources.py resolves it)?"""
    from sandforge.registry import MODEL_CATALOG

    if not path:
        return False
    p = Path(path).expanduser()
    return (p / "config.json").is_file() or (p.suffix == ".gguf" and p.is_file()) or path in MODEL_CATALOG
