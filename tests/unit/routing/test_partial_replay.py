"""Partial routing replay (prime-rl's score-threshold replay, issue 53): the rule against a loop that
restates prime-rl's `_filter_replayed_experts`, and a witness on the experts' inputs showing which experts
each token of a real forward used."""

import pytest
import torch

from moe_rl.models import ModelConfig, build_model
from moe_rl.routing import RoutingController
from moe_rl.routing.partial import partial_replay
from tests.conftest import FAMILIES


def ref_filter(scores, replayed, own, ratio):
    """One token: keep a replayed expert iff its score >= ratio x min own score; refill the empty slots
    in own rank order with experts not yet selected, each into the first empty slot."""
    threshold = min(scores[e] for e in own) * ratio
    selected = [e if scores[e] >= threshold else None for e in replayed]
    for candidate in own:
        if candidate not in selected and None in selected:
            selected[selected.index(None)] = candidate
    return selected, [scores[e] < threshold for e in replayed]


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9, 1.0])
def test_partial_replay_rule_matches_the_reference(ratio):
    """Every token's experts and replaced slots equal the per-token restatement, and no token ends with a
    duplicate or an empty slot."""
    g = torch.Generator().manual_seed(0)
    N, E, K = 400, 16, 4
    scores = torch.softmax(2 * torch.randn(N, E, generator=g), -1)
    own = scores.topk(K, -1).indices
    replayed = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    replayed[:50] = own[:50].flip(-1)  # some tokens replay the trainer's own experts, in another order
    ids, replaced = partial_replay(scores, replayed, own, ratio)
    for n in range(N):
        exp_ids, exp_replaced = ref_filter(scores[n].tolist(), replayed[n].tolist(), own[n].tolist(), ratio)
        assert ids[n].tolist() == exp_ids and replaced[n].tolist() == exp_replaced
        assert len(set(ids[n].tolist())) == K
    assert not replaced[:50].any()  # the router's own experts always pass its own threshold
    if 0 < ratio:
        assert 0 < replaced.double().mean() < 1


class ExpertsWitness:
    """Records the expert ids each MoE layer's experts module receives in a forward."""

    def __init__(self, model):
        self.ids = []
        self.handles = [
            layer.mlp.experts.register_forward_pre_hook(self.hook, with_kwargs=True) for layer in model.model.layers
        ]

    def hook(self, module, args, kwargs):
        self.ids.append((args[1] if len(args) > 1 else kwargs["top_k_index"]).detach().clone())

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_experts_receive_the_partially_replayed_routing(tokenizer, family):
    """Under replay(trace, score_ratio), each layer's experts receive exactly partial_replay's experts,
    computed from that layer's live router scores and its own top-k; `replaced_BTL` counts the replaced
    slots; ratio 0 replays the trace unchanged."""
    model = build_model(ModelConfig(family=family, head_dim=None), tokenizer)
    ctl = RoutingController(model)
    x = torch.randint(4, len(tokenizer), (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    old = rec.trace
    with torch.no_grad():  # the routers move, so the trainer's own rating of the old experts changes
        for r in ctl.routers:
            r.weight.add_(0.8 * torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)))
    witness = ExpertsWitness(model)
    try:  # `free`: the live router's own logits and top-k in the same forward (given the layers above)
        with torch.no_grad(), ctl.replay(old, score_ratio=0.9) as replayer, ctl.record(with_logits=True) as free:
            model(x)
        replaced_BTL = replayer.replaced_BTL
        with torch.no_grad(), ctl.replay(old):
            model(x)
    finally:
        witness.remove()
    L = ctl.num_layers
    total = 0
    for layer in range(L):
        logits_NE = free.trace.router_logits_BTLE[:, :, layer].reshape(-1, ctl.num_experts)
        replayed_NK = old.expert_ids_BTLK[:, :, layer].reshape(logits_NE.shape[0], -1).long()
        own_NK = free.trace.expert_ids_BTLK[:, :, layer].reshape_as(replayed_NK).long()
        expected, replaced = partial_replay(torch.softmax(logits_NE, -1), replayed_NK, own_NK, 0.9)
        assert torch.equal(witness.ids[layer].long(), expected)
        assert torch.equal(replaced_BTL[:, :, layer].reshape(-1), replaced.sum(-1))
        assert torch.equal(witness.ids[L + layer].long(), replayed_NK)  # plain replay: the trace itself
        total += int(replaced.sum())
    assert 0 < total < replaced_BTL.numel() * ctl.top_k
