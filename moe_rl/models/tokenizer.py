"""A character-level tokenizer built offline as a real `PreTrainedTokenizerFast`.

Every character of the alphabet is one token; `<pad>`, `<bos>`, `<eos>` and `<unk>` come first.
It uses a BPE model with no merges (so a string splits into its characters) and a `Fuse` decoder
(so decoding joins them back without spaces). Padding is on the left, as batched sampling needs.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


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
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
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
