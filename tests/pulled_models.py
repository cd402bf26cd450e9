"""Catalogue models the set-up pulled (scripts/setup.sh: `sandforge models pull smollm2-135m`). Tests on real weights or
tokenizers take them from here; without the pull they skip, except under scripts/test.sh, where a missing model fails
(SANDFORGE_REQUIRE_MODELS=1)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest


def pulled(name: str) -> Path:
    from sandforge.models.sources import ModelSourceError, local_model_dir

    try:
        return local_model_dir(name, announce=lambda _: None)
    except ModelSourceError as e:
        if os.environ.get("SANDFORGE_REQUIRE_MODELS") == "1":
            pytest.fail(f"this test needs a pulled model: {e}")
        pytest.skip(f"this test needs a pulled model: {e}")


@functools.cache
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pulled("smollm2-135m")), local_files_only=True)
