"""Supervised warm start: lands in its accuracy band, rolls back overshoots, caches safely across processes."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import AutoTokenizer

import moe_rl.warmstart as ws_mod
import moe_rl.warmstart.build as build_mod
import moe_rl.warmstart.search as search_mod
from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout import SamplerConfig, sample
from moe_rl.tasks import make_task
from moe_rl.warmstart import WarmStartConfig, cache_key, warm_start, warm_start_dir

REPO = Path(__file__).resolve().parents[3]
TINY = ModelConfig(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    num_experts=2,
    top_k=1,
    expert_ffn_size=32,
)
"""A model small enough that a few optimizer steps cost milliseconds (tests of the control flow)."""


def test_warm_start_reaches_band_and_saved_model_reproduces_accuracy(tmp_path):
    """Held-out accuracy lands in [0.2, 0.6] and reloading result.path and resampling gives exactly the same accuracy."""
    # The default model at 2 layers and 128 eval prompts: the same contract at about a third of the cost.
    cfg = WarmStartConfig(eval_size=128, cache_dir=str(tmp_path))
    wall, cpu = time.perf_counter(), time.process_time()
    result = warm_start(ModelConfig(num_layers=2), "arithmetic", 1, cfg, seed=0, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"\nwarm start: {wall:.1f} s wall, {cpu:.1f} s CPU, {result.steps} steps, accuracy {result.accuracy}"
    )
    assert not result.cached
    assert cfg.target_low <= result.accuracy <= cfg.target_high
    meta = json.loads((Path(result.path) / "warmstart.json").read_text())
    assert meta["accuracy"] == result.accuracy and meta["steps"] == result.steps > 0

    # Reference check, independent of warm_start's own evaluation code: same eval examples (eval split,
    # WarmStartConfig.seed), same generator seed (the run seed), one batch, T = 1, reward from the task.
    task = make_task("arithmetic", 1)
    model = build_model(ModelConfig(pretrained=result.path))
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    examples = task.examples("eval", cfg.eval_size, cfg.seed)
    rollout = sample(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        SamplerConfig(temperature=1.0, max_new_tokens=task.max_response_len + 1),
        generator=torch.Generator().manual_seed(0),
    )
    rewards = [task.reward(ex, text) for ex, text in zip(examples, rollout.texts, strict=True)]
    assert sum(rewards) / len(rewards) == result.accuracy


def test_second_call_is_served_from_cache(tmp_path):
    """The same request again returns cached=True with the same path and result, without training (faster)."""
    cfg = WarmStartConfig(target_low=0.0, target_high=1.0, eval_size=8, cache_dir=str(tmp_path))
    first = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    again = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert not first.cached and again.cached and again.path == first.path
    assert (again.accuracy, again.steps) == (first.accuracy, first.steps)
    assert again.seconds < first.seconds
    other = warm_start(TINY, "arithmetic", 1, replace(cfg, eval_size=16), seed=0, progress=False)
    assert not other.cached and other.path != first.path


def test_cache_key_changes_with_anything_that_changes_weights():
    """Model, task, difficulty, warm-start settings, seed and max_new_tokens change the key; cache_dir does not."""
    m, ws = ModelConfig(), WarmStartConfig()
    base = cache_key(m, "arithmetic", 1, ws, 0, 3)
    variants = [
        cache_key(replace(m, hidden_size=64), "arithmetic", 1, ws, 0, 3),
        cache_key(m, "sort", 1, ws, 0, 3),
        cache_key(m, "arithmetic", 2, ws, 0, 3),
        cache_key(m, "arithmetic", 1, replace(ws, lr=1e-3), 0, 3),
        cache_key(m, "arithmetic", 1, replace(ws, target_high=0.5), 0, 3),
        cache_key(m, "arithmetic", 1, ws, 1, 3),
        cache_key(m, "arithmetic", 1, ws, 0, 4),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert cache_key(m, "arithmetic", 1, replace(ws, cache_dir="/elsewhere"), 0, 3) == base
    assert cache_key(m, "arithmetic", 1, replace(ws, build_seed=0), 0, 3) == base  # the seed used is the key
    assert warm_start_dir(m, "arithmetic", 1, ws, 0).name == f"arithmetic-{base[:16]}"


def test_cache_key_includes_the_difficulty_mix():
    """task.mix changes the key (order and repeats too: they change the draws); an empty mix is no mix."""
    m, ws = ModelConfig(), WarmStartConfig()
    plain = cache_key(m, "sort", 4, ws, 0, 32)
    mixes = [[2, 4, 8, 16], [16, 8, 4, 2], [2, 4, 8, 16, 16], [2, 4, 8]]
    keys = [cache_key(m, "sort", 4, ws, 0, 32, mix=mix) for mix in mixes]
    assert len({plain, *keys}) == len(mixes) + 1
    assert cache_key(m, "sort", 4, ws, 0, 32, mix=[]) == plain
    assert warm_start_dir(m, "sort", 4, ws, 0, mix=mixes[0]).name == f"sort-{keys[0][:16]}"  # bound 31 + EOS


CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from moe_rl.models import ModelConfig
from moe_rl.warmstart import WarmStartConfig, warm_start
cfg = WarmStartConfig(target_low=0.0, target_high=1.0, max_steps=2, batch_size=4, eval_size=8, cache_dir=sys.argv[1])
print("ready", flush=True)
r = warm_start(ModelConfig(), "arithmetic", 1, cfg, seed=0, progress=False)
print(json.dumps(dict(path=r.path, cached=r.cached, steps=r.steps)))
"""


def test_concurrent_callers_build_once_and_both_succeed(tmp_path):
    """Two processes asking at once: one builds, the other waits and loads it (cached=True); no partial directory."""
    cfg = WarmStartConfig(
        target_low=0.0, target_high=1.0, max_steps=2, batch_size=4, eval_size=8, cache_dir=str(tmp_path)
    )
    final = warm_start_dir(ModelConfig(), "arithmetic", 1, cfg, 0)
    lock_path = Path(f"{final}.lock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Hold the lock until both children are at it, so they really race for it when it is released.
    lock = FileLock(lock_path)
    with lock:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tmp_path)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        time.sleep(1.0)  # both are now polling the lock (filelock retries every 0.05 s)
        assert all(p.poll() is None for p in procs), "a child finished while the lock was held"
        assert not final.exists()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert sorted(r["cached"] for r in results) == [False, True]
    assert {r["path"] for r in results} == {str(final)}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "warmstart.json"):
        assert (final / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary build left


def _scripted_accuracy(accuracies: list[float], seen: list[torch.Tensor]):
    """A stand-in for heldout_accuracy returning `accuracies` in turn and recording the weights it was shown."""
    it = iter(accuracies)

    def fake(model, tokenizer, task, examples, sampler_cfg, generator_seed):
        seen.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
        return next(it)

    return fake


def test_overshoot_rolls_back_to_last_checkpoint_below_band(tmp_path, monkeypatch):
    """After an overshoot, training resumes from the last below-band eval with half the lr and evaluates every step."""
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(search_mod, "heldout_accuracy", _scripted_accuracy([0.0, 0.1, 0.9, 0.1, 0.3], seen))
    cfg = WarmStartConfig(
        max_steps=20, batch_size=4, eval_every=2, lr=1e-3, eval_size=4, cache_dir=str(tmp_path)
    )
    result = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    meta = json.loads((Path(result.path) / "warmstart.json").read_text())
    # Evals at steps 0, 2, 4 (overshoot: back to step 2), then 3 and 4 of the new branch.
    assert [h["step"] for h in meta["history"]] == [0, 2, 4, 3, 4]
    assert [h["lr"] for h in meta["history"]] == [1e-3, 1e-3, 1e-3, 5e-4, 5e-4]
    assert (result.accuracy, result.steps, meta["steps_total"], meta["rollbacks"]) == (0.3, 4, 6, 1)
    assert not torch.equal(seen[4], seen[2])  # the returned step-4 model is not the discarded one


def test_budget_spent_above_band_returns_closest_overshoot_with_warning(tmp_path, monkeypatch):
    """If every try overshoots until max_steps, the overshot model closest to the band is saved, with a warning."""
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(search_mod, "heldout_accuracy", _scripted_accuracy([0.0, 0.7, 0.9, 0.8], seen))
    cfg = WarmStartConfig(max_steps=4, batch_size=4, eval_every=2, eval_size=4, cache_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="overshot"):
        result = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert (result.accuracy, result.steps) == (0.7, 2)
    saved = build_model(ModelConfig(pretrained=result.path))
    torch.testing.assert_close(
        torch.cat([p.detach().flatten() for p in saved.parameters()]), seen[1], rtol=0, atol=0
    )


def test_never_reaching_band_raises(tmp_path):
    """Accuracy still below target_low after max_steps raises RuntimeError pointing at warmstart.max_steps."""
    cfg = WarmStartConfig(
        target_low=0.9,
        target_high=1.0,
        max_steps=2,
        batch_size=4,
        eval_every=1,
        eval_size=8,
        cache_dir=str(tmp_path),
    )
    with pytest.raises(RuntimeError, match=r"warmstart\.max_steps=2"):
        warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # nothing cached


@pytest.mark.parametrize(
    "field, value",
    [
        ("target_low", 0.7),
        ("target_low", -0.1),
        ("target_high", 1.5),
        ("max_steps", 0),
        ("batch_size", 0),
        ("lr", 0.0),
        ("eval_every", 0),
        ("eval_size", 0),
        ("eval_temperature", -1.0),
        ("cache_dir", ""),
        ("seed", -1),
    ],
)
def test_invalid_config_raises_naming_the_field(tmp_path, field, value):
    """A bad WarmStartConfig field raises ValueError naming warmstart.<field>, before anything is written."""
    cfg = replace(WarmStartConfig(cache_dir=str(tmp_path / "cache")), **{field: value})
    with pytest.raises(ValueError, match=rf"warmstart\.{field}"):
        cfg.validate()
    with pytest.raises(ValueError, match=rf"warmstart\.{field}"):
        warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert not (tmp_path / "cache").exists()


FAST = dict(target_low=0.0, target_high=1.0, max_steps=3, batch_size=4, eval_every=1, eval_size=8)
"""A warm start of TINY that trains a few steps and always lands in its (whole) band."""


def weights_of(path: str) -> dict[str, torch.Tensor]:
    """The saved weights, copied out of the memory-mapped file (which a test may then overwrite)."""
    return {k: v.clone() for k, v in build_model(ModelConfig(pretrained=path)).state_dict().items()}


def test_same_key_builds_same_weights_whatever_the_thread_count(tmp_path, monkeypatch):
    """A key built under torch threads=1 and threads=2 trains on BUILD_THREADS both times, to bitwise-equal weights."""
    threads, paths, seen = torch.get_num_threads(), [], []
    train = build_mod.band_search

    def recording_train(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return train(*args, **kwargs)

    monkeypatch.setattr(build_mod, "band_search", recording_train)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cfg = WarmStartConfig(**FAST, cache_dir=str(tmp_path / f"t{n}"))
            paths.append(warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False).path)
            assert torch.get_num_threads() == n  # the caller's setting is given back
    finally:
        torch.set_num_threads(threads)
    assert seen == [ws_mod.BUILD_THREADS, ws_mod.BUILD_THREADS]
    a, b = (weights_of(p) for p in paths)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cache_key_includes_device_type():
    """cpu and cuda builds differ in kernels, so they never share a cache entry."""
    m, ws = ModelConfig(), WarmStartConfig()
    assert cache_key(m, "arithmetic", 1, ws, 0, 3, device="cpu") != cache_key(m, "arithmetic", 1, ws, 0, 3, device="cuda:1")
    assert cache_key(m, "arithmetic", 1, ws, 0, 3, device="cuda:0") == cache_key(m, "arithmetic", 1, ws, 0, 3, device="cuda")


@pytest.mark.parametrize("victim", ["model.safetensors", "warmstart.json"])
def test_corrupt_cache_entry_is_rebuilt_with_warning(tmp_path, victim):
    """Garbage in a cached file fails its checksum: the entry is rebuilt (same weights) with a warning naming it."""
    cfg = WarmStartConfig(**FAST, cache_dir=str(tmp_path))
    first = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    good = weights_of(first.path)
    (Path(first.path) / victim).write_bytes(b"\x00garbage")
    with pytest.warns(RuntimeWarning, match=f"{first.path} is corrupt or incomplete: rebuilding"):
        again = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert not again.cached and again.path == first.path
    rebuilt = weights_of(again.path)
    assert all(torch.equal(good[k], rebuilt[k]) for k in good)


def test_valid_entry_is_read_without_the_lock_and_unusable_cache_fails_in_one_line(tmp_path):
    """With a lock that cannot be opened (as in a read-only cache) a valid entry still loads; a missing one is a RunError."""
    from moe_rl.errors import RunError

    cfg = WarmStartConfig(**FAST, cache_dir=str(tmp_path))
    first = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    lock = Path(f"{first.path}.lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # opening the lock file now fails, as it does on a read-only file system
    assert warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False).cached
    other = replace(cfg, eval_size=16)
    Path(f"{warm_start_dir(TINY, 'arithmetic', 1, other, 0)}.lock").mkdir()
    with pytest.raises(RunError, match="is not writable .* holds no valid entry"):
        warm_start(TINY, "arithmetic", 1, other, seed=0, progress=False)


def test_failed_build_leaves_no_lock_behind(tmp_path):
    """A build that fails (accuracy never reaches the band) removes its lock file: the cache holds nothing."""
    cfg = WarmStartConfig(target_low=0.99, target_high=1.0, max_steps=1, batch_size=4, eval_size=8, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="warmstart.max_steps=1"):
        warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_warm_start_loss_adds_the_load_balancing_loss(tokenizer):
    """With model.router_aux_loss_coef = c > 0 the warm start's loss is the response cross-entropy plus c x
    the family's load-balancing loss; with c = 0 it is the cross-entropy alone."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from moe_rl.models import ModelConfig, build_model
    from moe_rl.tasks import make_task
    from moe_rl.warmstart import demonstration_batch, demonstration_loss

    task = make_task("arithmetic", 1)
    batch = demonstration_batch(tokenizer, task, task.examples("train", 4, seed=0))
    plain = demonstration_loss(build_model(ModelConfig(), tokenizer), *batch)
    model = build_model(ModelConfig(router_aux_loss_coef=0.5), tokenizer)
    with_aux = demonstration_loss(model, *batch)
    ids, mask, _ = batch
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], output_router_logits=True)
    aux = load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok,
                                   mask[:, :-1])
    torch.testing.assert_close(with_aux, plain + 0.5 * aux)


def test_build_shows_a_progress_bar_with_accuracy_against_the_band(tmp_path, capsys):
    """A build with progress on draws a bar in steps, saying it is built once, with held-out accuracy next to the target band."""
    cfg = WarmStartConfig(target_low=0.9, target_high=1.0, max_steps=2, batch_size=4, eval_every=1, eval_size=8,
                          cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "warm start arithmetic (once, then cached)" in err and "2/2" in err
    assert "acc=0.000" in err and "target=[0.9, 1]" in err


def test_progress_bar_and_warmstart_json_show_no_bare_nan_before_the_first_step(tmp_path, capsys):
    """A build that stops at its first evaluation (no training step, so no loss yet) shows loss=– in its bar, never loss=nan, and writes warmstart.json as strict JSON with that loss as the string "nan"."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    cfg = WarmStartConfig(target_low=0.0, target_high=1.0, eval_size=8, cache_dir=str(tmp_path))
    result = warm_start(TINY, "arithmetic", 1, cfg, seed=0, progress=True)
    shown = capsys.readouterr().err
    assert "loss=–" in shown and "loss=nan" not in shown and result.steps == 0
    meta = json.loads((Path(result.path) / "warmstart.json").read_text(), parse_constant=refuse)
    assert meta["history"][0]["loss"] == "nan"
