"""Tokenizers of models built from config, built offline as real `PreTrainedTokenizerFast`s.

char (`build_tokenizer`): every character of the alphabet is one token; `<pad>`, `<bos>`, `<eos>` and
`<unk>` come first. It uses a BPE model with no merges (so a string splits into its characters) and a
`Fuse` decoder (so decoding joins them back without spaces).

bpe (`bpe_tokenizer`): a byte-level BPE trained with `tokenizers` on a corpus (the dataset task's
training text), the same four special tokens first. Training is deterministic, and the result is cached
as `<model.tokenizer_cache_dir>/bpe-<key[:16]>/tokenizer.json`, `key` the sha256 of the corpus, the
vocabulary size and BPE_FORMAT, so a run and its resume, or two runs on one dataset, share one tokenizer.
A `tokenizer.json.sha256` beside it holds the file's sha256; an entry whose checksum is missing or does not
match (a truncated or garbled file) is rebuilt, with a warning naming it, as the warm-start cache does.

Both prepend `<bos>` when encoding and pad on the left, as batched sampling needs; the caller appends
`<eos>` to demonstrations. `policy_tokenizer` picks one for a model config and a task.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.errors import RunError

if TYPE_CHECKING:
    from moe_rl.models.config import ModelConfig
    from moe_rl.tasks import Task

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
BPE_FORMAT = 1
"""Bump when the BPE's construction changes, so cached tokenizers stop matching."""


def build_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """Character tokenizer over `alphabet` (default: every task's `moe_rl.tasks.ALPHABET`).

    Encoding prepends `<bos>`; the caller appends `<eos>` to demonstrations.
    """
    if alphabet is None:
        from moe_rl.tasks import ALPHABET

        alphabet = ALPHABET
    chars = list(dict.fromkeys(alphabet))  # de-duplicate, keep order
    if not chars:
        raise ValueError("tokenizer alphabet is empty")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return _wrap(core)


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    """`core` with `<bos>` prepended on encoding, as a left-padding `PreTrainedTokenizerFast`."""
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", core.token_to_id("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def train_bpe(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over `corpus` with at most `vocab_size` tokens, the special tokens at ids 0..3."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    return core


def bpe_tokenizer(corpus: list[str], vocab_size: int, cache_dir: str) -> PreTrainedTokenizerFast:
    """The byte-level BPE of `corpus` (`train_bpe`), trained once and then read from the cache."""
    digest = hashlib.sha256(json.dumps([BPE_FORMAT, vocab_size, SPECIAL_TOKENS]).encode())
    for text in corpus:
        digest.update(text.encode() + b"\0")
    path = Path(cache_dir).expanduser() / f"bpe-{digest.hexdigest()[:16]}" / "tokenizer.json"
    checksum = path.with_name("tokenizer.json.sha256")
    if path.is_file():
        problem = _cache_problem(path, checksum)
        if problem is None:
            return _wrap(Tokenizer.from_file(str(path)))
        warnings.warn(f"tokenizer cache entry {path.parent} {problem}: rebuilding it", RuntimeWarning, stacklevel=2)
    core = train_bpe(corpus, vocab_size)
    try:  # written under temporary names and renamed, checksum last: a reader never trusts half an entry
        path.parent.mkdir(parents=True, exist_ok=True)
        checksum.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer.json.tmp-")
        os.close(fd)
        try:
            core.save(tmp)
            os.replace(tmp, path)
            Path(tmp).write_text(_sha256(path))
            os.replace(tmp, checksum)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as err:
        raise RunError(
            f"tokenizer cache {path.parent} is not writable ({err.strerror or err}): set "
            "model.tokenizer_cache_dir to a writable folder"
        ) from err
    return _wrap(core)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cache_problem(path: Path, checksum: Path) -> str | None:
    """Why a cached tokenizer.json cannot be trusted (no checksum, a checksum mismatch, unreadable), or None."""
    if not checksum.is_file():
        return "has no checksum (written by an older moe-rl, or interrupted)"
    if checksum.read_text().strip() != _sha256(path):
        return "is corrupt (checksum mismatch: truncated or overwritten)"
    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own exception type
        return f"does not load ({type(err).__name__})"
    return None


def policy_tokenizer(model_cfg: ModelConfig, task: Task) -> PreTrainedTokenizerFast:
    """The tokenizer of a model built from `model_cfg` for `task`: char over `task.alphabet` (for a
    synthetic task exactly `build_tokenizer()`), or bpe trained on the dataset task's `corpus()`."""
    if model_cfg.tokenizer == "bpe":
        assert hasattr(task, "corpus"), "model.tokenizer=bpe is validated to need task=dataset"
        return bpe_tokenizer(task.corpus(), model_cfg.bpe_vocab_size, model_cfg.tokenizer_cache_dir)
    return build_tokenizer(task.alphabet)
