"""The replay sources' table (moe_rl.routing.config.REPLAY) states the contracts of R2 and R3: which routing
each forward uses, what the replay reads, and what it is immune to."""

from __future__ import annotations

import pytest

from moe_rl.routing.config import (
    FREE,
    OLD_POLICY,
    PERTURBATIONS,
    REPLAY,
    REPLAY_SOURCES,
    SAMPLER,
    RoutingConfig,
)


def test_every_replay_source_has_a_well_formed_row():
    """Every accepted routing.replay value has a row, with known routings and perturbations only."""
    assert REPLAY_SOURCES == tuple(REPLAY) == ("off", "old", "rollout")
    for row in REPLAY.values():
        assert row.old_forward in (FREE, SAMPLER)
        assert row.update_forward in (FREE, OLD_POLICY, SAMPLER)
        assert set(row.immune_to) <= set(PERTURBATIONS)


def test_r2_and_r3_read_what_the_papers_replay():
    """off replays nothing; R2 (old) replays the old-policy forward's routing in the update forwards; R3
    (rollout) replays the sampler's in the old-policy and update forwards."""
    assert (REPLAY["off"].replays, REPLAY["off"].recorded) == (False, None)
    assert (REPLAY["old"].old_forward, REPLAY["old"].recorded) == (FREE, OLD_POLICY)
    assert (REPLAY["rollout"].old_forward, REPLAY["rollout"].recorded) == (SAMPLER, SAMPLER)


@pytest.mark.parametrize("replay, immune", [("off", ()), ("old", ("drift", "update_noise")),
                                            ("rollout", ("drift", "update_noise", "trainer_noise"))])
def test_what_each_replay_is_immune_to(replay, immune):
    """Replay wins over drift; R2 and R3 are immune to update-scope noise; only R3 to trainer-scope noise."""
    assert [p for p in PERTURBATIONS if REPLAY[replay].immune(p)] == list(immune)


def test_an_unknown_source_is_refused_naming_the_rows():
    """routing.replay outside the table is a ValueError naming the field and every row."""
    with pytest.raises(ValueError, match=r"routing.replay='r4': expected one of \('off', 'old', 'rollout'\)"):
        RoutingConfig(replay="r4").validate()
