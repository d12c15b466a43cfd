"""The bfloat16 trainer (model.dtype=bfloat16 on CPU): routing replay exactness, the on-policy first mini-batch,
float32 master weights, and a whole warm-started run."""

import math

import pytest
import torch

from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout import sample
from moe_rl.routing import RoutingController
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.distributed import param_checksum
from moe_rl.trainer.plan import RoutingPlan
from moe_rl.trainer.precision import MASTER_KEY, MasterAdamW, make_optimizer
from moe_rl.trainer.run import build_context, train
from moe_rl.trainer.step import old_policy, update
from tests.conftest import FAMILIES, WARM
from tests.integration.test_train_loop import TINY, comparable, compose_config, read_metrics
from tests.unit.routing.test_routing_record_replay import reference_block

BF16 = [*TINY, "model.dtype=bfloat16", "logger.wandb=false"]


def _tokens(tokenizer, B=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, len(tokenizer), (B, T), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_replay_own_routing_is_exact_with_gradients(tokenizer, family):
    """In bfloat16, a training-mode forward with gradients that replays a no-grad forward's recorded routing
    reproduces its logits bitwise and routes to the same experts."""
    model = build_model(ModelConfig(family=family, head_dim=None, num_layers=2, dtype="bfloat16"), tokenizer)
    ctl = RoutingController(model)
    x = _tokens(tokenizer)
    with torch.no_grad(), ctl.record() as rec:
        ref = model(x).logits
    assert ref.dtype == torch.bfloat16
    model.train()
    with ctl.replay(rec.trace), ctl.record() as again:
        out = model(x).logits
    assert out.requires_grad and torch.equal(ref, out)
    assert torch.equal(again.trace.expert_ids, rec.trace.expert_ids)


def test_bf16_replay_forces_recorded_experts_after_an_update(tokenizer):
    """After the routers have moved, a bfloat16 replayed MoE block matches a float64 reference block that
    uses the recorded experts (to bfloat16 precision), while a free forward chooses other experts."""
    model = build_model(ModelConfig(dtype="bfloat16"), tokenizer)
    ctl = RoutingController(model)
    x = _tokens(tokenizer)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    g = torch.Generator().manual_seed(1)
    block = model.model.layers[1].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach(), y=o.detach()))
    with torch.no_grad():
        for r in ctl.routers:
            r.weight.add_(0.5 * torch.randn(r.weight.shape, generator=g).bfloat16())
        with ctl.record() as free:
            model(x)
        with ctl.replay(rec.trace):
            model(x)
    handle.remove()
    assert not torch.equal(free.trace.expert_ids, rec.trace.expert_ids)
    h_NH = seen["h"].reshape(-1, seen["h"].shape[-1])
    ids_NK = rec.trace.expert_ids[:, :, 1].reshape(h_NH.shape[0], -1).long()
    want = reference_block(block, h_NH, ids_NK)
    got = seen["y"].reshape(h_NH.shape).double()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max().detach()))
    free_ids_NK = free.trace.expert_ids[:, :, 1].reshape(h_NH.shape[0], -1).long()
    assert (got - reference_block(block, h_NH, free_ids_NK)).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("replay", ["off", "old"])
def test_bf16_first_minibatch_is_exactly_on_policy(replay):
    """In bfloat16 the first mini-batch's update forward equals the old-policy forward: every token ratio is
    exactly 1, nothing is clipped and no expert changes, with replay off or old."""
    cfg = compose_config([*BF16, "warmstart.enabled=false", "objective=grpo", f"routing.replay={replay}"])
    ctx, _ = build_context(cfg)
    assert next(ctx.model.parameters()).dtype == torch.bfloat16 and isinstance(ctx.optimizer, MasterAdamW)
    roll = sample(
        ctx.model,
        ctx.tokenizer,
        ["1+2=", "3-1="] * 4,
        cfg.sampler,
        generator=torch.Generator().manual_seed(0),
        controller=ctx.controller,
    )
    adv_B = torch.randn(8, generator=torch.Generator().manual_seed(1))
    batch = Batch.from_rollout(roll, adv_B, torch.arange(8))
    batch.minibatches = [slice(0, 8)]
    plan = RoutingPlan(cfg.routing, ctx.controller, batch, 0, cfg.seed)
    old = old_policy(ctx.forwards, batch, plan)
    result = update(ctx.forwards, ctx.stepper, ctx.objective, batch, old, plan, 0)
    metrics, change = result.metrics, result.change
    assert metrics["ratio/token/max"] == 1.0 and metrics["ratio/token/min"] == 1.0
    assert metrics["clip/token_frac"] == 0.0 and not any(change.layers) and change.response == 0.0
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    # Weights of magnitude ~1 (like norm gains): their bf16 ulp is 2^-7, far above an lr = 1e-4 step.
    return [torch.nn.Parameter((1 + 0.1 * torch.randn(4, 8, generator=g)).bfloat16()) for _ in range(2)]


def _grads(n_steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    # Positive gradients: every AdamW step moves a weight by about -lr, so the steps add up.
    return [[torch.rand(4, 8, generator=g).add(0.5).bfloat16() for _ in range(2)] for _ in range(n_steps)]


def test_master_adamw_equals_float32_adamw_and_rounds_into_the_model():
    """MasterAdamW's masters equal a float32 AdamW fed the same (upcast) gradients, bitwise; the model holds
    their bfloat16 rounding; plain bfloat16 AdamW at lr 1e-4 rounds every step of these weights away."""
    model_params, plain_params = _params(), _params()
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in model_params]
    start = [p.detach().clone() for p in model_params]
    kw = dict(lr=1e-4, weight_decay=0.0)
    master, ref, plain = (
        MasterAdamW(model_params, **kw),
        torch.optim.AdamW(ref_params, **kw),
        torch.optim.AdamW(plain_params, **kw),
    )
    for grads in _grads(50):
        for opt, params in ((master, model_params), (ref, ref_params), (plain, plain_params)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad()
    for m, r, p in zip(master.master_params, ref_params, model_params, strict=True):
        assert m.dtype == torch.float32 and torch.equal(m, r.detach())
        assert torch.equal(p.detach(), m.detach().bfloat16())
    assert all(p.grad is None for p in model_params)
    moved = sum(int((p.detach() != s).sum()) for p, s in zip(model_params, start, strict=True))
    assert moved > 0  # 50 steps of ~1e-4 add up to more than half an ulp
    assert all(torch.equal(p.detach(), s) for p, s in zip(plain_params, start, strict=True))


def test_master_adamw_state_dict_restores_the_float32_masters():
    """A MasterAdamW state dict carries the float32 masters: loading it restores them and the model's
    rounding of them exactly, even after further steps."""
    params = _params()
    opt = MasterAdamW(params, lr=1e-3)
    steps = _grads(3)
    for p, g in zip(params, steps[0], strict=True):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    masters = [m.detach().clone() for m in opt.master_params]
    assert all(torch.equal(a, b) for a, b in zip(saved[MASTER_KEY], masters, strict=True))
    for grads in steps[1:]:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    opt.load_state_dict(saved)
    for m, saved_m, p in zip(opt.master_params, masters, params, strict=True):
        assert torch.equal(m.detach(), saved_m) and torch.equal(p.detach(), saved_m.bfloat16())


def test_optimizer_choice_follows_dtype_and_master_weights():
    """Float32 models and master_weights=false get plain AdamW; bfloat16 with master_weights gets MasterAdamW."""
    p = [torch.nn.Parameter(torch.ones(2))]
    assert type(make_optimizer(p, torch.float32, True, lr=1e-3)) is torch.optim.AdamW
    assert type(make_optimizer(p, torch.bfloat16, False, lr=1e-3)) is torch.optim.AdamW
    assert type(make_optimizer(p, torch.bfloat16, True, lr=1e-3)) is MasterAdamW
    ctx, _ = build_context(compose_config([*BF16, "warmstart.enabled=false", "trainer.master_weights=false"]))
    assert type(ctx.optimizer) is torch.optim.AdamW


@pytest.mark.slow
def test_bf16_warm_started_run_end_to_end(tmp_path, warm_cache):
    """A bfloat16 run warm-starts in bfloat16, samples, and takes RL steps with old-policy replay: finite
    losses, no expert change on the on-policy mini-batch, the trained parameters stay bfloat16 and move,
    and the same seed reproduces the run's metrics exactly."""
    overrides = [
        *BF16,
        *WARM,
        f"warmstart.cache_dir={warm_cache}",  # one bfloat16 warm start for both tests
        "objective=grpo_rr",
        "trainer.lr=1e-3",
    ]
    cfg = compose_config(overrides)
    first = train(cfg, tmp_path / "a")
    second = train(cfg, tmp_path / "b")
    f = first["final"]
    assert first["steps_done"] == 2 and math.isfinite(f["train/loss"]) and f["train/grad_norm"] > 0
    assert first["warmstart_accuracy"] >= 0.1
    # On-policy mini-batch: same weights, same bf16 kernels, so the routers choose exactly as the old forward.
    assert f["routing/expert_change/first_minibatch"] == 0.0 and math.isfinite(f["ratio/token/var"])
    assert comparable([first["final"]]) == comparable([second["final"]])  # all but timings
    ctx, _ = build_context(cfg)
    assert next(ctx.model.parameters()).dtype == torch.bfloat16
    assert first["param_checksum_by_rank"][0] != param_checksum(ctx.model)  # the warm start moved


@pytest.mark.slow
def test_bf16_resume_matches_uninterrupted_run(tmp_path, warm_cache):
    """A bfloat16 run stopped after 1 step and resumed to 3 logs the same metrics as a 3-step run: the
    checkpoint restores the float32 master weights, not only their bfloat16 rounding."""
    overrides = [
        *BF16,
        *WARM,
        f"warmstart.cache_dir={warm_cache}",  # one bfloat16 warm start for both tests
        "objective=grpo",
        "trainer.lr=1e-3",
        "trainer.steps=3",
        "trainer.checkpoint_every=1",
    ]
    full = compose_config(overrides)
    train(full, tmp_path / "full")
    train(compose_config([*overrides, "trainer.steps=1"]), tmp_path / "cut")
    train(compose_config([*overrides, "resume=true"]), tmp_path / "cut")
    assert comparable(read_metrics(tmp_path / "cut")) == comparable(read_metrics(tmp_path / "full"))
