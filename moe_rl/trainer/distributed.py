"""Data parallelism under `torchrun`: the process group, model wrapping, collectives and metric reduction.

    torchrun --nproc_per_node=2 -m moe_rl.train trainer.device=cuda            # DDP on 2 GPUs
    torchrun --nproc_per_node=4 -m moe_rl.train trainer.parallel=fsdp ...      # FSDP2: shard params,
                                                                               # grads and AdamW state

How a step is split (see `moe_rl.trainer.step`): every rank draws the same P prompts; rank r owns the
contiguous prompts [r P/W, (r+1) P/W) with all their G completions, so groups never split and group
advantages stay local. Mini-batches are drawn for the global batch identically on every rank, in a way
that gives every rank the same number of rows in each (`minibatch_rows`), so the average over ranks of
each rank's mean loss is the global mini-batch loss and DDP's gradient average is the 1-process
gradient. Routing traces stay on the rank that owns the rows.

A single process is rank 0 of 1: every collective below returns at once, so the trainer has one code
path. Collectives time out after `trainer.dist_timeout_s`, so a rank that hangs or dies ends the job
with an error naming the timeout instead of blocking it (torchrun also stops the other ranks as soon as
one exits).
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from moe_rl.trainer.config import TrainerConfig

T = TypeVar("T")


PEER_FAILURE_MARKERS = ("gloo", "pair closure", "Connection closed by peer")
"""Substrings of a collective's RuntimeError that mean a peer failed. Gloo's own errors name it, but a
timeout met inside DDP's backward reaches us rethrown by autograd as "Application timeout caused pair
closure", which does not."""


class DistributedTimeout(RuntimeError):
    """A collective failed: another rank died, hung past `trainer.dist_timeout_s`, or lost its connection."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. The default is a single process, where collectives do nothing."""

    rank: int = 0
    world: int = 1
    timeout_s: float = 0.0

    @property
    def main(self) -> bool:
        """Rank 0: the only rank that writes files, W&B and checkpoints."""
        return self.rank == 0

    def collective(self, fn: Callable[[], T]) -> T:
        """Run `fn`, turning a failed collective (gloo's or NCCL's error) into a `DistributedTimeout`."""
        try:
            return fn()
        except RuntimeError as err:
            if not (isinstance(err, dist.DistError) or any(m in str(err) for m in PEER_FAILURE_MARKERS)):
                raise
            raise DistributedTimeout(
                f"rank {self.rank} of {self.world}: a collective failed ({err}). Another rank died or did "
                f"not answer within trainer.dist_timeout_s={self.timeout_s:g} s; see its log for the cause."
            ) from err

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank (picklable objects; small payloads only)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.collective(lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self.collective(lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        if self.world == 1:
            return list(values)
        x = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        self.collective(lambda: dist.all_reduce(x))
        return x.tolist()

    def all_done(self, done: bool) -> bool:
        """True when every rank is done (the sampler's lock-step stop under FSDP, where forwards are collective)."""
        return self.sum([float(not done)])[0] == 0

    def close(self) -> None:
        """Leave the process group (a no-op for a single process)."""
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _comm_device() -> torch.device:
    """Where collective tensors live: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(t: TrainerConfig) -> tuple[Dist, str]:
    """Join the torchrun (or multi-task submitit) job if there is one; return it and this rank's device.

    gloo on CPU, NCCL on CUDA (rank r uses cuda:LOCAL_RANK). A single process: `Dist()` and `t.device`.
    """
    if "WORLD_SIZE" not in os.environ and "SUBMITIT_EXECUTOR" in os.environ:
        _export_submitit_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), t.device
    device = t.device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            timeout=datetime.timedelta(seconds=t.dist_timeout_s),
        )
    return Dist(dist.get_rank(), dist.get_world_size(), t.dist_timeout_s), device


def _export_submitit_env() -> None:
    """In a submitit job of several tasks (hydra/launcher=slurm_gpu with tasks_per_node > 1) each task is
    a rank: set the variables torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, ...) from submitit's."""
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def minibatch_rows(n_rows: int, mini_batches: int, generator: torch.Generator, unit: int = 1) -> torch.Tensor:
    """`[M, B / M]` global row indices of each mini-batch, drawn identically on every rank.

    Rows are taken in units of `unit` consecutive rows (1: single rows; the group size: whole groups).
    Mini-batch j takes one unit from every run of M consecutive units (which one is drawn at random), so
    any rank owning whole runs holds the same number of rows of every mini-batch, and the mini-batches
    do not depend on the number of ranks. With unit = 1 every group of G >= M rows is spread over all
    mini-batches; with unit = G each group lies in exactly one.
    """
    n_units = n_rows // unit
    order_CM = torch.rand(n_units // mini_batches, mini_batches, generator=generator).argsort(dim=1)
    units_MC = (order_CM + torch.arange(0, n_units, mini_batches).unsqueeze(1)).T
    return (units_MC.unsqueeze(-1) * unit + torch.arange(unit)).reshape(mini_batches, -1)


def wrap(model: nn.Module, parallel: str, dist_: Dist, device: str) -> nn.Module:
    """What the update forward calls. DDP: a wrapper whose backward all-reduces (averages) gradients.
    FSDP2: the model itself, sharded in place per decoder layer. A single process: the model."""
    if dist_.world == 1:
        return model
    if parallel == "fsdp":
        shard(model)
        return model
    # Buffers (rotary tables) never change, and a buffer broadcast per forward would be a collective in
    # every sampler step; every expert is one fused tensor, so every parameter gets a gradient.
    ddp = nn.parallel.DistributedDataParallel
    renamed = "forward_sync_buffers" in inspect.signature(ddp).parameters  # torch >= 2.13
    return ddp(
        model,
        device_ids=[torch.device(device)] if device.startswith("cuda") else None,
        **{"forward_sync_buffers" if renamed else "broadcast_buffers": False},
    )


def shard(model: nn.Module) -> None:
    """FSDP2 in place: each decoder layer is one shard group, the rest (embeddings, head) the root's."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts; under FSDP a collective whose result is on rank 0."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def load_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict, sharded: bool
) -> None:
    """Inverse of `state_dicts`; every rank passes the full dicts and keeps its own shard."""
    if not sharded:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)


@torch.no_grad()
def param_checksum(model: nn.Module) -> list[float]:
    """[sum, sum of squares] of this rank's parameters (its shards under FSDP) in float64."""
    total, squares = 0.0, 0.0
    for p in model.parameters():
        local = (p.to_local() if hasattr(p, "to_local") else p).double()
        total += float(local.sum())
        squares += float(local.square().sum())
    return [total, squares]
