"""Small MoE language models built from config or loaded pretrained, and a character tokenizer."""

from moe_rl.models.build import build_model
from moe_rl.models.config import ModelConfig
from moe_rl.models.tokenizer import build_tokenizer

__all__ = ["ModelConfig", "build_model", "build_tokenizer"]
