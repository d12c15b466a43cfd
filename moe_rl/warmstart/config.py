"""The warm start's schema (`WarmStartConfig`, defined with every section in moe_rl.config), its result,
and the cache format's constants."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config import WarmStartConfig

FORMAT_VERSION = 2
"""Bump when the training procedure changes so old cache entries stop matching (2: fixed build
threads, device type in the key, checksums in warmstart.json)."""

BUILD_THREADS = 2
"""torch CPU threads of every build, whatever the caller's: reductions split by thread count round
differently, so one key built on 1 and on 2 threads gave different weights (max |dw| 0.108 in a probe).
Any fixed count makes builds reproducible; 2 is the count the test suite runs with (tests/conftest.py),
whose 1-vs-2-process comparison (tests/integration/test_torchrun_data_parallel.py, atol 1e-4) holds from these weights and
missed by 1e-5 on 2 of 1024 elements from a 1-thread build."""

META_FILE = "warmstart.json"


@dataclass
class WarmStartResult:
    """A finished warm start.

    path: directory loadable by `build_model(ModelConfig(pretrained=path))` and `AutoTokenizer.from_pretrained`.
    accuracy: held-out accuracy of the saved model (eval split, `eval_size` examples, eval temperature).
    steps: optimizer steps in the saved model's history (rolled-back steps excluded).
    cached: True when the result was loaded from the cache rather than trained by this call.
    seconds: wall time of this call, lock wait included.
    """

    path: str
    accuracy: float
    steps: int
    cached: bool
    seconds: float


__all__ = ["BUILD_THREADS", "FORMAT_VERSION", "META_FILE", "WarmStartConfig", "WarmStartResult"]
