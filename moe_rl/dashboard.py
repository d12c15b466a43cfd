"""`moe-rl-dashboard`: a W&B saved workspace and one report per ablation, built in code.

    moe-rl-dashboard --entity ME --project moe-rl                         # workspace over every run, all reports
    moe-rl-dashboard --entity ME --project moe-rl --experiment stability  # that experiment's runs and report
    moe-rl-dashboard --entity ME --project moe-rl --group NAME            # one sweep (W&B group) only
    moe-rl-dashboard --entity ME --project moe-rl --dry-run               # print the specs as JSON, no network

The specs are plain data (`Panel`, `Section`, `ReportSpec` below): what each panel plots is a metric key
that `moe-rl-train` logs (moe_rl/trainer/__init__.py) or a regex over such keys. They become
`wandb-workspaces` objects (`pip install -e ".[wandb]"`) only in `build_workspace` / `build_report`, and
only `save` needs the network and `wandb login`.

- The workspace groups runs by `objective.preset` and `routing.replay` (both in every run's W&B config)
  and has one section per quantity of the GSPO paper: learning, clipping (log scale), ratios, routing
  volatility, mismatch, collapse, time and throughput; and one for the 2026 rivals (VESPO's φ, DPPO's
  divergence, partial replay's replace rate, VCPO's step scale).
- A report per ablation (`conf/experiment/<name>.yaml`) filters the runs to that experiment, groups them by
  the config fields its sweep varies, holds the panels that reproduce its figure and quotes the
  experiment file's header comment. Re-running updates the reports of the same title, and the workspace
  given with `--workspace-url` (without it a new saved workspace is created).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPBY = ("objective.preset", "routing.replay")

@dataclass(frozen=True)
class Panel:
    """A line plot against the RL step: one line per key (and per key matching `regex`) per run group."""

    title: str
    keys: tuple[str, ...] = ()
    regex: str | None = None
    log_y: bool = False


@dataclass(frozen=True)
class Section:
    """A named, open section of the workspace."""

    name: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class ReportSpec:
    """One ablation's report: its runs (filtered by experiment), grouping, panels and text."""

    experiment: str
    title: str
    groupby: tuple[str, ...]
    panels: tuple[Panel, ...]
    text: str = ""


REWARD = Panel("train reward", ("rollout/reward/mean",))
EVAL = Panel("held-out eval accuracy", ("eval/accuracy", "eval/accuracy_greedy", "eval/expected_accuracy"))
LENGTH = Panel("response length", ("rollout/response_len/mean", "eval/response_len"))
CLIP_TOKEN = Panel("clipped token fraction", ("clip/token_frac",), log_y=True)
CLIP_SEQ = Panel("clipped sequence fraction", ("clip/seq_frac",), log_y=True)
CLIP_SIDES = Panel("clipped low / high", ("clip/low_frac", "clip/high_frac"), log_y=True)
TOKEN_VAR = Panel("token-ratio variance", ("ratio/token/var",), log_y=True)
WITHIN_SEQ_VAR = Panel("within-sequence token-ratio variance", ("ratio/token/within_seq_var",), log_y=True)
SEQ_VAR = Panel("sequence-ratio variance", ("ratio/seq/var",), log_y=True)
EXTREMES = Panel("token-ratio extremes", ("ratio/token/max", "ratio/token/min"), log_y=True)
SEQ_EXTREMES = Panel("sequence-ratio extremes", ("ratio/seq/max", "ratio/seq/min"), log_y=True)
KL = Panel("per-update KL(π_old ‖ π_θ)", ("policy/approx_kl",), log_y=True)
OVERLAP = Panel("later mini-batch rows already seen", ("minibatch/sibling_frac", "minibatch/duplicate_frac"))
EXTREME_FRAC = Panel("token ratios outside the extreme band", ("ratio/token/extreme_frac",))
CHANGE = Panel(
    "expert change after one update", ("routing/expert_change/after_one_update", "routing/expert_change/frac")
)
CHANGE_RESPONSE = Panel("expert change over response tokens", ("routing/expert_change/response_frac",))
CHANGE_LAYERS = Panel("expert change per layer", regex=r"^routing/expert_change/layer_\d+$")
ROLLOUT_VS_OLD = Panel("routing disagreement: rollout vs old policy", ("routing/rollout_vs_old/frac",))
MARGINS = Panel("router margins z_(k) - z_(k+1) (old policy)", ("routing/margin/median", "routing/margin/p10"), log_y=True)
PREDICTED = Panel(
    "expert change after one update: measured vs predicted by the margins",
    ("routing/expert_change/after_one_update", "routing/margin/predicted_change"),
    log_y=True,
)
LOGIT_SHIFT = Panel("router-logit shift of one update", ("routing/logit_shift/after_one_update",), log_y=True)
VS_SAMPLER = Panel("expert change: stale sampler vs proximal policy", ("routing/expert_change/vs_sampler", "staleness/mean"))
LOGP_DIFF = Panel("log-prob difference: sampler vs old policy", ("mismatch/logp_abs_diff/mean",), log_y=True)
MISMATCH_KL = Panel("trainer-sampler mismatch: k3 KL, JS and KL / entropy",
                    ("mismatch/k3_kl", "mismatch/js_divergence", "mismatch/kl_ent_ratio"), log_y=True)
MISMATCH_TOKENS = Panel("mismatch per token: mean e^|Δ| (NeMo-RL's gate) and |Δ| > ln 2",
                        ("mismatch/token_mult_prob_error", "mismatch/extreme_frac"))
RIVALS = Panel("rivals' weights: VESPO's φ, DPPO's divergence and truncated weights",
               regex=r"^policy/(vespo_phi/mean|dppo_truncated_frac|dppo_divergence/mean)$")
REPLACE = Panel("partial replay: replayed slots the live router replaced",
                regex=r"^routing/replay_replace_rate(/layer_\d+)?$")
ESS_SCALE = Panel("ESS step scale (VCPO): the lr factor of each step", regex=r"^train/ess_lr_factor$")
EVENTS_BY_KIND = Panel("collapse events by kind", regex=r"^collapse/kind/\w+$")
EVENTS = Panel("collapse events", ("collapse/events",))
ENTROPY = Panel("sampler entropy (nats)", ("rollout/entropy/mean",))
STAGES = Panel(
    "seconds per step, by stage", ("time/step_s", "time/rollout_s", "time/old_forward_s", "time/train_s")
)
LENGTH_TOKEN_VAR = Panel("token-ratio variance by response length", regex=r"^length/\d+-\d+/token_var$", log_y=True)
LENGTH_WITHIN_VAR = Panel(
    "within-sequence variance by response length", regex=r"^length/\d+-\d+/within_seq_var$", log_y=True
)
LENGTH_SEQ_VAR = Panel("sequence-ratio variance by response length", regex=r"^length/\d+-\d+/seq_var$", log_y=True)
LENGTH_SEQS = Panel("sequences per length bin", regex=r"^length/\d+-\d+/seqs$")
GRAD = Panel("gradient norm before clipping", ("train/grad_norm", "train/grad_norm/max"), log_y=True)
GRAD_CLIP = Panel("updates clipped, and the scale clipping applied", ("train/grad_clipped_frac", "train/grad_clip_scale"))
EXTREME_SHARE = Panel("gradient weight carried by extreme ratios", ("policy/extreme_weight_share",))
LOAD_CV = Panel("expert load imbalance (CV over experts)", ("routing/load_cv/mean",))
THROUGHPUT = Panel("throughput (tokens/s)", ("throughput/tokens_per_s", "throughput/sampler_tokens_per_s"))

SECTIONS = (
    Section("learning", (REWARD, EVAL, LENGTH)),
    Section("clipping", (CLIP_TOKEN, CLIP_SEQ, CLIP_SIDES, KL, OVERLAP)),
    Section("ratios", (TOKEN_VAR, WITHIN_SEQ_VAR, SEQ_VAR, EXTREMES, SEQ_EXTREMES, EXTREME_FRAC, LENGTH_TOKEN_VAR,
                       LENGTH_SEQ_VAR)),
    Section("routing volatility", (CHANGE, CHANGE_RESPONSE, CHANGE_LAYERS, ROLLOUT_VS_OLD, MARGINS, PREDICTED,
                                   LOGIT_SHIFT)),
    Section("mismatch", (LOGP_DIFF, ROLLOUT_VS_OLD, MISMATCH_KL, MISMATCH_TOKENS)),
    Section("rivals", (RIVALS, REPLACE, ESS_SCALE, CLIP_SIDES, KL)),
    Section("collapse", (EVENTS_BY_KIND, EVENTS, ENTROPY, EXTREME_SHARE)),
    Section("gradients", (GRAD, GRAD_CLIP)),
    Section("time and throughput", (STAGES, THROUGHPUT)),
)

# One per conf/experiment/<name>.yaml ablation (its <name>__<part>.yaml parts share it: they log the same
# `experiment`); `groupby` is what its sweep varies (hydra.sweeper.params).
REPORTS = (
    ReportSpec("stability", "Stability: GSPO vs GRPO + Routing Replay vs GRPO (Fig. 1, 3)", GROUPBY,
               (REWARD, EVAL, LENGTH, STAGES)),
    ReportSpec("clipping", "Clipping: fraction of clipped tokens (Fig. 2)",
               ("objective.preset", "trainer.group_minibatches"), (CLIP_TOKEN, CLIP_SEQ, CLIP_SIDES, KL, OVERLAP)),
    ReportSpec("volatility", "Expert volatility after each update (§5.3)",
               ("model.num_layers", "model.num_experts", "trainer.lr"), (CHANGE, CHANGE_LAYERS)),
    ReportSpec("length", "Length and noise: ratio variance by response length within one policy (§3)",
               ("objective.preset",), (LENGTH_TOKEN_VAR, LENGTH_WITHIN_VAR, LENGTH_SEQ_VAR, LENGTH_SEQS, LENGTH)),
    ReportSpec("replay_source", "Replay source: off vs old (R2) vs rollout (R3), fp32 and bf16 sampler",
               (*GROUPBY, "trainer.sampler_dtype"), (LOGP_DIFF, ROLLOUT_VS_OLD, REWARD, TOKEN_VAR)),
    ReportSpec("replay_source_vllm", "Replay source with a vLLM sampler: hf vs vLLM engine, fp32 and bf16",
               (*GROUPBY, "sampler.engine", "trainer.sampler_dtype"), (LOGP_DIFF, ROLLOUT_VS_OLD, REWARD, STAGES)),
    ReportSpec("collapse_stress", "Collapse under stress: staleness and learning rate",
               ("objective.preset", "trainer.lr"), (EVENTS_BY_KIND, EVENTS, REWARD, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("lr_calibration", "Step size: per-update KL and clipping against the learning rate",
               ("objective.preset", "trainer.lr"), (KL, CLIP_TOKEN, TOKEN_VAR, SEQ_VAR, OVERLAP)),
    ReportSpec("drift_dose_fixes", "Drift dose-response of CISPO and GMPO",
               ("objective.preset", "routing.drift"),
               (EVAL, EVENTS_BY_KIND, CHANGE_RESPONSE, TOKEN_VAR, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("stability_fine", "Stability in the natural high-volatility regime (claim 1)", GROUPBY,
               (EVAL, REWARD, EVENTS_BY_KIND, CHANGE, TOKEN_VAR)),
    ReportSpec("natural_search", "Natural volatility: expert change after one update, and learning, by setting",
               ("model.num_experts", "trainer.lr", "trainer.mini_batches"), (CHANGE, CHANGE_RESPONSE, EVAL, REWARD)),
    ReportSpec("routers", "Routers like a pretrained MoE's: natural expert change against balancing and experts",
               ("model.num_experts", "warmstart.pretrain_steps", "model.router_aux_loss_coef", "trainer.lr"),
               (CHANGE, PREDICTED, MARGINS, LOGIT_SHIFT, EVAL)),
    ReportSpec("drift_dose", "Drift dose-response: stability against injected routing drift (claim 1)",
               ("objective.preset", "routing.replay", "routing.drift"),
               (EVAL, EVENTS_BY_KIND, CHANGE_RESPONSE, TOKEN_VAR, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("noise_dose", "Noise dose-response: claim 1 under router-logit noise, over 150 steps",
               ("objective.preset", "routing.replay", "routing.logit_noise"),
               (EVAL, EVENTS_BY_KIND, CHANGE, EXTREME_SHARE, TOKEN_VAR, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("safety_nets", "Safety nets off: gradient clipping and dual-clip under router-logit noise",
               ("objective.preset", "routing.replay", "routing.logit_noise", "trainer.grad_clip"),
               (EVAL, GRAD, GRAD_CLIP, KL, EVENTS_BY_KIND, EXTREMES)),
    ReportSpec("critical_lr", "Critical step size: regression against lr, with and without router-logit noise",
               ("objective.preset", "routing.replay", "routing.logit_noise", "trainer.lr"),
               (EVAL, EVENTS_BY_KIND, KL, CHANGE)),
    ReportSpec("critical_lr_redo", "Critical step size redone: 6 seeds on a grid that brackets each arm's best lr",
               ("objective.preset", "routing.replay", "routing.logit_noise", "trainer.lr"),
               (EVAL, EVENTS_BY_KIND, KL, CHANGE)),
    ReportSpec("safety_nets_long", "Safety nets off on the long-response task, under router-logit noise",
               (*GROUPBY, "trainer.grad_clip"), (EVAL, GRAD, GRAD_CLIP, KL, EVENTS_BY_KIND, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("natural_balanced", "Natural volatility with balanced fine-grained routers: change, KL and learning",
               ("model.num_experts", "model.num_layers", "model.router_aux_loss_coef", "trainer.lr",
                "trainer.mini_batches"), (CHANGE, CHANGE_RESPONSE, KL, PREDICTED, MARGINS, EVAL)),
    ReportSpec("stability_natural", "Claim 1 in the natural regime of balanced 128-expert routers, over 150 steps",
               GROUPBY, (EVAL, EVENTS_BY_KIND, CHANGE, KL, EXTREME_SHARE, EXTREMES)),
    ReportSpec("replay_offpolicy", "R2 vs R3 vs off-policiness (arXiv 2512.01374): mismatch source x mini-batches",
               (*GROUPBY, "trainer.sampler_dtype", "routing.logit_noise", "trainer.mini_batches"),
               (EVAL, LOGP_DIFF, ROLLOUT_VS_OLD, KL, EVENTS_BY_KIND, EXTREMES, STAGES)),
    ReportSpec("router_lr_calibration", "The router's learning rate as a natural volatility dose: calibration",
               ("model.num_experts", "trainer.router_lr_scale"), (CHANGE, KL, LOAD_CV, PREDICTED, MARGINS, EVAL)),
    ReportSpec("router_lr_dose", "Claim 1 under a faster router: GRPO vs GRPO + R2 vs GSPO at router lr x1 and x30",
               (*GROUPBY, "trainer.router_lr_scale"), (EVAL, CHANGE, KL, LOAD_CV, EVENTS_BY_KIND, EXTREMES)),
    ReportSpec("router_lr_own_lr", "Router lr dose at each arm's own step size: GRPO, R2, GSPO, SAPO x router lr x lr",
               (*GROUPBY, "trainer.router_lr_scale", "trainer.lr"), (EVAL, CHANGE, KL, LOAD_CV, EVENTS_BY_KIND, EXTREMES)),
    ReportSpec("replay_variants", "Replay variants: fp32 routers and replayed gates against the bf16 mismatch",
               (*GROUPBY, "model.router_dtype", "routing.replay_gates"), (LOGP_DIFF, ROLLOUT_VS_OLD, REWARD, TOKEN_VAR)),
    ReportSpec("confirm_sort_long", "Confirmatory (pre-registered): sustained regression of GRPO vs GRPO + R2 on sort_long, σ = 0.3, clipping off",
               (*GROUPBY, "trainer.lr"), (EVAL, EVENTS_BY_KIND, GRAD, KL, CHANGE, EXTREMES, SEQ_EXTREMES)),
    ReportSpec("replay_staleness", "R2 vs R3 vs real staleness: replay arms x rollout.staleness",
               (*GROUPBY, "rollout.staleness"), (EVAL, VS_SAMPLER, LOGP_DIFF, KL, EVENTS_BY_KIND, EXTREMES)),
    ReportSpec("stale_rivals", "Where GRPO fails (pre-registered): GSPO, replay and the rivals under real staleness",
               (*GROUPBY, "rollout.staleness", "trainer.lr"),
               (EVAL, VS_SAMPLER, MISMATCH_KL, MISMATCH_TOKENS, RIVALS, KL, EVENTS_BY_KIND, EXTREMES)),
)  # fmt: skip


def _plain(spec: Panel | Section | ReportSpec) -> dict:
    """A spec as plain JSON data (tuples become lists), equal to what --dry-run prints and reads back."""
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def experiment_text(name: str, conf_dir: Path = CONF_DIR) -> str:
    """The header comment of conf/experiment/<name>.yaml (without `# @package`), as one paragraph."""
    lines = (conf_dir / "experiment" / f"{name}.yaml").read_text().splitlines()
    comment = []
    for line in lines:
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package") and not text.startswith("moe-rl-train"):
            comment.append(text)
    return " ".join(comment)


def run_filter(experiment: str | None, group: str | None) -> str:
    """W&B filter expression selecting the runs (empty: every run of the project)."""
    parts = [f"Config('experiment') = '{experiment}'"] if experiment else []
    parts += [f"Metric('Group') = '{group}'"] if group else []
    return " and ".join(parts)


def workspace_spec(
    entity: str, project: str, experiment: str | None = None, group: str | None = None
) -> dict:
    """The saved workspace as JSON-able data."""
    # W&B refuses symbols in workspace names ("=" included).
    name = ", ".join(
        ["moe-rl"] + [f"{k} {v}" for k, v in (("experiment", experiment), ("group", group)) if v]
    )
    return {
        "entity": entity,
        "project": project,
        "name": name,
        "filters": run_filter(experiment, group),
        "groupby": list(GROUPBY),
        "sections": [_plain(s) for s in SECTIONS],
    }


def report_specs(
    entity: str,
    project: str,
    experiment: str | None = None,
    group: str | None = None,
    conf_dir: Path = CONF_DIR,
) -> list[dict]:
    """One report per ablation (only `experiment`'s when given) as JSON-able data."""
    specs = [r for r in REPORTS if experiment in (None, r.experiment)]
    return [
        {
            **_plain(dataclasses.replace(r, text=experiment_text(r.experiment, conf_dir))),
            "entity": entity,
            "project": project,
            "filters": run_filter(r.experiment, group),
        }
        for r in specs
    ]


def _line_plot(panel: dict) -> Any:
    import wandb_workspaces.reports.v2 as wr

    return wr.LinePlot(
        title=panel["title"], y=list(panel["keys"]), metric_regex=panel["regex"], log_y=panel["log_y"] or None
    )


def build_workspace(spec: dict) -> Any:
    """The `wandb_workspaces.workspaces.Workspace` for `workspace_spec(...)`; no network."""
    import wandb_workspaces.workspaces as ws

    sections = [
        ws.Section(name=s["name"], panels=[_line_plot(p) for p in s["panels"]], is_open=True)
        for s in spec["sections"]
    ]
    runset = ws.RunsetSettings(filters=spec["filters"], groupby=[ws.Config(key) for key in spec["groupby"]])
    return ws.Workspace(
        entity=spec["entity"],
        project=spec["project"],
        name=spec["name"],
        sections=sections,
        runset_settings=runset,
    )


def build_report(spec: dict) -> Any:
    """The `wandb_workspaces.reports.v2.Report` for one of `report_specs(...)`; no network."""
    import wandb_workspaces.reports.v2 as wr

    # The runset's entity and project are filled in by `save`: with them set, wandb-workspaces looks the
    # project up over the network to serialise the report.
    runset = wr.Runset(
        name=spec["experiment"],
        filters=spec["filters"],
        groupby=[f"config.{key}" for key in spec["groupby"]],
    )
    grid = wr.PanelGrid(runsets=[runset], panels=[_line_plot(p) for p in spec["panels"]])
    blocks = [
        wr.P(spec["text"]),
        wr.P(f"Runs: experiment={spec['experiment']}, grouped by {', '.join(spec['groupby'])}."),
        grid,
    ]
    return wr.Report(
        project=spec["project"],
        entity=spec["entity"],
        title=spec["title"],
        description=spec["text"],
        blocks=blocks,
    )


def library_json(obj: Any) -> dict:
    """What wandb-workspaces sends to W&B for a built workspace or report: its own pydantic model, dumped."""
    return obj._to_model().model_dump(mode="json", by_alias=True, exclude_none=True)


def save(workspace: Any, reports: list[Any], workspace_url: str | None) -> list[str]:
    """Save to W&B (network, `wandb login`): update the workspace at `workspace_url` or create one; update
    each report of the same title in the project or create it. Returns the URLs."""
    import wandb
    import wandb_workspaces.workspaces as ws

    if workspace_url:
        existing = ws.Workspace.from_url(workspace_url)
        existing.sections, existing.runset_settings = workspace.sections, workspace.runset_settings
        workspace = existing
    urls = [workspace.save().url]
    api = wandb.Api()
    for report in reports:
        for block in report.blocks:
            for runset in getattr(block, "runsets", []):
                runset.entity, runset.project = report.entity, report.project
        same = [r for r in api.reports(f"{report.entity}/{report.project}") if r.display_name == report.title]
        if same:
            report.id = same[0].id
        report.save()
        urls.append(report.url)
    return urls


def main(argv: list[str] | None = None) -> int:
    """Console entry point: build the specs; print them (--dry-run) or save them to W&B."""
    parser = argparse.ArgumentParser(prog="moe-rl-dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True, help="W&B entity (team or user)")
    parser.add_argument("--project", default="moe-rl", help="W&B project (default: moe-rl)")
    parser.add_argument("--experiment", help="only this experiment's runs, and only its report")
    parser.add_argument("--group", help="only the runs of this W&B group (a sweep folder's name)")
    parser.add_argument("--workspace-url", help="update this saved workspace instead of creating one")
    parser.add_argument("--dry-run", action="store_true", help="print the specs as JSON; no network")
    parser.add_argument(
        "--library-json", action="store_true", help="with --dry-run: print what wandb-workspaces would send"
    )
    args = parser.parse_args(argv)
    if args.experiment and not (CONF_DIR / "experiment" / f"{args.experiment}.yaml").exists():
        parser.error(f"--experiment={args.experiment}: no conf/experiment/{args.experiment}.yaml")
    spec = workspace_spec(args.entity, args.project, args.experiment, args.group)
    reports = report_specs(args.entity, args.project, args.experiment, args.group)
    if args.dry_run and not args.library_json:
        print(json.dumps({"workspace": spec, "reports": reports}, indent=2))
        return 0
    try:
        workspace, built = build_workspace(spec), [build_report(r) for r in reports]
    except ImportError:
        parser.error('needs wandb-workspaces: pip install -e ".[wandb]"')
    if args.dry_run:
        dump = {"workspace": library_json(workspace), "reports": [library_json(r) for r in built]}
        print(json.dumps(dump, indent=2))
        return 0
    for url in save(workspace, built, args.workspace_url):
        print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
