"""Supervised warm start: teacher-force task demonstrations until the policy sometimes succeeds.

RL from a random policy gets no signal: every group scores 0, so every GRPO/GSPO advantage is 0.
`warm_start` trains the config-built model on `task.solve` demonstrations (cross-entropy on response
tokens only, EOS included) and stops as soon as held-out accuracy, measured by *sampling* at the RL
temperature, lies in the band [target_low, target_high]: the policy then succeeds on some prompts and
fails on others, which is where group-relative advantages are informative.

Overshoot (accuracy jumps from below the band to above it between two evaluations). The model and
optimizer state of the last evaluation below the band is kept as a snapshot. On an overshoot the
training rolls back to that snapshot, halves the learning rate and evaluates after every step from then
on; each further overshoot rolls back again and halves again. Every optimizer step, discarded or not,
counts against `max_steps`, so the search is bounded. When the budget runs out without landing in the
band: if some evaluation overshot, the overshot model closest to the band is returned with a warning (a
too-easy policy still leaves RL some signal while accuracy < 1); if accuracy never exceeded target_low,
`RuntimeError` (RL would start without signal).

Caching: the result is saved under `<cache_dir>/<task>-<key[:16]>/` (model and tokenizer via
`save_pretrained`, plus `warmstart.json`), where `key` is the sha256 of everything that determines the
weights (the device type included; the difficulty mix `task.mix` only when set, so entries built without
one keep their keys; likewise a dataset task's identity and a tokenizer other than char). Builds run on `BUILD_THREADS` torch threads, so a key's weights do
not depend on the caller's thread count. `warmstart.json` holds the sha256 of every file of the entry;
an entry that fails that check is rebuilt with a warning. A valid entry is read without any lock (a
read-only cache is usable). Concurrent builders (Hydra sweep jobs) serialise on an exclusive lock of
`<dir>.lock` (`filelock`, released by the OS when a process dies); the builder writes into a temporary
directory and renames it into place, so the final name only ever holds a complete result, and a caller
that waited on the lock loads it. A failed build removes its lock file.

Pretraining (`pretrain_steps` > 0, off by default): before the band search the model first trains on
the broad mixture of every task family at every difficulty with load balancing (`moe_rl.pretrain`), so the
band search fine-tunes a broadly trained, balanced MoE instead of a random one.

Seeds: `seed` (the run seed) seeds torch's RNG, the stream of training demonstrations (pretraining has
its own stream of the same seed) and the eval sampler's generator; `WarmStartConfig.seed` picks the
held-out eval examples. Model weights start from `model_cfg` as given (its own `seed` field).

Shape legend: B rows, S sequence length (prompt + response + EOS, right-padded), V vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from moe_rl.errors import RunError
from moe_rl.models import ModelConfig, build_model
from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.rollout import SamplerConfig, position_ids_from_mask, sample
from moe_rl.tasks import DatasetTask, Example, Task, make_task, split_seed
from moe_rl.trainer.logging import jsonable

FORMAT_VERSION = 2
"""Bump when the training procedure changes so old cache entries stop matching (2: fixed build
threads, device type in the key, checksums in warmstart.json)."""

BUILD_THREADS = 2
"""torch CPU threads of every build, whatever the caller's: reductions split by thread count round
differently, so one key built on 1 and on 2 threads gave different weights (max |dw| 0.108 in a probe).
Any fixed count makes builds reproducible; 2 is the count the test suite runs with (tests/conftest.py),
whose 1-vs-2-process comparison (tests/integration/test_torchrun_data_parallel.py, atol 1e-4) holds from these weights and
missed by 1e-5 on 2 of 1024 elements from a 1-thread build."""

LR_BACKOFF = 0.5
"""Learning-rate factor applied at each rollback after an overshoot."""

META_FILE = "warmstart.json"


@dataclass
class WarmStartConfig:
    """Supervised warm start before RL (see the module docstring for the stopping rule)."""

    enabled: bool = True
    """Run the warm start before RL; when false RL starts from the config-built model."""
    target_low: float = 0.2
    """Lower edge of the held-out accuracy band: below it RL groups are mostly all-zero."""
    target_high: float = 0.6
    """Upper edge of the band: above it the task is mostly solved and RL has little left to learn."""
    max_steps: int = 2000
    """Most optimizer steps, including steps discarded by a rollback after an overshoot."""
    batch_size: int = 64
    """Demonstrations per optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate (halved at each rollback)."""
    eval_every: int = 25
    """Optimizer steps between held-out evaluations (1 after the first overshoot)."""
    eval_size: int = 128
    """Held-out eval-split examples per evaluation, sampled in one batch."""
    eval_temperature: float = 1.0
    """Sampling temperature of the accuracy check; 0 means greedy. Default 1.0, the RL temperature,
    because what RL needs is the success rate of its *samples*: greedy accuracy can be far higher."""
    cache_dir: str = "~/.cache/moe-rl/warmstart"
    """Where finished warm starts are kept (not part of the cache key)."""
    seed: int = 0
    """Seed of the held-out eval examples, fixed across run seeds so every run is judged on one set."""
    build_seed: int | None = None
    """None (default): each run seed builds (and caches) its own warm start, so seeds also vary the
    starting policy. An integer: every run starts from the warm start built with this seed, one policy
    shared by all run seeds (as every arm of the paper starts from one checkpoint); run seeds then vary
    only RL's sampling and shuffling, and one build serves a whole sweep. The cache key holds the seed
    used, not this field: build_seed=3 reuses the entry a run with seed=3 built."""
    pretrain_steps: int = 0
    """Optimizer steps of *pretraining* on the broad mixture (`moe_rl.tasks.BroadTask`: every task family
    at every difficulty) before the band search on the run's task, with load balancing on
    (`pretrain_aux_loss_coef`), so the routers start like a pretrained MoE's: trained on broad data,
    balanced. 0 (default) skips it: the warm start is the task-only one that published results used, and
    its cache keys are unchanged. Uses `batch_size` and `lr`; the band search then starts a fresh AdamW,
    as fine-tuning a pretrained checkpoint does (`moe_rl.pretrain`)."""
    pretrain_aux_loss_coef: float = 0.01
    """Load-balancing coefficient of pretraining only (the family's aux loss, transformers'
    load_balancing_loss_func). Separate from `model.router_aux_loss_coef`, which also enters the band
    search and every RL update: a pretrained MoE is balanced in pretraining whatever its fine-tuning
    does. 0.01 is Switch Transformer's and OLMoE's coefficient. Ignored (and not in the cache key) when
    `pretrain_steps` = 0."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not 0 <= self.target_low < self.target_high <= 1:
            raise ValueError(
                f"warmstart.target_low={self.target_low}, warmstart.target_high={self.target_high}: "
                "need 0 <= target_low < target_high <= 1"
            )
        for name in ("max_steps", "batch_size", "eval_every", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart.{name}={getattr(self, name)}: must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"warmstart.lr={self.lr}: must be > 0")
        if self.eval_temperature < 0:
            raise ValueError(f"warmstart.eval_temperature={self.eval_temperature}: must be >= 0 (0 = greedy)")
        if not self.cache_dir:
            raise ValueError("warmstart.cache_dir is empty: give a directory for finished warm starts")
        if self.seed < 0:
            raise ValueError(f"warmstart.seed={self.seed}: must be >= 0")
        if self.build_seed is not None and self.build_seed < 0:
            raise ValueError(f"warmstart.build_seed={self.build_seed}: must be >= 0 or null")
        if self.pretrain_steps < 0:
            raise ValueError(f"warmstart.pretrain_steps={self.pretrain_steps}: must be >= 0 (0 = no pretraining)")
        if not self.pretrain_aux_loss_coef >= 0:
            raise ValueError(f"warmstart.pretrain_aux_loss_coef={self.pretrain_aux_loss_coef}: must be >= 0")


@dataclass
class WarmStartResult:
    """A finished warm start.

    path: directory loadable by `build_model(ModelConfig(pretrained=path))` and `AutoTokenizer.from_pretrained`.
    accuracy: held-out accuracy of the saved model (eval split, `eval_size` examples, eval temperature).
    steps: optimizer steps in the saved model's history (rolled-back steps excluded).
    cached: True when the result was loaded from the cache rather than trained by this call.
    seconds: wall time of this call, lock wait included.
    """

    path: str
    accuracy: float
    steps: int
    cached: bool
    seconds: float


def cache_key(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    *,
    device: str = "cpu",
    mix: Sequence[int] = (),
    data: dict[str, Any] | None = None,
) -> str:
    """sha256 hex digest of a canonical JSON of everything that determines the warm-started weights.

    The device type (cpu, cuda) is part of it: kernels differ, so do the weights. The thread count is
    not: builds run on BUILD_THREADS threads whatever the caller's setting. A non-empty `mix` (task.mix,
    order and repeats included: both change the draws) is; an empty one adds nothing, so the keys of
    single-difficulty entries are those they had before task.mix existed. Likewise the pretraining fields
    enter only when `pretrain_steps` > 0, the model's tokenizer fields only when it is not char, and
    `data` (a dataset task's `identity()`: its rows' hash and the settings that shape them) only when given.
    """
    ws = asdict(ws_cfg)
    del ws["cache_dir"], ws["build_seed"]  # where it is kept; which seed builds it is `seed` below
    if ws_cfg.pretrain_steps == 0:  # no pretraining: the keys entries had before it existed
        del ws["pretrain_steps"], ws["pretrain_aux_loss_coef"]
    model = asdict(model_cfg)
    del model["tokenizer_cache_dir"]  # where it is kept
    if model_cfg.tokenizer == "char":  # the tokenizer every entry had before model.tokenizer existed
        del model["tokenizer"], model["bpe_vocab_size"]
    payload = dict(
        format=FORMAT_VERSION,
        device=torch.device(device).type,
        model=model,
        task=task_name,
        difficulty=difficulty,
        warmstart=ws,
        seed=seed,
        max_new_tokens=max_new_tokens,
        **({"mix": list(mix)} if mix else {}),
        **({"data": data} if data is not None else {}),
    )
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def answer_ids(tokenizer: PreTrainedTokenizerBase, task: Task, example: Example) -> list[int]:
    """The canonical answer as the sampler ends a response: the tokens of `task.solve(example)` (no
    special tokens), then EOS. The warm start's demonstrations and `eval/expected_accuracy` both use it."""
    return tokenizer(task.solve(example), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def demonstration_batch(
    tokenizer: PreTrainedTokenizerBase, task: Task, examples: list[Example]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `(input_ids_BS, attention_mask_BS, labels_BS)` of prompt + `answer_ids` (EOS included).

    labels are the input ids on response tokens (EOS included) and -100 on prompt and padding, so the
    loss is on what the policy must generate, never on the prompt it is given.
    """
    rows, n_prompt = [], []
    for ex in examples:
        prompt_ids = tokenizer(ex.prompt)["input_ids"]
        rows.append(prompt_ids + answer_ids(tokenizer, task, ex))
        n_prompt.append(len(prompt_ids))
    S = max(len(r) for r in rows)
    input_ids_BS = torch.full((len(rows), S), tokenizer.pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros(len(rows), S, dtype=torch.long)
    labels_BS = torch.full((len(rows), S), -100, dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, n_prompt, strict=True)):
        input_ids_BS[i, : len(row)] = torch.tensor(row)
        mask_BS[i, : len(row)] = 1
        labels_BS[i, p : len(row)] = input_ids_BS[i, p : len(row)]
    return input_ids_BS, mask_BS, labels_BS


def demonstration_loss(
    model: PreTrainedModel,
    input_ids_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    aux_coef: float | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens of the whole batch (token-level mean), plus
    `aux_coef` x the family's load-balancing loss when it is > 0; `aux_coef` None means the model
    config's `router_aux_loss_coef` (pretraining passes its own, `warmstart.pretrain_aux_loss_coef`)."""
    if aux_coef is None:
        aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0
    out = model(
        input_ids=input_ids_BS[:, :-1],
        attention_mask=mask_BS[:, :-1],
        position_ids=position_ids_from_mask(mask_BS[:, :-1]),
        use_cache=False,
        **({"output_router_logits": True} if aux_coef > 0 else {}),
    )
    logits_BSV = out.logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits_BSV.flatten(0, 1), labels_BS[:, 1:].flatten(), ignore_index=-100
    )
    return loss + aux_coef * out.aux_loss if aux_coef > 0 else loss


@torch.no_grad()
def heldout_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    sampler_cfg: SamplerConfig,
    generator_seed: int,
) -> float:
    """Mean reward of one sampled response per example, in one batch, from a freshly seeded generator.

    Reseeding at every call uses the same random numbers for every checkpoint, so accuracy changes
    between evaluations reflect the weights rather than sampling noise.
    """
    was_training = model.training
    model.eval()
    rollout = sample(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        sampler_cfg,
        generator=torch.Generator(device=next(model.parameters()).device).manual_seed(generator_seed),
    )
    model.train(was_training)
    return sum(task.reward(ex, text) for ex, text in zip(examples, rollout.texts, strict=True)) / len(
        examples
    )


@dataclass
class _Snapshot:
    """Model and optimizer state at one evaluation, to roll back to or to return."""

    accuracy: float
    steps: int
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]


def _snapshot(model: PreTrainedModel, optim: torch.optim.Optimizer, accuracy: float, steps: int) -> _Snapshot:
    model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _Snapshot(accuracy, steps, model_state, copy.deepcopy(optim.state_dict()))


def _restore(model: PreTrainedModel, optim: torch.optim.Optimizer, snap: _Snapshot, lr: float) -> None:
    model.load_state_dict(snap.model_state)
    optim.load_state_dict(copy.deepcopy(snap.optim_state))
    for group in optim.param_groups:
        group["lr"] = lr


def _postfix(steps: int, loss: float, accuracy: float, lr: float, band: tuple[float, float]) -> dict[str, str]:
    """Progress-bar fields: steps of the current weights, last training loss, last held-out accuracy
    against the target band it must land in, lr."""
    shown = f"{loss:.3f}" if math.isfinite(loss) else "–"  # no training step yet: no loss to show
    return dict(step=str(steps), loss=shown, acc=f"{accuracy:.3f}", target=f"[{band[0]:g}, {band[1]:g}]",
                lr=f"{lr:.1e}")


def _train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    progress: bool,
) -> tuple[float, int, dict[str, Any]]:
    """Train `model` in place until held-out accuracy is in the band; return (accuracy, steps, stats)."""
    low, high = ws_cfg.target_low, ws_cfg.target_high
    train_rng = random.Random(split_seed("train", seed))  # one fresh stream, never replayed after a rollback
    eval_examples = task.examples("eval", ws_cfg.eval_size, ws_cfg.seed)
    sampler_cfg = SamplerConfig(temperature=ws_cfg.eval_temperature, max_new_tokens=max_new_tokens)
    device = next(model.parameters()).device
    optim = torch.optim.AdamW(model.parameters(), lr=ws_cfg.lr)
    lr, eval_every, steps, steps_total, rollbacks, loss = ws_cfg.lr, ws_cfg.eval_every, 0, 0, 0, float("nan")
    below: _Snapshot | None = None  # last evaluation below the band
    above: _Snapshot | None = None  # overshoot closest to the band, returned only if the budget runs out
    history: list[dict[str, float]] = []
    # The bar's total is the budget; a build usually stops well before it (sort_long: ~500 of 2000 steps).
    desc = f"warm start {task.name} (once, then cached)"
    with tqdm(total=ws_cfg.max_steps, desc=desc, unit="step", disable=not progress) as bar:
        while True:
            bar.set_description(f"{desc}: held-out eval", refresh=True)  # minutes on a slow machine
            accuracy = heldout_accuracy(model, tokenizer, task, eval_examples, sampler_cfg, seed)
            bar.set_description(desc, refresh=False)
            history.append(dict(step=steps, steps_total=steps_total, accuracy=accuracy, lr=lr, loss=loss))
            bar.set_postfix(_postfix(steps, loss, accuracy, lr, (low, high)))
            if low <= accuracy <= high:
                break
            if accuracy < low:
                below = _snapshot(model, optim, accuracy, steps)
            else:
                if above is None or accuracy < above.accuracy:
                    above = _snapshot(model, optim, accuracy, steps)
                if below is None:
                    break  # above the band before any training: there is nothing to roll back to
                lr, eval_every, rollbacks = lr * LR_BACKOFF, 1, rollbacks + 1
                _restore(model, optim, below, lr)
                steps = below.steps
            if steps_total >= ws_cfg.max_steps:
                break
            model.train()
            for _ in range(min(eval_every, ws_cfg.max_steps - steps_total)):
                batch = demonstration_batch(
                    tokenizer, task, [task.sample(train_rng) for _ in range(ws_cfg.batch_size)]
                )
                loss_t = demonstration_loss(model, *(t.to(device) for t in batch))
                optim.zero_grad(set_to_none=True)
                loss_t.backward()
                optim.step()
                loss, steps, steps_total = loss_t.item(), steps + 1, steps_total + 1
                bar.set_postfix(_postfix(steps, loss, accuracy, lr, (low, high)), refresh=False)
                bar.update(1)
            model.eval()
    if not low <= accuracy <= high:
        if above is None:
            raise RuntimeError(
                f"warm start of {task!r} did not reach held-out accuracy {low} within warmstart.max_steps="
                f"{ws_cfg.max_steps} (last accuracy {accuracy:.3f} after {steps} steps); raise "
                "warmstart.max_steps or warmstart.lr, or lower warmstart.target_low"
            )
        _restore(model, optim, above, lr)
        accuracy, steps = above.accuracy, above.steps
        warnings.warn(
            f"warm start of {task!r} overshot the band [{low}, {high}] and ran out of warmstart.max_steps="
            f"{ws_cfg.max_steps}; using the closest model above the band (accuracy {accuracy:.3f})",
            RuntimeWarning,
            stacklevel=3,
        )
    return accuracy, steps, dict(steps_total=steps_total, rollbacks=rollbacks, history=history)


def _checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file of an entry except warmstart.json, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != META_FILE
    }


def _verified_meta(final: Path, warn: bool = False) -> dict[str, Any] | None:
    """The entry's warmstart.json if the entry is complete and every file matches its checksum; else None
    (with `warn`, a warning that a corrupt entry will be rebuilt)."""
    if not final.is_dir():
        return None
    try:
        meta = json.loads((final / META_FILE).read_text())
        ok = meta.get("format") == FORMAT_VERSION and meta["sha256"] == _checksums(final)
        ok = ok and isinstance(meta["accuracy"], float | int) and isinstance(meta["steps"], int)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if ok:
        return meta
    if warn:
        warnings.warn(f"warm-start cache entry {final} is corrupt or incomplete: rebuilding it", RuntimeWarning, stacklevel=3)
    return None


def _acquire(lock_path: Path) -> FileLock:
    """An exclusive lock on `lock_path` (released by the OS if the process dies). A lock file removed by
    a failed builder while we waited is a stale lock: take a fresh one."""
    while True:
        lock = FileLock(lock_path)
        lock.acquire()
        if lock_path.exists():
            return lock
        lock.release()


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (e.g. "Writing model shards") when progress=False."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build(
    final: Path,
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    max_new_tokens: int,
    key: str,
    device: str,
    progress: bool,
    mix: Sequence[int],
    task: Task,
) -> tuple[float, int]:
    """Train, then save into a temporary sibling of `final` and rename it into place; return (accuracy, steps)."""
    start = time.perf_counter()
    if model_cfg.pretrained:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.pretrained)
    else:
        tokenizer = policy_tokenizer(model_cfg, task)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model = build_model(model_cfg, tokenizer).to(device)
            pre_stats = {}
            if ws_cfg.pretrain_steps > 0:
                from moe_rl.pretrain import pretrain  # imported here: it uses this module's demonstrations

                pre_stats = pretrain(model, tokenizer, ws_cfg, seed, progress)
            accuracy, steps, stats = _train(model, tokenizer, task, ws_cfg, seed, max_new_tokens, progress)
            stats.update(pre_stats)
    finally:
        torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        with _hf_progress_bars(progress):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = dict(
            format=FORMAT_VERSION,
            key=key,
            accuracy=accuracy,
            steps=steps,
            seconds=time.perf_counter() - start,
            task=task_name,
            difficulty=difficulty,
            mix=list(mix),
            data=_identity(task),
            seed=seed,
            max_new_tokens=max_new_tokens,
            model=asdict(model_cfg),
            warmstart=asdict(ws_cfg),
            device=torch.device(device).type,
            build_threads=BUILD_THREADS,
            sha256=_checksums(tmp),
            **stats,
        )
        # Strict JSON (the first history entry's loss, before any step, is NaN: written "nan", as every run file)
        (tmp / META_FILE).write_text(json.dumps(jsonable(meta), indent=2, allow_nan=False))
        os.replace(tmp, final)  # atomic: the final name never holds a half-written directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return accuracy, steps


def _identity(task: Task) -> dict[str, Any] | None:
    """A dataset task's part of the cache key (its rows and settings); None for a synthetic task."""
    return task.identity() if isinstance(task, DatasetTask) else None


def warm_start_dir(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    *,
    max_new_tokens: int | None = None,
    device: str = "cpu",
    mix: Sequence[int] = (),
    task: Task | None = None,
) -> Path:
    """The cache directory `<cache_dir>/<task>-<key[:16]>` of a warm start (its lock is `<dir>.lock`)."""
    task = task if task is not None else make_task(task_name, difficulty, mix)
    if max_new_tokens is None:
        max_new_tokens = task.max_response_len + 1
    key = cache_key(model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, device=device, mix=mix,
                    data=_identity(task))
    return Path(ws_cfg.cache_dir).expanduser().resolve() / f"{task_name}-{key[:16]}"


def warm_start(
    model_cfg: ModelConfig,
    task_name: str,
    difficulty: int,
    ws_cfg: WarmStartConfig,
    seed: int,
    *,
    max_new_tokens: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    mix: Sequence[int] = (),
    task: Task | None = None,
) -> WarmStartResult:
    """Return a cached warm-started checkpoint for this configuration, training it first if needed.

    max_new_tokens: response limit of the accuracy check; default `task.max_response_len + 1` (EOS).
    Pass the RL sampler's value so the band is measured as RL will sample.
    device: where training runs; its type (cpu, cuda) is part of the cache key.
    mix: task.mix, the difficulties examples are drawn at (empty: `difficulty` only); part of the key.
    task: the built task (a `DatasetTask`, whose rows and settings enter the key); default
    `make_task(task_name, difficulty, mix)`.
    Raises ValueError for a bad config and RuntimeError when accuracy never reaches target_low.
    """
    start = time.perf_counter()
    ws_cfg.validate()
    model_cfg.validate()
    if not ws_cfg.enabled:
        raise ValueError("warmstart.enabled=false: the caller should skip the warm start")
    if seed < 0:
        raise ValueError(
            f"seed={seed}: the run seed must be >= 0 (it seeds the train split's example stream)"
        )
    task = task if task is not None else make_task(task_name, difficulty, mix)
    if max_new_tokens is None:
        max_new_tokens = task.max_response_len + 1
    final = warm_start_dir(
        model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens=max_new_tokens, device=device, mix=mix,
        task=task,
    )
    # A finished entry never changes: a valid one is read without the lock (a read-only cache works).
    meta = _verified_meta(final)
    if meta is not None:
        return WarmStartResult(str(final), meta["accuracy"], meta["steps"], True, time.perf_counter() - start)
    lock_path = Path(f"{final}.lock")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = _acquire(lock_path)
    except OSError as err:
        raise RunError(
            f"warm-start cache {final.parent} is not writable ({err.strerror or err}) and holds no valid "
            "entry for this config: set warmstart.cache_dir to a writable folder"
        ) from err
    try:
        meta = _verified_meta(final, warn=True)  # another process may have built it while we waited
        cached = meta is not None
        if cached:
            accuracy, steps = meta["accuracy"], meta["steps"]
        else:
            # Holding the lock, no one else builds this key: leftovers are from a crashed builder.
            for stale in final.parent.glob(f".{final.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            key = cache_key(
                model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, device=device, mix=mix,
                data=_identity(task),
            )
            try:
                accuracy, steps = _build(
                    final, model_cfg, task_name, difficulty, ws_cfg, seed, max_new_tokens, key, device,
                    progress, mix, task,
                )
            except BaseException:
                lock_path.unlink(missing_ok=True)  # no entry: leave no lock file behind either
                raise
    finally:
        lock.release()
    return WarmStartResult(str(final), accuracy, steps, cached, time.perf_counter() - start)
