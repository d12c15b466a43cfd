"""The run's sampler (moe_rl.trainer.sampling.build_sampler): which sampler each hf config builds, and
whether it is exact, which alone decides the step's mismatch diagnostics."""

import pytest

from moe_rl.rollout.engines import ENGINES
from moe_rl.trainer.run import build_context
from moe_rl.trainer.sampling import BUILDERS
from tests.integration.test_train_loop import TINY, compose_config

BASE = [*TINY, "warmstart.enabled=false", "trainer.steps=4"]


@pytest.mark.parametrize(
    ("overrides", "kind", "exact"),
    [
        ([], "PolicySampler", True),
        (["trainer.sampler_dtype=bfloat16"], "CopySampler", False),
        (["trainer.sampler_dtype=float32"], "PolicySampler", False),  # a sampler precision asked for: diagnosed
        (["rollout.staleness=1"], "StaleSampler", False),
        (["rollout.staleness=1", "rollout.overlap=true"], "OverlapSampler", False),
    ],
)
def test_each_config_builds_its_sampler_and_only_the_policy_itself_is_exact(overrides, kind, exact):
    """The policy itself is exact; a copy at another dtype, a stale sampler or an explicit sampler dtype are
    not, and the step logs the mismatch diagnostics exactly when its sampler is not exact."""
    ctx, _ = build_context(compose_config([*BASE, *overrides]))
    try:
        assert type(ctx.sampler).__name__ == kind
        assert ctx.sampler.exact is exact
        assert ctx.objective.mismatch is not exact
    finally:
        ctx.sampler.close()


def test_every_engine_has_a_sampler_row():
    """Every sampler.engine the schema accepts has a row in the factory's table (a missing one fails here,
    not as a KeyError at start-up)."""
    assert set(BUILDERS) == set(ENGINES)
