"""Record and replay the per-token expert choices of a transformers MoE model.

`RoutingController(model)` puts a forward hook on every top-k router of the model (the
`*TopKRouter` modules of transformers' Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral) and a pre-hook on
the MoE block that owns it (to learn the [B, T] layout of the flattened tokens). The model's
classes are not replaced; with no context open, the hooks return at once and change nothing.

- `with ctl.record() as rec:` keeps each router's own top-k ids (and optionally its logits);
  several forwards concatenate along time (prefill, then cached decode steps). `rec.trace`.
- `with ctl.replay(trace):` sends every token to the trace's experts. Gate weights are rebuilt from
  the *current* router logits at those ids, normalised as the family does (softmax over all experts,
  gather, optional renormalisation), so router gradients still flow (R3, arXiv 2510.11370).
  A trace that does not fit the forward raises `RoutingReplayError`; replay never falls back.

`with ctl.noise(LogitNoise(eps, scale)):` takes every forward's top-k on the perturbed logits `z + scale·ε`
(re-routing of near ties, moe_rl.routing.noise); `with ctl.drift(p, g):` swaps random experts (dropout).

Both record and replay can be open at once: then `record` captures the experts the router *would* have chosen
(its free top-k given the replayed upstream layers), which is how expert change is measured
during replayed training forwards.

Replay is checked, never trusted:
- Traces know their tokens. On a whole model a pre-hook on the input embedding sees each forward's
  token ids: `record` keeps a per-row digest of them in the trace, and `replay` compares it with the
  tokens it is replayed on, raising `RoutingReplayError` that names the misaligned rows. A trace
  without a digest (sliced along time, or recorded on a bare block) cannot be replayed on a model.
- Gates are verified, not assumed. The first forward of each router (replayed or not) compares the
  gates rebuilt from its own top-k ids with the router's own; a router whose gate function differs (a sigmoid-gated
  one, such as MiniMax-M2's, or one with a selection bias) raises `UnsupportedRouterError` at once, so
  no run trains with wrong replayed gates.

Gradient checkpointing recomputes a layer in backward, running its router hook again. A hook that
runs inside the autograd engine is such a recompute: it records nothing and routes by the ids that
layer's latest forward used (replayed or free), even when backward runs after replay() has closed.
So under checkpointing, run backward before the next forward of the model.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from moe_rl.errors import RunError
from moe_rl.routing.noise import LogitNoise
from moe_rl.routing.partial import partial_replay
from moe_rl.routing.trace import RoutingTrace, ids_dtype, token_digest

# Shape legend: B rows, T tokens per row, N = B*T flattened tokens, K top-k, E experts, L layers.


class RoutingReplayError(RuntimeError):
    """A replay trace does not match the forward it is replayed on."""


class UnsupportedRouterError(RunError, ValueError):
    """A router whose gates the controller cannot rebuild from expert ids (replay would use wrong gates);
    `moe-rl-train` prints it as one line."""


def replay_gates(module: nn.Module, logits_NE: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    """Gates of experts `ids_NK` as the softmax-top-k families compute them, differentiable in the logits:
    softmax over all experts (float32, or float64 for float64 models), gathered at the ids, renormalised
    over the k when the router does (`norm_topk_prob`; Mixtral's router has no flag and always does)."""
    probs_NE = torch.softmax(logits_NE.to(torch.promote_types(logits_NE.dtype, torch.float32)), dim=-1)
    gates_NK = probs_NE.gather(-1, ids_NK)
    if getattr(module, "norm_topk_prob", True):
        gates_NK = gates_NK / gates_NK.sum(dim=-1, keepdim=True)
    return gates_NK


def _check_gates(module: nn.Module, layer: int, logits_NE, scores_NK, ids_NK) -> None:
    """Raise UnsupportedRouterError unless `replay_gates` at the router's own ids equals its own gates."""
    rebuilt_NK = replay_gates(module, logits_NE.detach(), ids_NK).float()
    tol = max(1e-5, 4 * torch.finfo(scores_NK.dtype).eps)
    err = (rebuilt_NK - scores_NK.detach().float()).abs().max().item()
    if not err <= tol:
        raise UnsupportedRouterError(
            f"{type(module).__name__} (MoE layer {layer}): gates rebuilt from its own top-k ids as "
            f"softmax-then-gather differ from the router's own by {err:.3g} (tolerance {tol:.1g}). "
            "moe-rl cannot replay this router's routing (its gate is not a softmax over the experts, e.g. "
            "sigmoid-gated or with a selection bias); use a softmax-gated family (qwen3_moe, qwen2_moe, "
            "olmoe, mixtral)"
        )


def _is_router(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("TopKRouter")
        and hasattr(module, "top_k")
        and hasattr(module, "num_experts")
    )


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The model's top-k router modules, in layer order."""
    return [m for m in model.modules() if _is_router(m)]


def _input_embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding of a transformers model, or None (a bare MoE block sees no token ids)."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return None
    try:
        return get()
    except NotImplementedError:
        return None


def _in_backward() -> bool:
    """True while the autograd engine runs, i.e. during a gradient-checkpointing recompute."""
    return torch._C._current_graph_task_id() != -1


class Recorder:
    """Collects per-layer chunks of expert ids during `RoutingController.record()`."""

    def __init__(self, num_layers: int, num_experts: int, with_logits: bool, with_gates: bool = False) -> None:
        self.num_experts = num_experts
        self.with_logits, self.with_gates = with_logits, with_gates
        self._ids: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._logits: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._gates: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._digest_B: torch.Tensor | None = None
        self._tokens_seen = 0

    def add_tokens(self, token_ids_BT: torch.Tensor) -> None:
        """Fold a forward's token ids into each row's digest, at their absolute positions."""
        chunk_B = token_digest(token_ids_BT, start=self._tokens_seen)
        self._digest_B = chunk_B if self._digest_B is None else self._digest_B + chunk_B
        self._tokens_seen += token_ids_BT.shape[1]

    def add(self, layer: int, ids_BTK: torch.Tensor, logits_BTE: torch.Tensor | None,
            gates_BTK: torch.Tensor | None = None) -> None:
        self._ids[layer].append(ids_BTK.to(ids_dtype(self.num_experts)))
        if self.with_logits:
            self._logits[layer].append(logits_BTE.detach().float())
        if self.with_gates:
            self._gates[layer].append(gates_BTK.detach().float())

    @property
    def trace(self) -> RoutingTrace:
        """Everything recorded so far as one `[B, T, L, K]` trace."""
        if not self._ids[0]:
            raise RoutingReplayError("nothing was recorded: no forward ran inside record()")
        lengths = {sum(c.shape[1] for c in chunks) for chunks in self._ids}
        assert len(lengths) == 1, f"layers recorded different lengths {lengths}"
        ids = torch.stack([torch.cat(chunks, dim=1) for chunks in self._ids], dim=2)
        logits = None
        if self.with_logits:
            logits = torch.stack([torch.cat(chunks, dim=1) for chunks in self._logits], dim=2)
        gates = torch.stack([torch.cat(chunks, dim=1) for chunks in self._gates], dim=2) if self.with_gates else None
        # Forwards fed embeddings instead of ids (or a bare block) leave no usable digest.
        digest = self._digest_B if self._tokens_seen == ids.shape[1] else None
        return RoutingTrace(ids, self.num_experts, logits, digest, gates)


class Drift:
    """Routing drift at rate p: expert dropout (`RoutingController.drift`), not re-routing: the swap ignores
    the router's margins, so a decisive token loses an expert it was sure of. For the paper's re-routing
    (near ties flipping to the runner-up) use `RoutingController.noise` (moe_rl.routing.noise).

    In each (token, MoE layer) slot, with probability p, one of the router's own top-k experts (chosen
    uniformly) is swapped for an expert it did not choose (uniformly among the E - K others). The
    swapped-in expert's gate comes from the live router (`replay_gates`), so gradients flow as under
    natural re-routing. A slot's swap changes 1 of its K experts: expert change grows by p / K, plus the
    natural change the swaps cause downstream. Draws come from `generator` alone (CPU), layer by layer.
    `applied_BTL` records which slots were swapped.
    """

    def __init__(self, p: float, generator: torch.Generator, num_layers: int, top_k: int) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"drift rate p={p}: must be in [0, 1]")
        self.p, self.generator, self.top_k = p, generator, top_k
        self._applied: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def perturb(self, layer: int, ids_NK: torch.Tensor, B: int, T: int, num_experts: int) -> torch.Tensor:
        """`ids_NK` with a fraction p of rows' one expert swapped for a non-chosen one; None when no row was
        swapped (the router's own output then stands, bitwise)."""
        N, K = ids_NK.shape
        g = self.generator
        swap_N = (torch.rand(N, generator=g) < self.p) & (num_experts > K)
        slot_N = torch.randint(K, (N,), generator=g)
        pick_N = torch.randint(max(num_experts - K, 1), (N,), generator=g)
        self._applied[layer].append(swap_N.reshape(B, T))
        if not swap_N.any():
            return None
        ids = ids_NK.cpu()
        chosen_NE = torch.zeros(N, num_experts, dtype=torch.int8).scatter_(1, ids, 1)
        # Non-chosen experts first, in index order (stable sort): the pick-th of them replaces the slot.
        others_NE = torch.argsort(chosen_NE, dim=1, stable=True)
        new_N = others_NE.gather(1, pick_N[:, None]).squeeze(1)
        rows = swap_N.nonzero().squeeze(1)
        out = ids.clone()
        out[rows, slot_N[rows]] = new_N[rows].to(out.dtype)
        return out.to(ids_NK.device)

    @property
    def applied_BTL(self) -> torch.Tensor:
        """`[B, T, L]` bool: the slots whose routing was swapped, over every forward inside the block."""
        if not self._applied[0]:
            raise RuntimeError("no forward ran inside drift()")
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self._applied], dim=2)


class _Replayer:
    """Hands out, layer by layer, the next `T` time steps of a trace; with `score_ratio` > 0, filters them
    by the live router (partial replay, moe_rl.routing.partial) and keeps which slots it replaced."""

    def __init__(self, trace: RoutingTrace, num_layers: int, top_k: int, sees_tokens: bool, gates: bool = False,
                 score_ratio: float = 0.0) -> None:
        B, T, L, K = trace.shape
        self.score_ratio = score_ratio
        self._replaced: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        if gates and trace.gates_BTLK is None:
            raise RoutingReplayError(
                "a replay of the gates (routing.replay_gates) needs a trace recorded with its gates; this one has none"
            )
        self.gates = gates
        if L != num_layers:
            raise RoutingReplayError(f"replay trace has {L} layers but the model has {num_layers} MoE layers")
        if K != top_k:
            raise RoutingReplayError(
                f"replay trace has k={K} experts per token but the model routes top-{top_k}"
            )
        if sees_tokens and trace.token_digest_B is None:
            raise RoutingReplayError(
                "replay trace carries no token digest (sliced along time, recorded on a bare MoE block, or "
                "from forwards fed embeddings): it cannot be checked against the tokens it is replayed on"
            )
        self.trace = trace
        self.cursor = [0] * num_layers
        self.sees_tokens = sees_tokens
        self.token_cursor = 0
        self.digest_B: torch.Tensor | None = None

    def check_tokens(self, token_ids_BT: torch.Tensor) -> None:
        """Fold a forward's tokens into each row's digest; once the trace's length is reached, compare it
        with the trace's and raise naming the rows recorded on other tokens."""
        (tB, tT), (B, T) = self.trace.shape[:2], token_ids_BT.shape
        start = self.token_cursor
        if B != tB or start + T > tT:
            return  # the routers raise with the batch or length that does not fit
        chunk_B = token_digest(token_ids_BT, start=start)
        self.digest_B = chunk_B if self.digest_B is None else self.digest_B + chunk_B
        self.token_cursor = start + T
        if self.token_cursor == tT:
            bad = (self.digest_B != self.trace.token_digest_B.to(chunk_B.device)).nonzero().flatten().tolist()
            if bad:
                shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
                raise RoutingReplayError(
                    f"replay trace is misaligned with its inputs: rows [{shown}] ({len(bad)} of {B}) were "
                    "recorded on other tokens than they are replayed on"
                )

    def next_ids(self, layer: int, B: int, T: int, device: torch.device) -> torch.Tensor:
        tB, tT = self.trace.shape[:2]
        start = self.cursor[layer]
        if B != tB:
            raise RoutingReplayError(
                f"replay trace has batch {tB} but the forward has batch {B} (layer {layer})"
            )
        if start + T > tT:
            left = tT - start
            what = "nothing left to replay" if left == 0 else f"only {left} time steps left"
            raise RoutingReplayError(
                f"replay trace has length {tT}; the forward needs {T} more time steps at layer {layer} "
                f"after {start} already replayed: {what}"
            )
        ids = self.trace.expert_ids_BTLK[:, start : start + T, layer].to(device=device, dtype=torch.long)
        self.cursor[layer] = start + T
        return ids.reshape(B * T, -1)

    def gates_of(self, layer: int, B: int, T: int, device: torch.device) -> torch.Tensor | None:
        """The recorded gates of the span `next_ids` just handed out at `layer`, or None (ids only)."""
        if not self.gates:
            return None
        start = self.cursor[layer] - T
        return self.trace.gates_BTLK[:, start : start + T, layer].to(device).reshape(B * T, -1)

    def filter(self, layer: int, logits_NE: torch.Tensor, replayed_NK: torch.Tensor, own_NK: torch.Tensor, B: int,
               T: int) -> torch.Tensor:
        """The experts used at `layer`: the replayed ones, or under partial replay those the live router
        keeps, refilled from its own top-k (`own_NK`)."""
        if not self.score_ratio:
            return replayed_NK
        scores_NE = torch.softmax(logits_NE.detach().float(), dim=-1)
        ids_NK, replaced_NK = partial_replay(scores_NE, replayed_NK, own_NK.to(replayed_NK), self.score_ratio)
        self._replaced[layer].append(replaced_NK.sum(-1).reshape(B, T))  # to the CPU once, in replaced_BTL
        return ids_NK

    @property
    def replaced_BTL(self) -> torch.Tensor:
        """`[B, T, L]` replayed slots the partial replay replaced at each position and layer (0..K)."""
        if not self._replaced[0]:
            raise RuntimeError("no forward ran under partial replay (routing.replay_score_ratio > 0)")
        return torch.stack([torch.cat(chunks, dim=1) for chunks in self._replaced], dim=2).cpu()

    def check_consumed(self) -> None:
        tT = self.trace.shape[1]
        if any(c != tT for c in self.cursor):
            raise RoutingReplayError(
                f"replay trace has length {tT} but the forwards inside replay() used {min(self.cursor)}: "
                "the trace does not match the forward's length"
            )
        if self.sees_tokens and self.token_cursor != tT:
            raise RoutingReplayError(
                f"replay trace has length {tT} but the model's embedding saw {self.token_cursor} token "
                "positions: forwards fed embeddings instead of token ids cannot be checked"
            )


class RoutingController:
    """Instruments every top-k router of `model` for recording and replay (see module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        routers = routers_of(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no top-k MoE router modules to instrument")
        self.routers = routers
        self.num_layers = len(routers)
        self.top_k = routers[0].top_k
        self.num_experts = routers[0].num_experts
        self._recorder: Recorder | None = None
        self._replayer: _Replayer | None = None
        self._drift: Drift | None = None
        self._noise: LogitNoise | None = None
        self._gates_checked = [False] * self.num_layers
        self._shape: list[tuple[int, int] | None] = [None] * self.num_layers
        # Ids each layer's latest (non-recompute) forward was routed by under replay, else None.
        self._last_replayed: list[torch.Tensor | None] = [None] * self.num_layers
        self._last_gates: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles = []
        layer_of = {id(r): i for i, r in enumerate(routers)}
        for block in model.modules():
            gate = getattr(block, "gate", None)
            if gate is not None and id(gate) in layer_of:
                self._handles.append(
                    block.register_forward_pre_hook(
                        self._make_shape_hook(layer_of[id(gate)]), with_kwargs=True
                    )
                )
        if len(self._handles) != self.num_layers:
            raise ValueError("could not find the MoE block that owns each router (expected `block.gate`)")
        for i, router in enumerate(routers):
            self._handles.append(router.register_forward_hook(self._make_router_hook(i)))
        embedding = _input_embedding(model)
        self.sees_tokens = embedding is not None
        if embedding is not None:
            self._handles.append(embedding.register_forward_pre_hook(self._token_hook))

    def _token_hook(self, module, args) -> None:
        if _in_backward() or not args:
            return
        ids_BT = args[0]
        if ids_BT.dim() == 1:
            ids_BT = ids_BT.unsqueeze(0)
        if self._recorder is not None:
            self._recorder.add_tokens(ids_BT)
        if self._replayer is not None:
            self._replayer.check_tokens(ids_BT)

    def detached_copy(self, model: nn.Module) -> nn.Module:
        """A deep copy of `model` (the instrumented one) without this controller's hooks: `copy.deepcopy`
        copies a module's hooks, so a plain copy would report its forwards to this controller too (and,
        run on another thread, into this controller's open recording)."""
        copy_ = copy.deepcopy(model)
        ids = {h.id for h in self._handles}
        for module in copy_.modules():
            for hooks in (module._forward_hooks, module._forward_pre_hooks, module._forward_hooks_with_kwargs,
                          module._forward_pre_hooks_with_kwargs, module._forward_hooks_always_called):
                for i in ids & set(hooks):
                    del hooks[i]
        return copy_

    def remove(self) -> None:
        """Remove every hook; the model is as it was."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_shape_hook(self, layer: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._shape[layer] = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])

        return hook

    def _make_router_hook(self, layer: int):
        def hook(module, args, output):
            logits_NE, scores_NK, ids_NK = output
            if _in_backward():  # a checkpointing recompute: route as the original forward did
                ids_NK, recorded_gates = self._last_replayed[layer], self._last_gates[layer]
            else:
                B, T = self._shape[layer]
                if not self._gates_checked[layer] and ids_NK.shape[0]:  # the router's own choice and gates
                    _check_gates(module, layer, logits_NE, scores_NK, ids_NK)
                    self._gates_checked[layer] = True
                drifted_NK = None  # stays None unless drift or noise is on: the router's output is kept
                if self._drift is not None and self._replayer is None:  # replay wins over drift
                    drifted_NK = self._drift.perturb(layer, ids_NK, B, T, self.num_experts)
                if self._noise is not None:  # the noisy choice is recorded even under replay, which wins
                    drifted_NK = self._noise.perturb(layer, logits_NE, ids_NK, B, T)
                own_NK = ids_NK if drifted_NK is None else drifted_NK  # the routing absent replay
                if self._recorder is not None:
                    own_gates = None
                    if self._recorder.with_gates:
                        own_gates = scores_NK if drifted_NK is None else replay_gates(module, logits_NE, drifted_NK)
                        own_gates = own_gates.reshape(B, T, -1)
                    self._recorder.add(layer, own_NK.reshape(B, T, -1), logits_NE.reshape(B, T, -1), own_gates)
                recorded_gates = None
                if self._replayer is None:
                    ids_NK = drifted_NK
                else:
                    replayed_NK = self._replayer.next_ids(layer, B, T, logits_NE.device)
                    ids_NK = self._replayer.filter(layer, logits_NE, replayed_NK, own_NK, B, T)
                    recorded_gates = self._replayer.gates_of(layer, B, T, logits_NE.device)
                self._last_replayed[layer] = ids_NK
                self._last_gates[layer] = recorded_gates
            if ids_NK is None:
                return None
            # Replayed gates are constants (routing.replay_gates): the loss then sends the router no gradient.
            gates_NK = replay_gates(module, logits_NE, ids_NK) if recorded_gates is None else recorded_gates
            return logits_NE, gates_NK.to(torch.promote_types(scores_NK.dtype, logits_NE.dtype)), ids_NK

        return hook

    @torch.no_grad()
    def verify_gates(self, model: nn.Module, input_ids_BT: torch.Tensor) -> None:
        """Run one free forward of `model` on `input_ids_BT` so that every router's gate function is
        checked now (at start-up) rather than at its first forward; raises UnsupportedRouterError."""
        if self._recorder is not None or self._replayer is not None:
            raise RuntimeError("verify_gates() runs outside record() and replay()")
        was_training = model.training
        model.eval()
        try:
            model(input_ids_BT)
        finally:
            model.train(was_training)

    @contextlib.contextmanager
    def record(self, with_logits: bool = False, with_gates: bool = False) -> Iterator[Recorder]:
        """Record the routers' own top-k ids (and logits, and gates) of every forward inside the block."""
        if self._recorder is not None:
            raise RuntimeError("record() is already open on this model")
        self._recorder = Recorder(self.num_layers, self.num_experts, with_logits, with_gates)
        try:
            yield self._recorder
        finally:
            self._recorder = None

    @contextlib.contextmanager
    def drift(self, p: float, generator: torch.Generator) -> Iterator[Drift]:
        """Inject routing drift into every forward inside the block that is not replayed (see `Drift`).
        Replay wins: under an open `replay()` the replayed experts are used and nothing is drawn."""
        if self._drift is not None:
            raise RuntimeError("drift() is already open on this model")
        self._drift = Drift(p, generator, self.num_layers, self.top_k)
        try:
            yield self._drift
        finally:
            self._drift = None

    @contextlib.contextmanager
    def noise(self, noise: LogitNoise) -> Iterator[LogitNoise]:
        """Take every forward's top-k on `logits + noise.scale * noise.eps_BTLE` inside the block, gates from
        the live logits (see moe_rl.routing.noise). Replay wins: under an open `replay()` the replayed
        experts are used, and an open `record()` keeps the noisy choice (the routing absent replay, as
        for free routing). Drift and noise are exclusive."""
        if self._noise is not None or self._drift is not None:
            raise RuntimeError("noise() is already open on this model, or drift() is")
        self._noise = noise
        try:
            yield noise
        finally:
            self._noise = None

    @contextlib.contextmanager
    def replay(self, trace: RoutingTrace, gates: bool = False, score_ratio: float = 0.0) -> Iterator[_Replayer]:
        """Route every forward inside the block by `trace`; the forwards must use all of it. With `gates`,
        combine the experts with the trace's recorded gates instead of the live router's (which then gets
        no gradient from the loss): prime-rl's "total router recall". With `score_ratio` > 0, partial
        replay (moe_rl.routing.partial): a replayed expert the live router rates below ratio x its weakest
        own top-k score is replaced from its own top-k; the yielded replayer's `replaced_BTL` counts them."""
        if self._replayer is not None:
            raise RuntimeError("replay() is already open on this model")
        if trace is None:
            raise RoutingReplayError("replay() needs a trace; got None")
        if score_ratio and gates:
            raise ValueError("partial replay refills slots from the live router, which has no recorded gates")
        self._replayer = _Replayer(trace, self.num_layers, self.top_k, self.sees_tokens, gates, score_ratio)
        ok = False
        try:
            yield self._replayer
            ok = True
        finally:
            replayer, self._replayer = self._replayer, None
            if ok:
                replayer.check_consumed()
