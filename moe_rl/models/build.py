"""Build a causal MoE language model from a typed config, or load a pretrained one."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import transformers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.errors import RunError
from moe_rl.models.config import ModelConfig


def _hf_config(
    cfg: ModelConfig, vocab_size: int, special_ids: dict[str, int]
) -> transformers.PretrainedConfig:
    """Translate our family-neutral sizes into each family's own config fields."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        tie_word_embeddings=False,
        **special_ids,
    )
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    if cfg.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.expert_ffn_size,
            intermediate_size=cfg.expert_ffn_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
        )
    if cfg.family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.expert_ffn_size,
            intermediate_size=cfg.expert_ffn_size,
            shared_expert_intermediate_size=cfg.shared_expert_ffn_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
        )
    if cfg.family == "olmoe":
        if cfg.head_dim not in (None, cfg.hidden_size // cfg.num_heads):
            raise ValueError(
                f"model.head_dim={cfg.head_dim}: family 'olmoe' requires hidden_size // num_heads "
                f"= {cfg.hidden_size // cfg.num_heads} (or null)"
            )
        return transformers.OlmoeConfig(
            **common,
            num_experts=cfg.num_experts,
            intermediate_size=cfg.expert_ffn_size,
            norm_topk_prob=cfg.norm_topk_prob,
        )
    if cfg.family == "mixtral":
        return transformers.MixtralConfig(
            **common,
            head_dim=head_dim,
            num_local_experts=cfg.num_experts,
            intermediate_size=cfg.expert_ffn_size,
        )
    raise ValueError(f"model.family={cfg.family!r}: unknown family")


@contextlib.contextmanager
def unloadable(pretrained: str, what: str, where: str | None = None) -> Iterator[None]:
    """Turn any failure to load `pretrained` (a garbled file, a pickle that weights-only loading refuses,
    an unknown architecture, no network for a hub id) into one RunError line naming the folder, as
    `where` (default "model.pretrained=<folder>": a warm start's cache entry is named as that instead).
    torch's "Detected pickle protocol ... please file an issue" warning before such a refusal is silenced."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected pickle protocol")
            yield
    except Exception as err:  # noqa: BLE001 - transformers, safetensors and torch each raise their own types
        first = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:200]  # its first sentence
        raise RunError(
            f"{where or f'model.pretrained={pretrained}'}: could not load the {what} ({type(err).__name__}: {first})"
        ) from err


def build_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None = None, *, where: str | None = None
) -> PreTrainedModel:
    """Return a causal MoE LM (a transformers `PreTrainedModel`) in eval mode.

    Built from config, it gets seeded random weights and a vocabulary sized to `tokenizer`
    (required then). With `cfg.pretrained`, weights come from `from_pretrained` (a local path or hub id);
    a failed load is one RunError line naming the folder as `where` (default: model.pretrained=...).
    """
    # Imported here: transformers' model code takes seconds to import, and most importers never build one.
    from transformers import AutoModelForCausalLM

    cfg.validate()
    dtype = getattr(torch, cfg.dtype)
    if cfg.pretrained:
        with unloadable(cfg.pretrained, "model", where):
            model = AutoModelForCausalLM.from_pretrained(
                cfg.pretrained,
                dtype=dtype,
                attn_implementation=cfg.attn_impl,
                experts_implementation=cfg.experts_impl,
            )
        # moe-rl's config decides the load-balancing loss, not the checkpoint's training-time value.
        model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
    else:
        if tokenizer is None:
            raise ValueError(
                "build_model: a tokenizer is required to size the vocabulary of a model built "
                "from config (model.pretrained is not set)"
            )
        special = dict(
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        hf_cfg = _hf_config(cfg, len(tokenizer), special)
        # The RNG is forked so building a model never disturbs the caller's random stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(
                hf_cfg,
                dtype=dtype,
                attn_implementation=cfg.attn_impl,
                experts_implementation=cfg.experts_impl,
            )
    model.generation_config.pad_token_id = model.config.pad_token_id
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.eval()
