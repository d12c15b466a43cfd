"""The RL loop: one step (`step.py`), a whole run (`run.py`), collapse events, logging, checkpoints and
the policy's export in Hugging Face format (`export.py`).

The house: `run.py` (`train`: the run loop, short, each concern an object with a verb) builds a
`StepContext` (`step.py`) from the initial policy (`policy.py`) and the sampler (`sampling.py`:
`build_sampler`, over the samplers of `samplers.py` and the staleness wrappers of `stale.py`), and steps
it with `rl_step` (`step.py`: batch.py, plan.py, reduce.py, step_metrics.py). Around the steps:
`checkpointer.py` (the resume decision, `Checkpointer.load`/`save`; the files: checkpoint.py; the
export: export.py), `evaluate.py` (`Evaluator.due`/`run`), `logging.py` (the `MetricSink`: metrics.jsonl,
events.jsonl, summary.json, W&B and alerts; `NullSink`), `collapse.py` (the detector and the
`collapse/*` counts), `folder.py` (the run folder's lock and id), `distributed.py` (the ranks).

Metrics logged every step (to metrics.jsonl and W&B). Under data parallelism (torchrun, W ranks) every
metric is first reduced over ranks, so one process and W processes log the same quantity:
- the objective's `clip/*`, `ratio/*`, `policy/*`, `rollout_is/*` and `train/*` keys come as
  `moe_rl.reduction.Stats` (sums and counts, extremes, or mergeable variances, the reduction carried by each
  value, not by its name): each mini-batch's are pooled over ranks exactly, as if one process had held all
  its rows (variances included), then over the step's mini-batches by its kind
  (`moe_rl.reduction.over_updates`): a `sum` or a `share` adds its parts, so `policy/*/sum` and the
  quotient `policy/extreme_weight_share` are exact over all ranks and mini-batches; every other kind logs
  the mean of the mini-batches' values (the collapse detector reads the max and min over them);
- rollout statistics are computed from all ranks' rows;
- the step's own scalars carry their reduction too (moe_rl/trainer/reduce.py): `time/*`, the maximum
  over ranks; `throughput/*` and `routing/replay_cache_bytes`, the sum; the means (load CV, router entropy,
  mismatch, mini-batch overlap), weighted by each rank's rows, valid positions or response tokens, as the
  metric averages over them (a rank with nothing to average counts for nothing); `routing/load_cv/mean`
  is the weighted mean of the ranks' values, not the global statistic; expert change is pooled per
  mini-batch, weighted by positions (tokens over the response); router margins are pooled as a sample;
- `length/*`: every rank's sums (`objectives.common.length_sums`) are added, so these are the statistics
  of all ranks' sequences, exactly as one process computes them.

NaN/inf: one convention in metrics.jsonl, events.jsonl and summary.json (moe_rl.trainer.logging): a
non-finite value is written as the string "nan", "inf" or "-inf", so each file is strict JSON; readers
(`moe-rl-compare`, `moe-rl-analyze`) turn them back into floats. summary.json's `final` keeps only the
finite metrics of the last step.

| key | meaning |
|---|---|
| `rollout/reward/mean`, `rollout/reward/std` | reward over the P x G completions |
| `rollout/reward/se` | standard error of `rollout/reward/mean` from the group structure: sd of the P group means / sqrt(P) (so it carries the prompts' differing difficulty); NaN for P = 1. The noise scale of the `reward_collapse` test (collapse.py) |
| `rollout/accuracy` | fraction of completions with reward 1 |
| `rollout/reward_errors` | task=dataset only: completions whose reward failed (`task.reward_fn` or the verifier raised, or returned a non-finite or non-numeric value) and so scored 0, each with a warning naming its dataset row; summed over ranks (moe_rl.tasks.dataset). Synthetic verifiers cannot fail and log no such key |
| `rollout/response_len/mean` | response tokens (EOS included) |
| `rollout/entropy/mean` | mean entropy (nats) of the sampler's token distributions softmax(logits / T) |
| `clip/*`, `ratio/*`, `policy/*` | the objective's diagnostics (moe_rl.objectives), averaged over mini-batches (a `sum` or `share` stat pooled); `clip/dual_frac` only with `objective.clip_ratio_c` |
| `policy/grad_weight/sum`, `policy/extreme_grad_weight/sum` | Σ g·\\|Â\\| over the entries whose gradient no clip zeroes (tokens for grpo and cispo, sequences for gspo, gspo_token and gmpo; g the objective's weight on Â ∇logp), and the same over entries whose ratio lies outside `objective.extreme_weight_band` (default [0.1, 10]); summed over ranks and mini-batches. Definitions per objective in moe_rl.objectives |
| `policy/extreme_weight_share` | `policy/extreme_grad_weight/sum` / `policy/grad_weight/sum` of the whole step: the share of the gradient weight Σ\\|w_it·Â_i\\| (grpo; Σ\\|s_i·Â_i\\| over unclipped sequences for gspo, gspo_token, gmpo) that extreme ratios carry; cispo drops no token's gradient, so its share is over every token, weighted by its truncated weight. NaN when no gradient-carrying weight is left. Not scaled by the rollout IS weight or the aggregation's 1/\\|y_i\\| |
| `ratio/token/{pos,neg}_adv/{max,min}`, `ratio/seq/{pos,neg}_adv/{max,min}` | max and min of r_it (s_i) over valid tokens with Â > 0 (`pos_adv`) or Â < 0 (`neg_adv`), mean over mini-batches; NaN when a step has no token of that sign. The collapse detector reads them over all mini-batches to say which side of a `ratio_blowup` carries gradient |
| `rollout_is/mean`, `rollout_is/max`, `rollout_is/clipped_frac`, `rollout_is/masked_frac` | with `objective.rollout_is` only: the sampler correction ρ = π_old / π_sampler before truncation (mean, max) and the fraction of tokens truncated (`*_truncate`) or masked (`*_mask`); formulas in moe_rl.objectives |
| `rollout_is/ess`, `rollout_is/chi2` | with `objective.rollout_is`, or a sampler whose log-probs are not the policy's own (`Sampler.exact` false: `trainer.sampler_dtype`, vLLM, `rollout.staleness`): normalised effective sample size (Σw)²/(B'Σw²) and χ² = mean w² − 1 of the per-sequence weights w_i = π_old(y_i)/π_sampler(y_i), per mini-batch pooled over ranks, mean over mini-batches |
| `policy/opsm_masked_frac` | with `objective.opsm_delta`: fraction of response tokens off-policy sequence masking drops |
| `policy/vespo_phi/mean` | vespo only: mean over sequences of VESPO's gamma-kernel weight φ_i = w_i^k e^{λ(1−w_i)} (1 on-policy; moe_rl/objectives/vespo.py) |
| `policy/dppo_truncated_frac`, `policy/dppo_divergence/mean` | the DPPO family only: the kept tokens whose ratio `objective.ratio_cap` truncates, and the mean divergence its trust region judged (TV: p − p_a, signed; KL: the Bernoulli or top-k KL) over valid tokens; its dropped tokens are `clip/low_frac` (Â < 0) and `clip/high_frac` (Â > 0) (moe_rl/objectives/dppo.py) |
| `train/ess_lr_factor` | with `trainer.ess_step_scale`: the factor on each step's lr, min(1, ESS/n)^(1/2) or min(1, ESS/n) of the mini-batch's sequence weights π_old/μ, mean over mini-batches (moe_rl/trainer/ess_scale.py) |
| `policy/gate_weight/mean` | sapo, sapo_seq: mean gate gradient factor 4σ(1 − σ) (they log no `clip/*`) |
| `router_shift/gamma/mean` | with `objective.router_shift`: 1/N Σ γ̃_it, the floored router-shift ratio the objective's ratio is multiplied by (moe_rl.objectives.router_shift); exactly 1 on the on-policy mini-batch |
| `router_shift/gamma/min` | with `objective.router_shift`: min_it γ_it before the floor |
| `router_shift/floored_frac` | with `objective.router_shift`: 1/N Σ [γ_it < router_shift_floor] |
| `length/<lo>-<hi>/token_var` | ratios by response length within one step and one policy: over the sequences of mini-batches 2..M (every rank) whose response has n_i tokens (EOS included) with lo ≤ n_i ≤ hi, the population variance of their token ratios r_it (moe_rl.objectives notation), 1/N_bin Σ (r_it − mean r)², pooled over those mini-batches. Bins are fixed: `1-4`, `5-8`, `9-16`, `17-32`, ... up to the one holding `sampler.max_new_tokens` (`objectives.common.length_bins`), so keys never change within a run |
| `length/<lo>-<hi>/within_seq_var` | the same sequences with n_i ≥ 2: mean over them of 1/n_i Σ_t (r_it − mean_t r_it)² |
| `length/<lo>-<hi>/seq_var` | the same sequences: population variance of GSPO's length-normalised s_i, 1/B_bin Σ (s_i − mean s)² |
| `length/<lo>-<hi>/seqs`, `length/<lo>-<hi>/tokens` | how many sequences (B_bin) and tokens (N_bin) the bin's statistics are over, to weight means over steps. An empty bin logs 0 here and NaN in the three variances (never 0); with one mini-batch every bin is empty |
| `train/loss`, `train/grad_norm` | mean over mini-batches (grad norm before clipping) |
| `train/grad_norm/max` | the largest gradient norm before clipping among the step's mini-batches |
| `train/grad_clipped_frac`, `train/grad_clip_scale` | the fraction of the step's updates that `trainer.grad_clip` scaled down, and the mean scale min(1, clip / norm) it applied (1 with `trainer.grad_clip=null`). AdamW divides a constant gradient scale out of its update, so the scale says how much clipping reweights updates, not the step size. Skipped, non-finite updates count in neither |
| `train/lr` | learning rate after the step |
| `train/aux_loss` | the family's load-balancing loss of the update forward, mean over mini-batches (only when `model.router_aux_loss_coef` > 0; the loss adds coef x this) |
| `routing/expert_change/frac` | mean over mini-batches 2..M of 1 - \\|A∩B\\|/K: the routing the current policy's update forward uses absent replay (A: its free top-k, or the drifted one under `routing.drift`) vs the old policy's (B) on the same tokens, before that mini-batch's update; over all valid positions, prompt included |
| `routing/expert_change/response_frac` | the same over response positions only (the R positions whose outputs are the response log-probs): the paper's quantity |
| `routing/expert_change/after_one_update` | the same on mini-batch 2 only: the paper's "after each gradient update" |
| `routing/expert_change/layer_{i}` | the mini-batch 2..M mean, per layer |
| `routing/expert_change/first_minibatch` | the same on mini-batch 1 (no update yet: 0 in fp32, a sanity check) |
| `routing/rollout_vs_old/frac` | sampler routing vs old-policy routing, same measure (under R3 the old policy's free choice given the replayed layers above) |
| `routing/rollout_vs_current/frac` | sampler routing vs the update forwards' routing (as in `expert_change/frac`), mean over all M mini-batches |
| (logit and weight noise) | `routing.logit_noise` and `routing.weight_noise` log no key of their own: what they do is measured as expert change, margins and mismatch above (moe_rl.trainer.plan) |
| `routing/drift/applied_frac` | measured fraction of (valid position, layer) slots whose routing `routing.drift` swapped, over the mini-batches that drift (0 under replay: replay wins); only when `routing.drift` > 0 |
| `routing/margin/median`, `routing/margin/p10`, `routing/margin/frac_below_0.1` | the old policy's router margins z_(k) − z_(k+1) (k-th minus (k+1)-th largest router logit, `routing.router_margins`) over its response positions and every layer, pooled over all ranks' tokens (exact order statistics; median and p10 by linear interpolation, `routing.margin_summary`); absent when experts ≤ top-k |
| `routing/margin/layer_{i}` | the median margin of layer i |
| `routing/logit_shift/after_one_update` | sqrt of the mean over mini-batch 2's response positions, layers and experts of (Δz − mean_e Δz)², Δz the live router logits of its update forward minus the old policy's (a shift common to all experts re-routes nothing); summed over ranks, so exact |
| `routing/margin/predicted_change` | the expert change after one update that those margins predict for iid N(0, s²) logit noise, s² = logit_shift² + σ_2² (σ_2 the injected `routing.logit_noise` scale of mini-batch 2, with scope update and no replay, else 0): (1/K) mean Φ(−m / (s√2)) over the margins m, counting swaps across the k / k+1 boundary only. Next to `routing/expert_change/after_one_update`, it says whether a model is volatile because its margins are small or its updates large |
| `staleness/mean`, `staleness/max` | with `rollout.staleness` > 0 only: t − v, the versions between the weights that sampled step t's rollout (v RL steps trained) and this step's; every row of a rollout shares v (moe_rl/trainer/stale.py) |
| `routing/expert_change/vs_sampler`, `.../vs_sampler/layer_{i}` | with `rollout.staleness` > 0: 1 − \\|A∩B\\|/K, the stale sampler's experts (A) against the proximal (old-policy) forward's free top-k (B) on the same response positions, pooled and per layer, pooled over ranks by response tokens. The expert change after t − v updates of natural training |
| `routing/logit_shift/vs_sampler`, `routing/margin/predicted_change_vs_sampler` | with `rollout.staleness` > 0 and an hf sampler: the centred RMS shift of router logits from the sampler to the proximal forward on the response positions (as `logit_shift/after_one_update`), and the change the proximal margins predict at that shift (as `margin/predicted_change`) |
| `routing/load_cv/mean` | per-layer coefficient of variation of tokens per expert (old policy), mean over layers |
| `routing/entropy/mean` | router entropy (nats) of the old policy, mean over layers |
| `routing/replay_cache_bytes` | bytes of expert ids held for replay this step (0 when replay is off) |
| `routing/replay_replace_rate`, `.../layer_{i}` | with `routing.replay_score_ratio` > 0: replayed slots the partial replay replaced from the live router's own top-k, over replayed slots (valid positions x K), pooled over layers and per layer, per mini-batch pooled over ranks, mean over mini-batches (moe_rl/routing/partial.py) |
| `minibatch/sibling_frac` | over rows of mini-batches 2..M: the fraction whose group (prompt) had a row in an earlier mini-batch of the step (1 by construction when group_size ≥ mini_batches; 0 with `trainer.group_minibatches`) |
| `minibatch/duplicate_frac` | over rows of mini-batches 2..M: the fraction whose whole sequence (prompt and response) equals a row of an earlier mini-batch of the step |
| `mismatch/k3_kl`, `mismatch/kl_ent_ratio`, `mismatch/extreme_frac`, `mismatch/token_mult_prob_error`, `mismatch/js_divergence` | on the response tokens, Δ = old-policy log-prob − sampler log-prob: mean e^Δ − Δ − 1 (prime-rl's mismatch_kl); Σ (e^Δ − Δ − 1) / Σ H with H the sampler's entropy at each token (prime-rl's kl_ent_ratio, which divides by the trainer's); mean [\\|Δ\\| > ln 2]; mean e^{\\|Δ\\|} (NeMo-RL's token_mult_prob_error, 1 without mismatch); mean ½(e^a − a − 1) + ½(e^b − b − 1), a and b the two log-probs minus log of their mean probability (NeMo-RL's js_divergence_error). Each a sum and a count, pooled over ranks (moe_rl/trainer/step_metrics.py) |
| `mismatch/logp_abs_diff/mean` | mean \\|sampler log-prob - old-policy log-prob\\| over response tokens, where the old-policy log-probs are those the objective uses as π_old, under the arm's replay (R3 replays the sampler's routing there; 0 by construction with `trainer.reuse_sampler_logp`) |
| `collapse/events`, `collapse/new_events` | collapse events so far, and those of this step (see collapse.py; at most one `nonfinite` event per step, its `detail` counting the mini-batches with a non-finite `train/loss` or `train/grad_norm`) |
| `collapse/kind/{kind}` | collapse events of each kind so far (`nonfinite`, `reward_collapse`, `eval_regression`, `entropy_collapse`, `ratio_blowup`; 0 until one fires). `collapse/events` and these count an `eval_regression` in the row of the step whose evaluation found it |
| `collapse/ratio_blowup/{side}_{sign}_adv` | `ratio_blowup` events so far in which the side (`high`: ratio > `collapse.ratio_max`; `low`: < 1 / ratio_max) crossed on entries with that advantage sign (`pos`, `neg`); `high_neg_adv` is the case whose gradient is large under a PPO clip (collapse.py) |
| `time/step_s`, `time/rollout_s`, `time/old_forward_s`, `time/train_s` | wall seconds of the step and its stages (`time/old_forward_s` is ~0 with `trainer.reuse_sampler_logp`) |
| `throughput/tokens_per_s` | (prompt + response tokens of the batch) / step seconds |
| `time/weight_sync_s` | seconds to load the step's updated weights into a separate sampler (`sampler.engine=vllm`, or the copy at `trainer.sampler_dtype`), after the updates and within `time/train_s`; absent when the sampler is the trained model |
| `throughput/sampler_tokens_per_s` | response tokens sampled / rollout seconds; under `rollout.staleness`, / the seconds the sampler spent on this rollout (`time/rollout_s` is then the trainer's wait, and at step t a deterministic sampler samples step t + k) |
| `eval/accuracy`, `eval/response_len` | held-out evaluation (moe_rl.trainer.evaluate), only on the steps it runs (every `eval.every` steps and the last): sampled as in RL on the first `eval.size` eval prompts |
| `eval/expected_accuracy` | mean over the first `eval.expected_size` eval prompts of the teacher-forced probability exp Σ_t log π(y*_t) of the canonical answer y* (EOS included) at the sampler's temperature, untruncated: the expected sampled accuracy without sampling noise where y* is the only correct answer and top_p = 1 (arithmetic, sort, sort_long); a lower bound for countdown (moe_rl.trainer.evaluate) |
| `eval/expected_accuracy/se` | its standard error over those prompts, sd / sqrt(`eval.expected_size`): the noise scale of the `eval_regression` test |
| `eval/accuracy_greedy` | greedy decoding on the same `eval.expected_size` prompts |
| `eval/initial/*` | the eval keys above for the policy before the first update, in step 0's row only (`eval.at_start`); a resumed run keeps its first session's |
| `time/eval_s` | wall seconds of the row's evaluations (the initial one included in step 0's row) |
"""
