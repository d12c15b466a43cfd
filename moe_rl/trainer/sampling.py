"""The run's sampler, built once by `build_sampler` from the config (the samplers: moe_rl/trainer/samplers.py).

    sampler.engine -> BUILDERS row: vllm -> VllmSampler; hf -> PolicySampler (the policy itself) or
    CopySampler (a copy at trainer.sampler_dtype, or rollout.overlap's own copy)
    then rollout.staleness wraps it (moe_rl/trainer/stale.py): StaleSampler, OverlapSampler, or itself at 0

Each sampler says whether its log-probs are the trained model's own (`Sampler.exact`), so the step never
asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.config import Config
from moe_rl.errors import RunError
from moe_rl.objectives import OBJECTIVES
from moe_rl.rollout.vllm_engine import VllmEngine, write_checkpoint
from moe_rl.routing import RoutingController, float32_routers
from moe_rl.trainer.distributed import Dist
from moe_rl.trainer.samplers import CopySampler, Draws, PolicySampler, Sampler, VllmSampler
from moe_rl.trainer.stale import OverlapSampler, StaleSampler, thread_split


def build_sampler(cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  controller: RoutingController, draws: Draws, sample_gen: torch.Generator, dist: Dist,
                  sharded: bool) -> Sampler:
    """The run's sampler (module docstring): its engine's, wrapped as rollout.staleness asks."""
    topk = cfg.objective.topk if OBJECTIVES[cfg.objective.name].needs_topk else 0  # the DPPO top-k divergences
    engine = BUILDERS[cfg.sampler.engine](cfg, model, tokenizer, controller, draws, sample_gen, dist, sharded, topk)
    return stale(cfg, engine)


def hf_sampler(cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               controller: RoutingController, draws: Draws, sample_gen: torch.Generator, dist: Dist,
               sharded: bool, topk: int) -> Sampler:
    """sampler.engine=hf: the policy itself, or a copy at trainer.sampler_dtype (rollout.overlap: a copy of
    its own at the sampler's dtype, which the background thread samples with)."""
    t, ro = cfg.trainer, cfg.rollout
    # A stale sampler records its router logits: the margin prediction of its change (routing/margin/*).
    hf = dict(config=cfg.sampler, generator=sample_gen, record_logits=t.reuse_sampler_logp or ro.staleness > 0,
              record_gates=cfg.routing.replay_gates,
              all_done=dist.all_done if sharded else None, topk=topk)
    if ro.overlap:  # the background thread samples with a generator of its own
        hf["generator"] = torch.Generator(torch.device(t.device)).manual_seed(cfg.seed)
    if ro.overlap or (t.sampler_dtype is not None and t.sampler_dtype != cfg.model.dtype):
        dtype = getattr(torch, t.sampler_dtype or cfg.model.dtype)
        copy_ = controller.detached_copy(model).to(dtype).eval().requires_grad_(False)
        if cfg.model.router_dtype == "float32":
            float32_routers(copy_)
        return CopySampler(draws, copy_, RoutingController(copy_), tokenizer, **hf)
    # trainer.sampler_dtype equal to model.dtype samples with the policy itself, but asked for a sampler
    # precision, and so for its mismatch diagnostics (rollout_is/ess, rollout_is/chi2): not exact.
    return PolicySampler(draws, model, controller, tokenizer, **hf, exact=t.sampler_dtype is None)


def vllm_sampler(cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 controller: RoutingController, draws: Draws, sample_gen: torch.Generator, dist: Dist,
                 sharded: bool, topk: int) -> Sampler:
    """sampler.engine=vllm: this rank's vLLM engine. Under torchrun rank 0 writes the checkpoint every
    engine starts from (the others wait for its path). A rank whose engine cannot start exits at once with
    its error, naming the rank, and torchrun then stops the others (they may be waiting inside vLLM's
    start-up for it)."""
    t = cfg.trainer
    checkpoint = dist.broadcast(write_checkpoint(model, tokenizer) if dist.main else None) if dist.world > 1 else None
    try:
        engine = VllmEngine(model, tokenizer, cfg.sampler, dtype=t.sampler_dtype or cfg.model.dtype, seed=cfg.seed,
                            max_rows=t.prompts_per_step * t.group_size,
                            routers=(controller.num_layers, controller.num_experts), checkpoint=checkpoint, topk=topk)
    except RunError as err:
        if dist.world == 1:
            raise
        raise RunError(f"rank {dist.rank} of {dist.world}: {err}") from err
    return VllmSampler(draws, engine)


BUILDERS: dict[str, Callable[..., Sampler]] = {"hf": hf_sampler, "vllm": vllm_sampler}
"""sampler.engine -> what builds its sampler (every row of moe_rl.rollout.engines.ENGINES has one)."""


def stale(cfg: Config, sampler: Sampler) -> Sampler:
    """`sampler` as rollout.staleness asks (moe_rl/trainer/stale.py): itself at 0."""
    ro = cfg.rollout
    if ro.overlap:
        return OverlapSampler(sampler, ro.staleness, cfg.trainer.steps, thread_split(cfg.trainer.threads, ro.sampler_threads)[1])
    return StaleSampler(sampler, ro.staleness) if ro.staleness else sampler
