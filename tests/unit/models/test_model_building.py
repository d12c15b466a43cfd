"""Model building, tokenizer and config validation."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_rl.models import ModelConfig, build_model, build_tokenizer
from moe_rl.tasks import ALPHABET
from tests.conftest import FAMILIES


def test_tokenizer_roundtrip_and_left_padding(tokenizer):
    """Every alphabet string encodes to one token per character after <bos> and decodes back; padding is left."""
    text = ALPHABET
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    batch = tokenizer(["12+3=", "1="], padding=True)
    assert batch["input_ids"][1][:3] == [tokenizer.pad_token_id] * 3
    assert batch["attention_mask"][1] == [0, 0, 0, 1, 1, 1]
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_build_every_family(tokenizer, family):
    """Each family builds a causal MoE LM sized to the tokenizer, deterministic in the seed."""
    cfg = ModelConfig(family=family, head_dim=None, num_layers=2)
    a, b = build_model(cfg, tokenizer), build_model(cfg, tokenizer)
    x = torch.randint(4, len(tokenizer), (2, 7))
    out = a(x)
    assert out.logits.shape == (2, 7, len(tokenizer))
    assert torch.equal(out.logits, b(x).logits)
    c = build_model(ModelConfig(family=family, head_dim=None, num_layers=2, seed=1), tokenizer)
    assert not torch.equal(out.logits, c(x).logits)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(top_k=9), "model.top_k"),
        (dict(hidden_size=130), "model.hidden_size"),
        (dict(family="llama"), "model.family"),
        (dict(num_heads=4, num_kv_heads=3), "model.num_heads"),
        (dict(experts_impl="magic"), "model.experts_impl"),
        (dict(dtype="float64"), "model.experts_impl=eager"),
        (dict(family="mixtral", norm_topk_prob=False), "model.norm_topk_prob"),
        (dict(num_layers=0), "model.num_layers"),
        (dict(dtype="int8"), "model.dtype"),
    ],
)
def test_invalid_config_names_field(tokenizer, overrides, field):
    """Invalid model configs raise ValueError naming the offending field."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_model(ModelConfig(**overrides), tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["grouped_mm"])
def test_experts_kernels_match_eager_loop(tokenizer, family, impl):
    """The default experts kernel reaches transformers and gives the eager loop's logits and parameter gradients."""
    cfg = ModelConfig(family=family, num_layers=2, head_dim=None)
    eager = build_model(replace(cfg, experts_impl="eager"), tokenizer)
    other = build_model(replace(cfg, experts_impl=impl), tokenizer)
    assert (eager.config._experts_implementation, other.config._experts_implementation) == ("eager", impl)
    x = torch.randint(4, len(tokenizer), (3, 9), generator=torch.Generator().manual_seed(1))
    out_eager, out_other = eager(x).logits, other(x).logits
    torch.testing.assert_close(out_other, out_eager, rtol=1e-4, atol=1e-5)
    w = torch.randn(out_eager.shape, generator=torch.Generator().manual_seed(0))
    (out_eager * w).sum().backward()
    (out_other * w).sum().backward()
    for (name, p_eager), p_other in zip(eager.named_parameters(), other.parameters(), strict=True):
        # float32 sums in another order: elementwise within 1e-5 of the gradient's own scale
        scale = float(p_eager.grad.abs().max())
        torch.testing.assert_close(p_other.grad, p_eager.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_save_and_from_pretrained(tmp_path, tokenizer):
    """A model and its tokenizer saved to disk load back through from_pretrained with identical outputs."""
    model = build_model(ModelConfig(num_layers=2), tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert tok2.padding_side == "left" and tok2("7+8=")["input_ids"] == tokenizer("7+8=")["input_ids"]
    loaded = build_model(ModelConfig(pretrained=str(tmp_path)))
    x = torch.tensor([tok2("12+34=")["input_ids"]])
    assert torch.equal(model(x).logits, loaded(x).logits)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is type(model)


def test_custom_alphabet_tokenizer():
    """A tokenizer over a custom alphabet maps unknown characters to <unk>."""
    tok = build_tokenizer("ab")
    assert len(tok) == 6
    assert tok("abz")["input_ids"][-1] == tok.unk_token_id
