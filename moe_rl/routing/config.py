"""The routing section's schema: which routing the trainer's forwards use (replay source, noise, drift).

`RoutingConfig` is composed into `moe_rl.config.Config` as `routing`; `validate` checks the fields that read
routing.* alone (the checks across sections are `Config.validate`'s). Imports nothing heavier than dataclasses.

`REPLAY` has one row per replay source (routing.replay), read by `moe_rl.trainer.plan.RoutingPlan`; no module
outside moe_rl/routing/ compares routing.replay with a name:

| replay | old-policy forward | update forwards | replay reads | immune to |
|---|---|---|---|---|
| off | free | free | nothing | nothing |
| old (R2) | free | the old-policy forward's routing | the old-policy forward's trace | drift, logit noise of scope update |
| rollout (R3) | the sampler's routing | the sampler's routing | the sampler's trace | drift, logit noise of either scope |

No replay is immune to routing.weight_noise: it changes the policy itself, so the sampler sees it too.
"""

from __future__ import annotations

from dataclasses import dataclass

FREE, OLD_POLICY, SAMPLER = "free", "old_policy", "sampler"
"""The routing a forward can use: its routers' own top-k, or the recorded routing of the old-policy forward
or of the sampler."""
PERTURBATIONS = ("drift", "update_noise", "trainer_noise")
"""The injected perturbations a replay can be immune to: routing.drift, and routing.logit_noise under
routing.noise_scope=update or trainer (`f"{noise_scope}_noise"`)."""


@dataclass(frozen=True)
class Replay:
    """One replay source: which routing each forward of an RL step uses, and what the replay is immune to."""

    old_forward: str
    """The routing of the old-policy forward: FREE, or SAMPLER (R3 replays the sampler's)."""
    update_forward: str
    """The routing of the update forwards: FREE, OLD_POLICY (R2) or SAMPLER (R3)."""
    immune_to: tuple[str, ...]
    """The PERTURBATIONS its forwards ignore because the replayed experts win (drift), or because the
    routing it replays was recorded clean (logit noise)."""

    @property
    def recorded(self) -> str | None:
        """The recorded trace the update forwards replay (expert ids [B, T, L, K], and their gates under
        routing.replay_gates): OLD_POLICY or SAMPLER; None when they route freely."""
        return None if self.update_forward == FREE else self.update_forward

    @property
    def replays(self) -> bool:
        """Whether the update forwards replay recorded routing (R2 or R3)."""
        return self.recorded is not None

    def immune(self, perturbation: str) -> bool:
        """Whether the replay's forwards ignore `perturbation` (one of PERTURBATIONS)."""
        assert perturbation in PERTURBATIONS, perturbation
        return perturbation in self.immune_to


REPLAY: dict[str, Replay] = {
    "off": Replay(old_forward=FREE, update_forward=FREE, immune_to=()),
    "old": Replay(old_forward=FREE, update_forward=OLD_POLICY, immune_to=("drift", "update_noise")),
    "rollout": Replay(old_forward=SAMPLER, update_forward=SAMPLER,
                      immune_to=("drift", "update_noise", "trainer_noise")),
}
"""routing.replay -> its row (the table in the module docstring)."""
REPLAY_SOURCES = tuple(REPLAY)
NOISE_GROWTH = ("sqrt", "constant")
NOISE_SCOPES = ("update", "trainer")


@dataclass
class RoutingConfig:
    """Routing replay: which recorded routing the update forwards use."""

    replay: str = "off"
    """off: routers choose freely; old: the old-policy forward's routing (Routing Replay, R2);
    rollout: the sampler's routing in the old-policy and update forwards (rollout routing replay, R3)."""
    drift: float = 0.0
    """Injected routing drift p in [0, 1]: *expert dropout* in the policy's update forwards, not re-routing.
    In a fraction p of (token, MoE layer) slots one of the router's top-k experts (uniformly, so half the
    time the top-1 at top-2) is swapped for a uniformly random one it did not choose (moe_rl.routing.Drift),
    whatever the router's margins; the swapped-in expert's gate comes from the live router. At matched
    expert change it moves log-probs several times more than natural re-routing or routing.logit_noise
    (moe-rl-calibrate), and it cannot tell R2 from R3 (both switch it off). Expert change grows by about p / top_k. The sampler and
    the old-policy forward never drift, and replay wins: under routing.replay=old or rollout the replayed
    experts are used and the drift has no effect. Draws come from their own generator, seeded from
    (seed, step, mini-batch), so changing p never changes the rollouts."""
    drift_from_minibatch: int = 2
    """First mini-batch (1-based) of each step whose update forward drifts. 2 (default): only the
    off-policy mini-batches, modelling update-induced volatility (GSPO paper, section 5.3). 1: the
    on-policy mini-batch too, modelling sampler/trainer routing mismatch (as studied for R3)."""
    logit_noise: float = 0.0
    """Router-logit noise σ >= 0: the paper's expert volatility as a control (moe_rl.routing.noise). The
    perturbed forwards take their top-k on logits + σ_j·ε, ε ~ N(0, 1) per (step, row, token position,
    layer, expert), the same ε in every forward of the step; gates come from the live logits, as under
    replay. So only tokens whose k-th and (k+1)-th logits nearly tie flip, to the runner-up. σ_j is set
    by routing.noise_growth; which forwards are perturbed by routing.noise_scope. Replay wins. Unlike
    routing.drift (expert dropout: a uniformly random swap whatever the margins), this is re-routing."""
    noise_growth: str = "sqrt"
    """sqrt (default): mini-batch j (1-based) uses σ·sqrt(j - 1), so the on-policy mini-batch is exact and
    the change grows with staleness, like a random walk of the router over the updates it has seen.
    constant: σ in every perturbed forward (needed by noise_scope=trainer)."""
    noise_scope: str = "update"
    """update (default): only the update forwards are perturbed (update-induced volatility); R2 and R3
    replay the old policy's or the sampler's clean routing, so both are immune. trainer: the old-policy
    forward and the update forwards alike, with one ε, against a clean sampler (sampler/trainer routing
    mismatch): R2 replays the old forward's perturbed routing, so only R3 is immune."""
    replay_gates: bool = False
    """Under replay (old or rollout): combine the replayed experts with the recorded gates too, not the live
    router's softmax over them (prime-rl's "total router recall" draft). The update forward then reproduces
    the recorded forward's mixture exactly, and the loss sends the routers no gradient (only the
    load-balancing loss, model.router_aux_loss_coef, trains them). False (default): ids only, gates live."""
    replay_score_ratio: float = 0.0
    """Partial replay (prime-rl's score-threshold router replay, PR #2703), ratio in [0, 1]: a replayed expert
    is kept only if the trainer router's own score for it (its softmax over the experts) is >= ratio x the
    weakest score in the trainer's own top-k; a rejected slot is refilled, in rank order, from the trainer's
    own top-k, never duplicating an expert (moe_rl.routing.partial). Logged as routing/replay_replace_rate.
    0 (default): plain replay. Needs routing.replay=old or rollout, and live gates (replay_gates=false)."""
    freeze_router: bool = False
    """Keep every router's weights fixed for the whole run (no gradient, no optimizer update, not even from
    the load-balancing loss). With routing.replay_gates=true this is prime-rl's "total router recall"
    exactly: replayed ids, replayed gates, router frozen. Needs routing.replay_gates=true."""
    weight_noise: float = 0.0
    """Persistent alternative, σ_w >= 0: after each optimizer step every router's weight matrix gets
    N(0, σ_w²) added element-wise (seeded from (seed, step, mini-batch)), so the perturbation is part of
    the policy: the sampler, the old-policy forward and eval all see it, and it accumulates."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the checks that read routing.* alone)."""
        if self.replay not in REPLAY_SOURCES:
            raise ValueError(f"routing.replay={self.replay!r}: expected one of {REPLAY_SOURCES}")
        if not 0 <= self.drift <= 1:  # also false for NaN
            raise ValueError(f"routing.drift={self.drift}: must be in [0, 1]")
        if self.drift_from_minibatch < 1:
            raise ValueError(f"routing.drift_from_minibatch={self.drift_from_minibatch}: must be >= 1")
        if self.logit_noise < 0 or self.weight_noise < 0:
            raise ValueError(
                f"routing.logit_noise={self.logit_noise}, routing.weight_noise={self.weight_noise}: must be >= 0"
            )
        if self.replay_gates and self.replay == "off":
            raise ValueError(
                "routing.replay_gates=true replays recorded gates with the replayed experts, so it needs "
                "routing.replay=old or rollout"
            )
        if not 0 <= self.replay_score_ratio <= 1:
            raise ValueError(f"routing.replay_score_ratio={self.replay_score_ratio}: must be in [0, 1]")
        if self.replay_score_ratio and self.replay == "off":
            raise ValueError(
                f"routing.replay_score_ratio={self.replay_score_ratio} filters replayed experts, so it needs "
                "routing.replay=old or rollout"
            )
        if self.replay_score_ratio and self.replay_gates:
            raise ValueError(
                f"routing.replay_score_ratio={self.replay_score_ratio} refills rejected slots from the live router, "
                "which has no recorded gate for them: set routing.replay_gates=false or replay_score_ratio=0"
            )
        if self.freeze_router and not self.replay_gates:
            raise ValueError(
                "routing.freeze_router=true is total router recall with routing.replay_gates=true (replayed ids "
                "and gates, router fixed): set routing.replay_gates=true (and routing.replay=old or rollout)"
            )
        if self.noise_growth not in NOISE_GROWTH:
            raise ValueError(f"routing.noise_growth={self.noise_growth!r}: expected one of {NOISE_GROWTH}")
        if self.noise_scope not in NOISE_SCOPES:
            raise ValueError(f"routing.noise_scope={self.noise_scope!r}: expected one of {NOISE_SCOPES}")
        if self.logit_noise > 0 and self.drift > 0:
            raise ValueError(
                f"routing.logit_noise={self.logit_noise} and routing.drift={self.drift}: choose one perturbation"
            )
        if self.logit_noise > 0 and self.noise_scope == "trainer" and self.noise_growth != "constant":
            raise ValueError(
                "routing.noise_scope=trainer perturbs the old-policy forward, which has seen no update, "
                "so its noise cannot grow with staleness: set routing.noise_growth=constant"
            )
