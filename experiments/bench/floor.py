"""The compute floor of an RL step: its matmul work, timed alone at the shapes the model actually uses.

`MatmulLog` records every matrix multiply a piece of work dispatches (mm, addmm, bmm, grouped_mm per
group, and attention as the two matmuls it is), forward and backward. `floor_seconds` then runs each
recorded shape alone on random data and sums count x median time: what the step would take if it were
nothing but its matmuls, at this machine's throughput for those shapes. Its FLOPs over that time is the
achievable matmul throughput, reported next to it.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
_SDPA_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
}


class MatmulLog(TorchDispatchMode):
    """Counts (batch, m, k, n, dtype) of every matmul dispatched inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: Counter[tuple[int, int, int, int, torch.dtype]] = Counter()

    def _add(self, b: int, m: int, k: int, n: int, dtype: torch.dtype, times: int = 1) -> None:
        if b and m and k and n:
            self.shapes[(b, m, k, n, dtype)] += times

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet is aten.mm:
            (m, k), n = args[0].shape, args[1].shape[1]
            self._add(1, m, k, n, args[0].dtype)
        elif packet is aten.addmm:
            (m, k), n = args[1].shape, args[2].shape[1]
            self._add(1, m, k, n, args[1].dtype)
        elif packet in (aten.bmm, aten.baddbmm):
            a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
            self._add(a.shape[0], a.shape[1], a.shape[2], b.shape[2], a.dtype)
        elif packet is aten._grouped_mm:
            a, w, offs = args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            start = 0
            for end in offs.tolist():  # 2-D x 3-D: groups of rows; 2-D x 2-D (weight grads): of k
                if w.dim() == 3:
                    self._add(1, end - start, a.shape[1], w.shape[-1], a.dtype)
                else:
                    self._add(1, a.shape[0], end - start, w.shape[-1], a.dtype)
                start = end
        elif func in _SDPA or func in _SDPA_BACKWARD:
            q, k = args[0], args[1]  # [B, H, T, D], [B, Hkv, S, D]
            B, H, T, D = q.shape
            S = k.shape[2]
            # forward: Q K^T and P V; backward: twice that (dQ, dK, dV, dP)
            self._add(B * H, T, D, S, q.dtype, 1 if func in _SDPA else 2)
            self._add(B * H, T, S, D, q.dtype, 1 if func in _SDPA else 2)
        return out

    @property
    def flops(self) -> int:
        return sum(2 * b * m * k * n * c for (b, m, k, n, _), c in self.shapes.items())


def _time_shape(b: int, m: int, k: int, n: int, dtype: torch.dtype, device: str, reps: int) -> float:
    x = torch.randn(b, m, k, dtype=dtype, device=device)
    y = torch.randn(b, k, n, dtype=dtype, device=device)
    fn = (lambda: torch.mm(x[0], y[0])) if b == 1 else (lambda: torch.bmm(x, y))
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def floor_seconds(log: MatmulLog, device: str = "cpu", reps: int = 5) -> dict[str, float]:
    """Sum over recorded shapes of count x the shape's median time alone; with FLOPs and throughput."""
    seconds = sum(c * _time_shape(*shape, device, reps) for shape, c in log.shapes.items())
    return {
        "floor_s": seconds,
        "flops": float(log.flops),
        "matmul_gflops_per_s": log.flops / seconds / 1e9 if seconds else float("nan"),
        "distinct_shapes": float(len(log.shapes)),
        "matmul_calls": float(sum(log.shapes.values())),
    }
