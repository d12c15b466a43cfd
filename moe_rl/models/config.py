"""Typed model config: a small MoE built from config, or a pretrained checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe")
EXPERTS_IMPLS = ("eager", "grouped_mm", "batched_mm")
DTYPES = ("float32", "bfloat16", "float16", "float64")
TOKENIZERS = ("char", "bpe")
BPE_MIN_VOCAB = 260
"""A byte-level BPE's smallest vocabulary: the 256 bytes and the four special tokens."""


@dataclass
class ModelConfig:
    """How to build the policy model. Defaults give the tiny Qwen3-MoE used in tests and quickstarts."""

    family: str = "qwen3_moe"
    """Architecture when built from config: one of qwen3_moe, olmoe, mixtral, qwen2_moe."""
    pretrained: str | None = None
    """Path or hub id loaded with `from_pretrained`; when set, the size fields below are ignored."""
    tokenizer: str = "char"
    """Tokenizer of a model built from config (moe_rl.models.tokenizer): char, one token per character
    (the synthetic tasks' alphabet, or every character of task=dataset's rows), or bpe, a byte-level BPE
    trained at start-up on task=dataset's training text and cached by its content hash. With
    model.pretrained the checkpoint's own tokenizer is used, and this must stay char (moe_rl.config)."""
    bpe_vocab_size: int = 512
    """model.tokenizer=bpe: the vocabulary size the BPE is trained to (at least 260: the 256 bytes and
    four special tokens; smaller text may stop short of it)."""
    tokenizer_cache_dir: str = "~/.cache/moe-rl/tokenizer"
    """Where trained BPE tokenizers are kept, one folder per content hash (not part of any cache key)."""
    hidden_size: int = 128
    """Residual stream width."""
    num_layers: int = 4
    """Decoder layers; every layer is an MoE layer."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int | None = 32
    """Per-head width; None means hidden_size // num_heads."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts activated per token."""
    expert_ffn_size: int = 128
    """Hidden width of each expert's SwiGLU FFN."""
    shared_expert_ffn_size: int = 128
    """qwen2_moe only: width of the always-on shared expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to 1 (mixtral always does)."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response) the rotary embedding is set up for."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient. 0 by default: RL losses carry no auxiliary term unless asked.
    When > 0, the family's own load-balancing loss (transformers' load_balancing_loss_func) times this
    is added to the RL loss of every update (logged as train/aux_loss) and to the warm start's loss.
    It overrides a pretrained checkpoint's own value."""
    experts_impl: str = "grouped_mm"
    """transformers experts kernel: grouped_mm (tokens sorted by expert, one grouped matmul; the fastest
    on CPU too, experiments/bench/rl_step.py), eager (a loop over experts) or batched_mm."""
    attn_impl: str = "sdpa"
    """transformers attention implementation: sdpa or eager."""
    dtype: str = "float32"
    """Parameter and compute dtype of every forward (warm start, sampler, old policy, update). bfloat16 is a
    supported trainer setting on CPU and GPU: routing record/replay stay bitwise exact in it, and the
    optimizer keeps float32 master weights unless trainer.master_weights=false."""
    router_dtype: str | None = None
    """float32: every router of a model held below float32 (model.dtype, or the sampler copy at
    trainer.sampler_dtype) computes its logits, softmax and top-k in float32 (moe_rl/routing/precision.py),
    as vLLM's moe_router_dtype. null: the routers share their model's dtype. RL only: the warm start is
    built at model.dtype."""
    seed: int = 0
    """Seed of the random initial weights."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"model.experts_impl={self.experts_impl!r}: expected one of {EXPERTS_IMPLS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: expected one of {DTYPES}")
        if self.dtype == "float64" and self.experts_impl == "grouped_mm":
            raise ValueError(
                "model.experts_impl=grouped_mm has no float64 kernel: set model.experts_impl=eager for float64"
            )
        if self.router_dtype not in (None, "float32"):
            raise ValueError(f"model.router_dtype={self.router_dtype!r}: expected float32 or null")
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"model.attn_impl={self.attn_impl!r}: expected 'sdpa' or 'eager'")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"model.tokenizer={self.tokenizer!r}: expected one of {TOKENIZERS}")
        if self.pretrained:  # its own tokenizer (a warm start's is the one it was built with)
            return
        if self.tokenizer == "bpe" and self.bpe_vocab_size < BPE_MIN_VOCAB:
            raise ValueError(f"model.bpe_vocab_size={self.bpe_vocab_size}: must be >= {BPE_MIN_VOCAB}")
        if not self.tokenizer_cache_dir:
            raise ValueError("model.tokenizer_cache_dir is empty: give a folder for trained tokenizers")
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}: unknown family, expected one of {FAMILIES}")
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "num_experts",
            "top_k",
            "expert_ffn_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} is greater than model.num_experts={self.num_experts}")
        if self.num_experts > 65536:
            raise ValueError(f"model.num_experts={self.num_experts}: at most 65536 experts are supported")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"model.head_dim={self.head_dim}: must be a positive even number (rotary)")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError(
                "model.norm_topk_prob=false is not available for family 'mixtral' "
                "(Mixtral always renormalises its top-k gate weights)"
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"model.router_aux_loss_coef={self.router_aux_loss_coef}: must be >= 0")
