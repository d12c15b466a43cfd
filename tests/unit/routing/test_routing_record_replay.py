"""Routing record/replay and routing metrics, for every MoE family."""

import pytest
import torch
import torch.nn.functional as F

from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout.sampler import cache_argument
from moe_rl.routing import (
    RoutingController,
    RoutingReplayError,
    RoutingTrace,
    expert_change_by_layer,
    expert_change_fraction,
    expert_load,
    router_entropy,
    token_change_fraction,
)
from tests.conftest import FAMILIES


def routing_model(tokenizer, family, **kw):
    return build_model(ModelConfig(family=family, head_dim=None, **kw), tokenizer)


def routing_tokens(tokenizer, B=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, len(tokenizer), (B, T), generator=g)


def _perturb_routers(ctl, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in ctl.routers:
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g, dtype=r.weight.dtype))


def reference_block(block, h_NH, ids_NK):
    """Independent MoE block: each token goes to ids_NK with gates softmax(W_r h)[ids], renormalised if the
    family does, through each expert's SwiGLU; plus the sigmoid-gated shared expert for Qwen2-MoE."""
    probs_NE = torch.softmax(F.linear(h_NH, block.gate.weight).double(), -1)
    gates_NK = probs_NE.gather(-1, ids_NK)
    if getattr(block.gate, "norm_topk_prob", True):
        gates_NK = gates_NK / gates_NK.sum(-1, keepdim=True)
    out = torch.zeros_like(h_NH, dtype=torch.float64)
    ex = block.experts
    for n in range(h_NH.shape[0]):
        for k in range(ids_NK.shape[1]):
            e = int(ids_NK[n, k])
            gate, up = (ex.gate_up_proj[e].double() @ h_NH[n].double()).chunk(2)
            out[n] += gates_NK[n, k] * (ex.down_proj[e].double() @ (F.silu(gate) * up))
    if hasattr(block, "shared_expert"):
        shared = block.shared_expert(h_NH).double()
        out += torch.sigmoid(block.shared_expert_gate(h_NH).double()) * shared
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_own_routing_is_exact(tokenizer, family):
    """Replaying a model's own recorded routing reproduces its logits bitwise."""
    model = routing_model(tokenizer, family)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer)
    with torch.no_grad(), ctl.record() as rec:
        ref = model(x).logits
    with torch.no_grad(), ctl.replay(rec.trace):
        out = model(x).logits
    assert torch.equal(ref, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_after_perturbation_routes_to_recorded_experts(tokenizer, family):
    """With perturbed routers, a replayed block matches an independent block using the recorded experts;
    a free forward routes differently."""
    model = routing_model(tokenizer, family)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    old = rec.trace
    _perturb_routers(ctl)
    block = model.model.layers[1].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach(), y=o.detach()))
    with torch.no_grad(), ctl.replay(old), ctl.record() as free:
        model(x)
    handle.remove()
    h_NH = seen["h"].reshape(-1, seen["h"].shape[-1])
    ids_NK = old.expert_ids[:, :, 1].reshape(h_NH.shape[0], -1).long()
    torch.testing.assert_close(
        seen["y"].reshape(h_NH.shape).double(), reference_block(block, h_NH, ids_NK), rtol=1e-4, atol=1e-5
    )
    assert expert_change_fraction(free.trace, old, torch.ones(x.shape, dtype=torch.bool)) > 0.05
    with torch.no_grad(), ctl.record() as fresh:
        model(x)
    assert not torch.equal(fresh.trace.expert_ids, old.expert_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_router_gradient_matches_finite_differences(tokenizer, family):
    """Under replay the router weight gets finite, non-zero gradients equal to float64 finite differences."""
    model = routing_model(tokenizer, family, num_layers=1, experts_impl="eager").double()  # grouped_mm has no float64
    block = model.model.layers[0].mlp
    ctl = RoutingController(block)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, model.config.hidden_size, generator=g, dtype=torch.float64)
    w = torch.randn(2, 5, model.config.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad(), ctl.record() as rec:
        block(h)
    trace = rec.trace
    _perturb_routers(ctl)

    def loss():
        with ctl.replay(trace):
            return (block(h) * w).sum()

    block.zero_grad()
    loss().backward()
    grad = block.gate.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    eps = 1e-6
    for e, j in [(0, 0), (3, 17), (7, 100), (int(trace.expert_ids[0, 0, 0, 0]), 5)]:
        with torch.no_grad():
            block.gate.weight[e, j] += eps
            up = loss().item()
            block.gate.weight[e, j] -= 2 * eps
            down = loss().item()
            block.gate.weight[e, j] += eps
        torch.testing.assert_close(grad[e, j].item(), (up - down) / (2 * eps), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_plus_decode_trace_equals_full_forward(tokenizer, family):
    """Recording a prefill then cached one-token decode steps gives the full forward's trace (fp32)."""
    model = routing_model(tokenizer, family)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, T=10)
    with torch.no_grad(), ctl.record(with_logits=True) as full:
        model(x)
    cache = cache_argument(model)  # `cache` from transformers 5.20, `past_key_values` before
    with torch.no_grad(), ctl.record(with_logits=True) as inc:
        out = model(x[:, :6], use_cache=True)
        for t in range(6, 10):
            out = model(x[:, t : t + 1], use_cache=True, **{cache: getattr(out, cache)})
    assert torch.equal(inc.trace.expert_ids, full.trace.expert_ids)
    torch.testing.assert_close(inc.trace.router_logits_BTLE, full.trace.router_logits_BTLE)


def test_replay_across_prefill_and_decode(tokenizer):
    """A trace replays across several forwards in order, consuming it along time."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, T=8)
    with torch.no_grad(), ctl.record() as rec:
        ref = model(x).logits
    cache = cache_argument(model)
    with torch.no_grad(), ctl.replay(rec.trace):
        out = model(x[:, :5], use_cache=True)
        last = model(x[:, 5:], use_cache=True, **{cache: getattr(out, cache)}).logits
    torch.testing.assert_close(last, ref[:, 5:])


def test_mismatched_or_missing_traces_raise(tokenizer):
    """Replay raises naming batch, length, layers or k when the trace does not fit, and never falls back."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=3, T=6)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    t = rec.trace
    cases = [
        (t.rows(slice(0, 2)), "batch"),
        (t.time(slice(0, 4)), "no token digest"),
        (RoutingTrace(t.expert_ids[:, :, :3], 8), "layers"),
        (RoutingTrace(t.expert_ids[..., :1], 8), "k=1"),
    ]
    for bad, msg in cases:
        with pytest.raises(RoutingReplayError, match=msg), torch.no_grad(), ctl.replay(bad):
            model(x)
    with pytest.raises(RoutingReplayError, match="length"), torch.no_grad(), ctl.replay(t):
        model(x[:, :4])
    with pytest.raises(RoutingReplayError), ctl.replay(None):
        pass
    with pytest.raises(RoutingReplayError, match="nothing left"), torch.no_grad(), ctl.replay(t):
        model(x)
        model(x[:, :1])


def test_misaligned_trace_raises_naming_rows(tokenizer):
    """A trace replayed on rows permuted differently from its inputs raises naming those rows; replayed on
    the same permutation of the inputs it replays."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=4, T=7)
    with torch.no_grad(), ctl.record() as rec:
        ref = model(x).logits
    perm = torch.tensor([2, 0, 1, 3])
    with pytest.raises(RoutingReplayError, match=r"rows \[0, 1, 2\] \(3 of 4\)"), torch.no_grad():
        with ctl.replay(rec.trace.rows(perm)):
            model(x)
    with torch.no_grad(), ctl.replay(rec.trace.rows(perm)):
        # Rows permuted: the same routing, summed in another order (grouped experts), so close, not bitwise.
        torch.testing.assert_close(model(x[perm]).logits, ref[perm])
    one_token_off = x.clone()
    one_token_off[3, 5] = (one_token_off[3, 5] + 1) % len(tokenizer)
    with pytest.raises(RoutingReplayError, match=r"rows \[3\]"), torch.no_grad(), ctl.replay(rec.trace):
        model(one_token_off)


def test_token_digest_is_additive_over_time_chunks():
    """The digest of a row equals the sum of its chunks' digests at their absolute offsets."""
    from moe_rl.routing import token_digest

    x = torch.randint(0, 50_000, (3, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(token_digest(x), token_digest(x[:, :4]) + token_digest(x[:, 4:], start=4))
    y = x.clone()
    y[1, 7] += 1
    assert (token_digest(x) != token_digest(y)).tolist() == [False, True, False]


def test_sigmoid_gated_router_is_refused(tokenizer):
    """A sigmoid-gated router (MiniMax-M2) fails at its first forward with UnsupportedRouterError naming it,
    whether or not a replay is open; the four supported families pass the same check."""
    import transformers

    from moe_rl.routing import UnsupportedRouterError

    cfg = transformers.MiniMaxM2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
        num_experts_per_tok=2, rotary_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.normal_(0, 1.0)  # logits far from 0, where sigmoid and softmax gates differ
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=2, T=5)
    with pytest.raises(UnsupportedRouterError, match="MiniMaxM2TopKRouter.*layer 0"):
        ctl.verify_gates(model, x)
    for family in FAMILIES:
        good = routing_model(tokenizer, family)
        RoutingController(good).verify_gates(good, x)


def test_replay_under_gradient_checkpointing(tokenizer):
    """Replay with gradient checkpointing gives the same loss and gradients as without, backward inside or after."""
    x = routing_tokens(tokenizer, B=2, T=8)
    grads = []
    for ckpt in (False, True):
        model = build_model(ModelConfig(gradient_checkpointing=ckpt), tokenizer).train()
        ctl = RoutingController(model)
        with torch.no_grad(), ctl.record() as rec:
            model(x)
        _perturb_routers(ctl)
        with ctl.replay(rec.trace):
            loss = model(x, labels=x).loss
        loss.backward()  # after replay() closed: the recompute must still use the replayed experts
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_output_router_logits_still_works(tokenizer):
    """Instrumented models still return router logits when asked, equal to the recorded ones."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer)
    with torch.no_grad(), ctl.record(with_logits=True) as rec:
        out = model(x, output_router_logits=True)
    assert len(out.router_logits) == ctl.num_layers
    torch.testing.assert_close(out.router_logits[2].reshape(3, 12, -1), rec.trace.router_logits_BTLE[:, :, 2])


def test_trace_dtype_slicing_and_bytes(tokenizer):
    """Traces use uint8 ids up to 256 experts, slice by rows and time, and report their bytes."""
    model = routing_model(tokenizer, "qwen3_moe", num_experts=16, top_k=4)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=4, T=5)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    t = rec.trace
    assert t.shape == (4, 5, 4, 4) and t.expert_ids.dtype == torch.uint8 and t.nbytes == 4 * 5 * 4 * 4
    assert torch.equal(t.rows([1, 3]).expert_ids, t.expert_ids[[1, 3]])
    assert t.time(slice(1, 3)).shape == (4, 2, 4, 4)
    assert torch.equal(RoutingTrace.cat([t.rows(slice(0, 2)), t.rows(slice(2, 4))]).expert_ids, t.expert_ids)


def test_expert_change_fraction_matches_hand_computation():
    """expert_change_fraction = mean over valid tokens and layers of 1 - |A∩B|/K, by hand."""
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]]], dtype=torch.uint8)
    b = torch.tensor([[[[1, 0], [2, 4]], [[5, 6], [0, 1]], [[7, 6], [7, 6]]]], dtype=torch.uint8)
    mask = torch.tensor([[True, True, False]])  # the third token (all different) is padding
    ta, tb = RoutingTrace(a, 8), RoutingTrace(b, 8)
    # token 0: layer0 overlap 2 -> 0, layer1 overlap 1 -> 0.5; token 1: layer0 overlap 1 -> 0.5, layer1 0 -> 1
    torch.testing.assert_close(expert_change_by_layer(ta, tb, mask), torch.tensor([0.25, 0.75]))
    assert expert_change_fraction(ta, tb, mask) == pytest.approx(0.5)
    assert token_change_fraction(ta, tb, mask) == pytest.approx(1.0)
    assert token_change_fraction(ta, ta, mask) == 0.0 and expert_change_fraction(ta, ta, mask) == 0.0


def test_expert_load_and_entropy():
    """Load counts tokens per expert with CV, max/mean, dead fraction; entropy of uniform logits is log E."""
    ids = torch.tensor([[[[0, 1]], [[0, 2]], [[0, 1]]]], dtype=torch.uint8)  # B=1,T=3,L=1,K=2
    load = expert_load(RoutingTrace(ids, 4), torch.ones(1, 3, dtype=torch.bool))
    assert load["tokens_per_expert"].tolist() == [[3.0, 2.0, 1.0, 0.0]]
    mean = 1.5
    std = ((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 4) ** 0.5
    assert load["cv"].item() == pytest.approx(std / mean)
    assert load["max_over_mean"].item() == pytest.approx(2.0)
    assert load["dead_frac"].item() == pytest.approx(0.25)
    trace = RoutingTrace(ids, 4, torch.zeros(1, 3, 1, 4))
    assert router_entropy(trace, torch.ones(1, 3, dtype=torch.bool)).item() == pytest.approx(
        torch.log(torch.tensor(4.0)).item()
    )
    with pytest.raises(ValueError, match="with_logits"):
        router_entropy(RoutingTrace(ids, 4), torch.ones(1, 3, dtype=torch.bool))


def test_drift_swaps_one_expert_in_a_fraction_of_slots(tokenizer):
    """Drift at p swaps exactly one of the K experts for a non-chosen one in about a fraction p of (token,
    layer) slots; layer 0's expert change is then exactly swapped/K; p = 0 leaves the forward bitwise as is."""
    model = routing_model(tokenizer, "qwen3_moe", num_experts=8, top_k=2)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=8, T=40)
    with torch.no_grad(), ctl.record() as free:
        ref = model(x).logits
    with torch.no_grad(), ctl.record() as rec, ctl.drift(0.3, torch.Generator().manual_seed(0)) as drift:
        out = model(x).logits
    applied_BTL = drift.applied_BTL
    assert applied_BTL.shape == (8, 40, 4)
    assert abs(applied_BTL.float().mean().item() - 0.3) < 0.05
    a, b = free.trace.expert_ids[:, :, 0].long(), rec.trace.expert_ids[:, :, 0].long()  # [B, T, K]
    overlap = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)
    assert torch.equal(overlap == 1, applied_BTL[:, :, 0]) and bool((overlap >= 1).all())
    assert not torch.equal(out, ref)
    with torch.no_grad(), ctl.drift(0.0, torch.Generator().manual_seed(0)) as none:
        assert torch.equal(model(x).logits, ref)
    assert not none.applied_BTL.any()


def test_drift_yields_to_replay_and_keeps_router_gradients(tokenizer):
    """Under an open replay, drift draws nothing and the forward equals the plain replay; drifted forwards
    give the router weights non-zero gradients through the live gates of the experts actually used."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer, B=2, T=9)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    with torch.no_grad(), ctl.replay(rec.trace):
        replayed = model(x).logits
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    with torch.no_grad(), ctl.replay(rec.trace), ctl.drift(1.0, g):
        assert torch.equal(model(x).logits, replayed)
    assert torch.equal(g.get_state(), state)
    with ctl.drift(1.0, torch.Generator().manual_seed(0)):
        model(x).logits.square().mean().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in ctl.routers)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_gates_reproduce_the_recorded_mixture_after_the_router_moved(tokenizer, family):
    """routing.replay_gates: after the routers move, replaying ids and gates reproduces the recorded forward
    bitwise (ids alone do not: the gates come from the moved router), and the loss sends the routers no
    gradient, where an ids-only replay does."""
    model = routing_model(tokenizer, family)
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer)
    with torch.no_grad(), ctl.record(with_gates=True) as rec:
        ref = model(x).logits
    trace = rec.trace
    assert trace.gates_BTLK.shape == trace.expert_ids_BTLK.shape
    _perturb_routers(ctl)
    with torch.no_grad(), ctl.replay(trace, gates=True):
        assert torch.equal(model(x).logits, ref)
    with torch.no_grad(), ctl.replay(trace):
        assert not torch.equal(model(x).logits, ref)
    for gates, moves in ((True, False), (False, True)):
        model.zero_grad()
        with ctl.replay(trace, gates=gates):
            model(x).logits.square().mean().backward()
        grads = [r.weight.grad for r in ctl.routers]
        assert any(g is not None and g.abs().sum() > 0 for g in grads) is moves, gates


def test_replaying_gates_of_a_trace_without_them_raises(tokenizer):
    """A gates replay of a trace recorded without gates raises instead of falling back to live gates."""
    model = routing_model(tokenizer, "qwen3_moe")
    ctl = RoutingController(model)
    x = routing_tokens(tokenizer)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    with pytest.raises(RoutingReplayError, match="recorded with its gates"), ctl.replay(rec.trace, gates=True):
        model(x)
