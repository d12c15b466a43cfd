"""The registry of objectives: one name, one `Objective`, the one lookup the trainer makes."""

from __future__ import annotations

from moe_rl.objectives.capabilities import CAPABILITIES
from moe_rl.objectives.cispo import CISPO
from moe_rl.objectives.dppo import DPPO_KL, DPPO_TOPK_KL, DPPO_TOPK_TV, DPPO_TV
from moe_rl.objectives.gmpo import GMPO
from moe_rl.objectives.grpo import GRPO
from moe_rl.objectives.gspo import GSPO, GSPO_TOKEN
from moe_rl.objectives.sapo import SAPO, SAPO_SEQ
from moe_rl.objectives.surrogate import Objective
from moe_rl.objectives.vespo import LUSPO, VESPO

OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (GRPO, GSPO, GSPO_TOKEN, CISPO, GMPO, SAPO, SAPO_SEQ, VESPO, LUSPO, DPPO_TV, DPPO_KL, DPPO_TOPK_TV,
              DPPO_TOPK_KL)
}
"""The registry: the one lookup the trainer makes (config validation reads `CAPABILITIES`, the same rows)."""
assert OBJECTIVES.keys() == CAPABILITIES.keys()  # every declared row has its objective, and no other
