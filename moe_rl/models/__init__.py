"""Small MoE language models built from config or loaded pretrained, and a character tokenizer.

`build_model` and `build_tokenizer` are imported on first use (PEP 562): transformers' model code takes
seconds to import, and the schema (`moe_rl.models.config`, read by `moe_rl.config`) needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.lazy import lazy_attributes
from moe_rl.models.config import ModelConfig

if TYPE_CHECKING:
    from moe_rl.models.build import build_model
    from moe_rl.models.tokenizer import build_tokenizer

_LAZY = {"build_model": "moe_rl.models.build", "build_tokenizer": "moe_rl.models.tokenizer"}

__all__ = ["ModelConfig", "build_model", "build_tokenizer"]

__getattr__ = lazy_attributes(__name__, _LAZY)
