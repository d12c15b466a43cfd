"""Start-up checks: those that read files, build the task or look at the machine, above the schema.

`moe_rl.config` is the schema alone: its `validate` methods read only the config. What needs more runs
here, once, before any compute, each failure a ValueError naming the field to change:

- `check_config`: `Config.validate`, then a `model.pretrained` folder's files (`check_pretrained`) and
  the longest answer of a synthetic task against `sampler.max_new_tokens`;
- `check_machine`: trainer.device=cuda on a machine without CUDA;
- `load_task`: the run's task, built (a dataset loads its rows, verifier and reward function), and a
  dataset checked against the rest of the config (`check_dataset_run`);
- `check_world` and `check_launch`: what the number of processes under torchrun allows;
- `check_chat_template`: task.chat_template=true with a tokenizer that has no chat template.

The entry points (moe_rl.train, moe_rl.calibrate) call them; so does `moe_rl.trainer.run`, which every
rank enters under torchrun.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from moe_rl.config import Config, TrainerConfig
from moe_rl.errors import LaunchError
from moe_rl.models.tokenizer import policy_tokenizer
from moe_rl.rollout.engines import check_engine_launch
from moe_rl.tasks import DATASET, DatasetTask, Task, build_task, make_task
from moe_rl.tasks.dataset import WARMSTART_PROBE_ROWS
from moe_rl.warmstart.demos import answer_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_config(cfg: Config) -> None:
    """`cfg.validate()`, then the checks that read files or build the task: a `model.pretrained` folder
    (`check_pretrained`) and, for a synthetic task, room in `sampler.max_new_tokens` for its longest
    answer (a dataset's answers are known once it is loaded: `load_task`)."""
    cfg.validate()
    check_pretrained(cfg.model.pretrained)
    if cfg.task.name == DATASET:
        return
    longest = make_task(cfg.task.name, cfg.task.difficulty, cfg.task.mix).max_response_len + 1  # + EOS
    if cfg.sampler.max_new_tokens < longest:
        where = f"task.mix={cfg.task.mix}" if cfg.task.mix else f"difficulty {cfg.task.difficulty}"
        raise ValueError(
            f"sampler.max_new_tokens={cfg.sampler.max_new_tokens} is shorter than the longest "
            f"answer of task {cfg.task.name} at {where} ({longest} tokens with EOS)"
        )


def check_machine(cfg: Config) -> None:
    """Raise ValueError naming the field when this machine cannot run the config (trainer.device=cuda
    without CUDA). Separate from `check_config`: configs for GPU machines still compose and validate anywhere."""
    device = cfg.trainer.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={device!r}: CUDA is not available on this machine; use cpu")


def load_task(cfg: Config) -> Task:
    """The run's task, built (a dataset loads its rows, verifier and reward function) and checked against
    the rest of the config; ValueError naming the field. The entry point calls it at start-up, so bad
    data stops the run in one line before anything is written; the trainer calls it for the run's task."""
    task = build_task(cfg.task)
    if not isinstance(task, DatasetTask):
        return task
    check_dataset_run(task, cfg)
    return task


def check_world(t: TrainerConfig, world: int) -> None:
    """Raise ValueError when the step's batch cannot be split evenly over `world` ranks."""
    if world == 1:
        return
    if t.prompts_per_step % world:
        raise LaunchError(
            f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by the {world} processes: "
            "each rank samples an equal share of whole prompt groups"
        )
    if t.group_minibatches and (t.prompts_per_step // world) % t.mini_batches:
        raise LaunchError(
            f"trainer.group_minibatches=true: trainer.mini_batches={t.mini_batches} does not divide each "
            f"rank's prompts, prompts_per_step / processes = {t.prompts_per_step // world}"
        )
    if (t.prompts_per_step * t.group_size // world) % t.mini_batches:
        raise LaunchError(
            f"trainer.mini_batches={t.mini_batches} does not divide each rank's rows "
            f"prompts_per_step * group_size / processes = {t.prompts_per_step * t.group_size // world}"
        )
    if t.parallel == "fsdp" and t.sampler_dtype is not None:
        raise LaunchError(
            "trainer.sampler_dtype is not available with trainer.parallel=fsdp (a sharded policy)"
        )


def check_launch(cfg: Config, world: int) -> None:
    """What `world` processes allow beyond `check_world`: vLLM (installed), an overlapped
    sampler (one process) and FSDP's
    low-precision shards (no master weights). Before the warm start: a missing extra or launcher fails at once."""
    check_engine_launch(cfg.sampler.engine, cfg.sampler.tensor_parallel_size, world)  # its package installed, its tensor parallelism dividing the processes
    if cfg.rollout.overlap and world > 1:
        raise LaunchError(
            f"rollout.overlap=true runs its background sampler in one process, not under torchrun with {world}: "
            "set rollout.overlap=false (deterministic staleness works under torchrun)"
        )
    t = cfg.trainer
    sharded = world > 1 and t.parallel == "fsdp"
    if sharded and t.master_weights and cfg.model.dtype in ("bfloat16", "float16"):
        raise LaunchError(
            "trainer.master_weights=true is not supported with trainer.parallel=fsdp: set "
            "trainer.master_weights=false (FSDP2 keeps its shards in model.dtype)"
        )


def check_chat_template(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """task.chat_template=true needs the policy's tokenizer (known once it is loaded) to have a template."""
    if cfg.task.chat_template and not tokenizer.chat_template:
        raise ValueError(
            f"task.chat_template=true, but the tokenizer of {cfg.model.pretrained or 'the built model'} has no "
            "chat template: set task.chat_template=false"
        )


def check_dataset_run(task: DatasetTask, cfg: Config) -> None:
    """Enough held-out rows for eval (or, under eval.fit_heldout, a note that eval uses all of them) and the
    warm start; prompts that fit the model (check_prompt_lengths); with the warm start on, answers the reward gives
    full marks as responses (they are its demonstrations), and a warning when some are longer than the
    sampler can write (a model built from config: its tokenizer is known here)."""
    held = len(task.heldout_rows)
    fitted = cfg.eval.fitted(held)
    if fitted != cfg.eval:
        warnings.warn(
            f"task.heldout={cfg.task.heldout} holds out {held} of {cfg.task.path}'s {len(task.rows)} rows, fewer than "
            f"eval.size={cfg.eval.size} / eval.expected_size={cfg.eval.expected_size}: evaluating on all {held} "
            "(eval.fit_heldout=true; raise task.heldout for more)",
            RuntimeWarning,
            stacklevel=3,
        )
    needs = {
        "eval.size / eval.expected_size": fitted.prompts_needed,
        "warmstart.eval_size": cfg.warmstart.eval_size if cfg.warmstart.enabled else 0,
    }
    for name, n in needs.items():
        if n > held:
            raise ValueError(
                f"{name}: {n} held-out rows are needed, but task.heldout={cfg.task.heldout} holds out {held} "
                f"of {cfg.task.path}'s {len(task.rows)} rows: lower {name.split(' ')[0]} or raise task.heldout"
            )
    check_prompt_lengths(task, cfg)
    if not cfg.warmstart.enabled:
        return
    rows = task.train_rows[:WARMSTART_PROBE_ROWS]
    scores, _ = task.rewards([task.row_example(r) for r in rows], [task.answers[r] for r in rows])
    bad = [(r, v) for r, v in zip(rows, scores, strict=True) if v != 1.0]
    if bad:
        row, value = bad[0]
        raise ValueError(
            f"warmstart.enabled=true trains on task.answer_field as the response, but it scores {value} "
            f"as a response on row {row} ({task.answers[row][:60]!r}): the answers are not full responses "
            "the reward accepts; set warmstart.enabled=false"
        )
    if cfg.model.pretrained:
        return
    tokenizer = policy_tokenizer(cfg.model, task)
    lengths = [len(answer_ids(tokenizer, task, task.row_example(r))) for r in task.train_rows]
    over = sum(n > cfg.sampler.max_new_tokens for n in lengths)
    if over:
        warnings.warn(
            f"{over} of {len(lengths)} training answers are longer than sampler.max_new_tokens="
            f"{cfg.sampler.max_new_tokens} tokens (the longest: {max(lengths)} with EOS): the warm start "
            "imitates them, but the sampler cuts them off",
            RuntimeWarning,
            stacklevel=3,
        )


def check_prompt_lengths(task: DatasetTask, cfg: Config) -> None:
    """Every prompt's tokens plus sampler.max_new_tokens must fit the model's positions; ValueError naming the
    longest row (else the first forward fails with a giant allocation). Checked for a model built from config
    (model.max_position_embeddings, its own tokenizer) and for a local model.pretrained folder (its
    config.json and tokenizer); a hub id is not fetched for it. task.max_prompt_tokens is applied first,
    with the same tokenizer (`_cap_prompts`)."""
    if cfg.model.pretrained:
        folder = Path(cfg.model.pretrained).expanduser()
        if not (folder / "config.json").is_file():
            return
        from transformers import AutoTokenizer  # a second's import, for a local pretrained folder only

        limit = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
        tokenizer, where = AutoTokenizer.from_pretrained(str(folder)), f"{folder}'s max_position_embeddings"
    else:
        tokenizer, limit = policy_tokenizer(cfg.model, task), cfg.model.max_position_embeddings
        where = "model.max_position_embeddings"
    if cfg.task.max_prompt_tokens is not None:
        _cap_prompts(task, tokenizer, cfg.task.max_prompt_tokens, cfg.task.prompt_overflow)
    if not isinstance(limit, int):
        return
    room = limit - cfg.sampler.max_new_tokens
    # A character is at most 4 tokens (byte-level BPE on a 4-byte UTF-8 character), plus a few special tokens:
    # only prompts that could overflow are tokenized.
    suspects = [r for r, text in enumerate(task.prompts) if 4 * len(text) + 8 > room]
    lengths = {r: len(tokenizer(task.prompts[r]).input_ids) for r in suspects}
    over = [r for r, n in lengths.items() if n > room]
    if over:
        longest = max(over, key=lengths.__getitem__)
        raise ValueError(
            f"task.path={cfg.task.path}: {len(over)} of {len(task.prompts)} prompts do not fit the model: row "
            f"{longest}'s prompt is {lengths[longest]} tokens, and with sampler.max_new_tokens="
            f"{cfg.sampler.max_new_tokens} that is {lengths[longest] + cfg.sampler.max_new_tokens} positions, "
            f"more than {where}={limit}: shorten or drop those rows, or lower sampler.max_new_tokens"
        )


def _cap_prompts(task: DatasetTask, tokenizer, cap: int, overflow: str) -> None:
    """task.max_prompt_tokens: refuse the prompts over `cap` tokens (naming the longest) or cut them to their
    first `cap` tokens, decoded back to text, in place (a warning counts them)."""
    suspects = [r for r, text in enumerate(task.prompts) if 4 * len(text) + 8 > cap]
    ids = {r: tokenizer(task.prompts[r], add_special_tokens=False).input_ids for r in suspects}
    over = [r for r, tokens in ids.items() if len(tokens) > cap]
    if not over:
        return
    longest = max(over, key=lambda r: len(ids[r]))
    if overflow == "refuse":
        raise ValueError(
            f"task.max_prompt_tokens={cap}: {len(over)} of {len(task.prompts)} prompts of {task.cfg.path} are "
            f"longer (row {longest}: {len(ids[longest])} tokens): drop or shorten them, raise the limit, or set "
            "task.prompt_overflow=truncate"
        )
    for r in over:
        task.prompts[r] = tokenizer.decode(ids[r][:cap])
    warnings.warn(
        f"task.max_prompt_tokens={cap}: cut {len(over)} of {len(task.prompts)} prompts of {task.cfg.path} to their "
        f"first {cap} tokens (the longest, row {longest}, had {len(ids[longest])})",
        RuntimeWarning,
        stacklevel=3,
    )


def check_pretrained(pretrained: str | None) -> None:
    """A `model.pretrained` that names a local folder must exist and hold a model: a config.json that is
    a JSON object naming its `model_type`, and safetensors weights whose headers read. Anything else that
    looks like a path (absolute, ./, ../, ~) but is no folder is refused too. (A hub id is checked when
    it loads: `moe_rl.models.build_model` reports a failed load in one line.)"""
    if not pretrained:
        return
    path = Path(pretrained).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"model.pretrained={pretrained}: the folder holds no model (no config.json)")
        try:
            model_type = json.loads(config.read_text(errors="replace")).get("model_type")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"model.pretrained={pretrained}: {config} is not a JSON object") from None
        if not model_type:
            raise ValueError(f"model.pretrained={pretrained}: {config} names no model_type")
        for weights in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(weights), framework="pt"):
                    pass
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(
                    f"model.pretrained={pretrained}: {weights.name} is not a readable safetensors file "
                    f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'unreadable'})"
                ) from None
        return
    if path.exists() or pretrained.startswith(("/", "./", "../", "~", ".")):
        raise ValueError(f"model.pretrained={pretrained}: no such model folder")
