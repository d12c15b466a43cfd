"""Config validation and the registry read one declaration: each objective is built from its
`CAPABILITIES` row, and the torch-free option names are the ones the math implements."""

from __future__ import annotations

from dataclasses import fields

from moe_rl.objectives import CAPABILITIES, OBJECTIVES, Capabilities
from moe_rl.objectives.capabilities import AGGREGATION_NAMES, KL_ESTIMATOR_NAMES
from moe_rl.objectives.common import AGGREGATIONS, IS_WEIGHTED_KL, KL_ESTIMATORS


def test_every_objective_states_its_row():
    """The registry has one objective per row, and each objective's capabilities are exactly its row's."""
    assert OBJECTIVES.keys() == CAPABILITIES.keys()
    for name, obj in OBJECTIVES.items():
        row = CAPABILITIES[name]
        assert {f.name: getattr(obj, f.name) for f in fields(Capabilities)} == vars(row), name


def test_the_declared_names_are_the_implemented_ones():
    """The loss_agg and kl_estimator names validation accepts are those common.py implements, in order."""
    assert tuple(AGGREGATIONS) == AGGREGATION_NAMES
    assert (*KL_ESTIMATORS, *IS_WEIGHTED_KL) == KL_ESTIMATOR_NAMES
