"""Batched sampling with a KV cache, returning completions, the sampler's log-probs and its routing.

One prefill over the left-padded prompts, then one batched forward per new token through the model's
own forward with its cache. Log-probs are those of the untruncated distribution softmax(logits / T),
which is what a full forward at the same temperature computes: top-p and EOS suppression change only
what is *drawn*, never the reported likelihood.

Shape legend: B rows, P prompt length, R response length, S = P + R, V vocabulary, L layers, K top-k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import SuppressTokensLogitsProcessor, TopPLogitsWarper

from moe_rl.rollout.forward import position_ids_from_mask
from moe_rl.routing import RoutingController, RoutingTrace


@dataclass
class SamplerConfig:
    """Sampling settings."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs are then reported at temperature 1). RL refuses 0:
    a greedy group has one response, so every advantage is 0."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 32
    """Response length limit in tokens (EOS included)."""
    suppress_eos: bool = False
    """Never draw EOS, so every response has exactly max_new_tokens tokens (benchmarks)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if self.temperature < 0:
            raise ValueError(f"sampler.temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler.top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampler.max_new_tokens={self.max_new_tokens}: must be >= 1")


@dataclass
class Rollout:
    """A batch of sampled completions.

    prompt_ids_BP / prompt_mask_BP: left-padded prompts. response_ids_BR: right-padded with pad after EOS.
    response_mask_BR: True on real response tokens (EOS included). logp_BR: sampler log-probs (0 on pads).
    entropy_BR: entropy (nats) of each drawn token's distribution softmax(logits / T) (0 on pads).
    routing: the sampler's trace over the S - 1 positions it fed (prefill + each decode step), or None.
    texts: decoded responses without special tokens.
    """

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BR: torch.Tensor
    response_mask_BR: torch.Tensor
    logp_BR: torch.Tensor
    entropy_BR: torch.Tensor
    routing: RoutingTrace | None
    texts: list[str]

    @property
    def input_ids_BS(self) -> torch.Tensor:
        """Prompt and response as one row."""
        return torch.cat([self.prompt_ids_BP, self.response_ids_BR], dim=1)

    @property
    def attention_mask_BS(self) -> torch.Tensor:
        """Attention mask of `input_ids_BS`: prompt mask, then ones (pads after EOS attend harmlessly)."""
        return torch.cat(
            [self.prompt_mask_BP, torch.ones_like(self.response_mask_BR, dtype=self.prompt_mask_BP.dtype)], 1
        )


def _draw(
    logits_BV: torch.Tensor,
    cfg: SamplerConfig,
    banned: list[int],
    generator: torch.Generator,
    rows: slice = slice(None),
    total_rows: int | None = None,
) -> torch.Tensor:
    """Draw one token per row from temperature-scaled, top-p-truncated logits, never a banned token.

    The noise is drawn for `total_rows` rows (default: these rows) and `rows` of it are used, so a row's
    draw does not depend on how the batch is split across processes.
    """
    logits_BV = logits_BV.float()
    if banned:
        logits_BV = SuppressTokensLogitsProcessor(banned, device=logits_BV.device)(None, logits_BV)
    if cfg.temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / cfg.temperature
    if cfg.top_p < 1:  # keep the smallest set of most likely tokens whose mass reaches top_p
        logits_BV = TopPLogitsWarper(cfg.top_p)(None, logits_BV)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    # Exponential race: argmax p / E with E ~ Exp(1) draws from p (one kernel, seeded, no multinomial).
    shape = (total_rows or probs_BV.shape[0], probs_BV.shape[1])
    noise_BV = probs_BV.new_empty(shape).exponential_(generator=generator)[rows]
    return (probs_BV / noise_BV).argmax(-1)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    cfg: SamplerConfig,
    *,
    generator: torch.Generator,
    controller: RoutingController | None = None,
    rows: slice = slice(None),
    all_done: Callable[[bool], bool] | None = None,
    record_logits: bool = False,
) -> Rollout:
    """Sample one completion per prompt (repeat prompts for groups). Records routing when given a controller
    (with the router logits too when `record_logits`).

    Data parallel (moe_rl.trainer.distributed): `rows` samples only those rows of `prompts`, with the
    padding and random noise of the whole list, so a row's completion is the same however the list is
    split across processes. `all_done(this process is done)` says whether every process is done, for
    models whose forward is a collective (FSDP): decoding then stops on all processes together.
    """
    cfg.validate()
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids_BP, prompt_mask_BP = enc["input_ids"][rows].to(device), enc["attention_mask"][rows].to(device)
    B, P = prompt_ids_BP.shape
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    # Special tokens other than EOS are never drawn (nor EOS itself when suppressed).
    banned = [i for i in tokenizer.all_special_ids if i != eos or cfg.suppress_eos]
    R = cfg.max_new_tokens
    mask_BS = torch.cat([prompt_mask_BP, prompt_mask_BP.new_ones(B, R)], dim=1)
    positions_BS = position_ids_from_mask(mask_BS)
    tokens_BR = torch.full((B, R), pad, dtype=torch.long, device=device)
    logp_BR = torch.zeros(B, R, dtype=torch.float32, device=device)
    entropy_BR = torch.zeros(B, R, dtype=torch.float32, device=device)
    alive_B = torch.ones(B, dtype=torch.bool, device=device)
    lengths_B = torch.zeros(B, dtype=torch.long, device=device)
    recording = controller.record(record_logits) if controller is not None else contextlib.nullcontext()
    with recording as rec:
        cache = DynamicCache(config=model.config)
        feed_BT, start, steps = prompt_ids_BP, 0, 0
        for t in range(R):
            end = P + t
            out = model(
                input_ids=feed_BT,
                attention_mask=mask_BS[:, :end],
                position_ids=positions_BS[:, start:end],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits_BV = out.logits[:, -1]
            tok_B = _draw(logits_BV, cfg, banned, generator, rows, len(prompts))
            tok_B = torch.where(alive_B, tok_B, torch.full_like(tok_B, pad))
            tokens_BR[:, t] = tok_B
            logp_BV = torch.log_softmax(logits_BV.float() / (cfg.temperature or 1.0), dim=-1)
            logp_BR[:, t] = torch.where(alive_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1), 0.0)
            entropy_BR[:, t] = torch.where(alive_B, -(logp_BV.exp() * logp_BV).sum(-1), 0.0)
            lengths_B += alive_B.long()
            alive_B &= tok_B != eos
            steps = t + 1
            done = not alive_B.any()
            if all_done(done) if all_done is not None else done:
                break
            feed_BT, start = tok_B.unsqueeze(1), end
    tokens_BR, logp_BR, entropy_BR = tokens_BR[:, :steps], logp_BR[:, :steps], entropy_BR[:, :steps]
    response_mask_BR = torch.arange(steps, device=device).unsqueeze(0) < lengths_B.unsqueeze(1)
    texts = tokenizer.batch_decode(
        tokens_BR.masked_fill(~response_mask_BR, pad).cpu(), skip_special_tokens=True
    )
    return Rollout(
        prompt_ids_BP,
        prompt_mask_BP,
        tokens_BR,
        response_mask_BR,
        logp_BR,
        entropy_BR,
        rec.trace if rec is not None else None,
        texts,
    )
