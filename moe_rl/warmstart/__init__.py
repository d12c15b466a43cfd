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
the broad mixture of every task family at every difficulty with load balancing (`moe_rl.warmstart.pretrain`), so the
band search fine-tunes a broadly trained, balanced MoE instead of a random one.

Seeds: `seed` (the run seed) seeds torch's RNG, the stream of training demonstrations (pretraining has
its own stream of the same seed) and the eval sampler's generator; `WarmStartConfig.seed` picks the
held-out eval examples. Model weights start from `model_cfg` as given (its own `seed` field).

The package, bottom to top (no module imports one above it): `config` (the schema's WarmStartConfig,
the result and the cache format's constants), `demos` (demonstrations, their loss, held-out accuracy),
`pretrain` and `search` (the band search with rollback), `cache` (keys, entry folders, checksums, the
lock), `build` (`warm_start`: a verified entry, or a build under the lock).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.lazy import lazy_attributes
from moe_rl.warmstart.config import BUILD_THREADS, FORMAT_VERSION, META_FILE, WarmStartConfig, WarmStartResult

if TYPE_CHECKING:
    from moe_rl.warmstart.build import warm_start
    from moe_rl.warmstart.cache import cache_key, warm_start_dir
    from moe_rl.warmstart.demos import answer_ids, demonstration_batch, demonstration_loss, heldout_accuracy
    from moe_rl.warmstart.search import LR_BACKOFF, band_search

_LAZY = {
    "warm_start": "moe_rl.warmstart.build",
    "cache_key": "moe_rl.warmstart.cache",
    "warm_start_dir": "moe_rl.warmstart.cache",
    "answer_ids": "moe_rl.warmstart.demos",
    "demonstration_batch": "moe_rl.warmstart.demos",
    "demonstration_loss": "moe_rl.warmstart.demos",
    "heldout_accuracy": "moe_rl.warmstart.demos",
    "LR_BACKOFF": "moe_rl.warmstart.search",
    "band_search": "moe_rl.warmstart.search",
}
"""Imported on first use (PEP 562): the build needs torch, and the schema (`config`, read by `moe_rl.config`)
needs none of it."""

__all__ = [
    "BUILD_THREADS",
    "FORMAT_VERSION",
    "LR_BACKOFF",
    "META_FILE",
    "WarmStartConfig",
    "WarmStartResult",
    "answer_ids",
    "band_search",
    "cache_key",
    "demonstration_batch",
    "demonstration_loss",
    "heldout_accuracy",
    "warm_start",
    "warm_start_dir",
]

__getattr__ = lazy_attributes(__name__, _LAZY)
