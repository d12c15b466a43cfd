"""The RL loop: one step (`step.py`), a whole run (`run.py`), collapse events, logging, checkpoints and
the policy's export in Hugging Face format (`export.py`).

Metrics logged every step (to metrics.jsonl and W&B). Under data parallelism (torchrun, W ranks) every
metric is first reduced over ranks (`reduce_metric` in distributed.py), so one process and W processes
log the same quantity:
- rollout statistics are computed from all ranks' rows;
- `*/max` and `time/*`: the maximum over ranks; `*/min`: the minimum;
- `throughput/*` and `routing/replay_cache_bytes`: the sum;
- other means: weighted by each rank's response tokens (`TOKEN_MEANS`: the clip and ratio means),
  valid positions (`POSITION_MEANS`, and expert change, reduced per mini-batch) or rows (the rest);
- variances and `routing/load_cv/mean`: the weighted mean of the ranks' values, not the global statistic;
- except `length/*`: every rank's sums (`objectives.common.length_sums`) are added, so these are the
  statistics of all ranks' sequences, exactly as one process computes them.

NaN/inf: one convention in metrics.jsonl, events.jsonl and summary.json (moe_rl.trainer.logging): a
non-finite value is written as the string "nan", "inf" or "-inf", so each file is strict JSON; readers
(`moe-rl-compare`, `moe-rl-analyze`) turn them back into floats. summary.json's `final` keeps only the
finite metrics of the last step.

| key | meaning |
|---|---|
| `rollout/reward/mean`, `rollout/reward/std` | reward over the P x G completions |
| `rollout/accuracy` | fraction of completions with reward 1 |
| `rollout/response_len/mean` | response tokens (EOS included) |
| `rollout/entropy/mean` | mean entropy (nats) of the sampler's token distributions softmax(logits / T) |
| `clip/*`, `ratio/*`, `policy/*` | the objective's diagnostics (moe_rl.objectives), averaged over mini-batches; `clip/dual_frac` only with `objective.clip_ratio_c` |
| `rollout_is/mean`, `rollout_is/max`, `rollout_is/clipped_frac`, `rollout_is/masked_frac` | with `objective.rollout_is` only: the sampler correction ρ = π_old / π_sampler before truncation (mean, max) and the fraction of tokens truncated (`*_truncate`) or masked (`*_mask`); formulas in moe_rl.objectives |
| `length/<lo>-<hi>/token_var` | ratios by response length within one step and one policy: over the sequences of mini-batches 2..M (every rank) whose response has n_i tokens (EOS included) with lo ≤ n_i ≤ hi, the population variance of their token ratios r_it (moe_rl.objectives notation), 1/N_bin Σ (r_it − mean r)², pooled over those mini-batches. Bins are fixed: `1-4`, `5-8`, `9-16`, `17-32`, ... up to the one holding `sampler.max_new_tokens` (`objectives.common.length_bins`), so keys never change within a run |
| `length/<lo>-<hi>/within_seq_var` | the same sequences with n_i ≥ 2: mean over them of 1/n_i Σ_t (r_it − mean_t r_it)² |
| `length/<lo>-<hi>/seq_var` | the same sequences: population variance of GSPO's length-normalised s_i, 1/B_bin Σ (s_i − mean s)² |
| `length/<lo>-<hi>/seqs`, `length/<lo>-<hi>/tokens` | how many sequences (B_bin) and tokens (N_bin) the bin's statistics are over, to weight means over steps. An empty bin logs 0 here and NaN in the three variances (never 0); with one mini-batch every bin is empty |
| `train/loss`, `train/grad_norm` | mean over mini-batches (grad norm before clipping) |
| `train/lr` | learning rate after the step |
| `train/aux_loss` | the family's load-balancing loss of the update forward, mean over mini-batches (only when `model.router_aux_loss_coef` > 0; the loss adds coef x this) |
| `routing/expert_change/frac` | mean over mini-batches 2..M of 1 - \\|A∩B\\|/K: the routing the current policy's update forward uses absent replay (A: its free top-k, or the drifted one under `routing.drift`) vs the old policy's (B) on the same tokens, before that mini-batch's update; over all valid positions, prompt included |
| `routing/expert_change/response_frac` | the same over response positions only (the R positions whose outputs are the response log-probs): the paper's quantity |
| `routing/expert_change/after_one_update` | the same on mini-batch 2 only: the paper's "after each gradient update" |
| `routing/expert_change/layer_{i}` | the mini-batch 2..M mean, per layer |
| `routing/expert_change/first_minibatch` | the same on mini-batch 1 (no update yet: 0 in fp32, a sanity check) |
| `routing/rollout_vs_old/frac` | sampler routing vs old-policy routing, same measure (under R3 the old policy's free choice given the replayed layers above) |
| `routing/rollout_vs_current/frac` | sampler routing vs the update forwards' routing (as in `expert_change/frac`), mean over all M mini-batches |
| `routing/drift/applied_frac` | measured fraction of (valid position, layer) slots whose routing `routing.drift` swapped, over the mini-batches that drift (0 under replay: replay wins); only when `routing.drift` > 0 |
| `routing/load_cv/mean` | per-layer coefficient of variation of tokens per expert (old policy), mean over layers |
| `routing/entropy/mean` | router entropy (nats) of the old policy, mean over layers |
| `routing/replay_cache_bytes` | bytes of expert ids held for replay this step (0 when replay is off) |
| `minibatch/sibling_frac` | over rows of mini-batches 2..M: the fraction whose group (prompt) had a row in an earlier mini-batch of the step (1 by construction when group_size ≥ mini_batches; 0 with `trainer.group_minibatches`) |
| `minibatch/duplicate_frac` | over rows of mini-batches 2..M: the fraction whose whole sequence (prompt and response) equals a row of an earlier mini-batch of the step |
| `mismatch/logp_abs_diff/mean` | mean \\|sampler log-prob - old-policy log-prob\\| over response tokens, where the old-policy log-probs are those the objective uses as π_old, under the arm's replay (R3 replays the sampler's routing there; 0 by construction with `trainer.reuse_sampler_logp`) |
| `collapse/events`, `collapse/new_events` | collapse events so far, and those of this step (see collapse.py; at most one `nonfinite` event per step, its `detail` counting the mini-batches with a non-finite `train/loss` or `train/grad_norm`) |
| `collapse/kind/{kind}` | collapse events of each kind so far (`nonfinite`, `reward_collapse`, `entropy_collapse`, `ratio_blowup`; 0 until one fires) |
| `time/step_s`, `time/rollout_s`, `time/old_forward_s`, `time/train_s` | wall seconds of the step and its stages (`time/old_forward_s` is ~0 with `trainer.reuse_sampler_logp`) |
| `throughput/tokens_per_s` | (prompt + response tokens of the batch) / step seconds |
| `throughput/sampler_tokens_per_s` | response tokens sampled / rollout seconds |
| `eval/accuracy`, `eval/response_len` | held-out evaluation (moe_rl.trainer.evaluate), only on the steps it runs (every `eval.every` steps and the last): sampled as in RL on the first `eval.size` eval prompts |
| `eval/expected_accuracy` | mean over the first `eval.expected_size` eval prompts of the teacher-forced probability exp Σ_t log π(y*_t) of the canonical answer y* (EOS included) at the sampler's temperature, untruncated: the expected sampled accuracy without sampling noise where y* is the only correct answer and top_p = 1 (arithmetic, sort, sort_long); a lower bound for countdown (moe_rl.trainer.evaluate) |
| `eval/accuracy_greedy` | greedy decoding on the same `eval.expected_size` prompts |
| `eval/initial/*` | the eval keys above for the policy before the first update, in step 0's row only (`eval.at_start`); a resumed run keeps its first session's |
| `time/eval_s` | wall seconds of the row's evaluations (the initial one included in step 0's row) |
"""
