"""Dist.collective turns a peer's failure into one DistributedTimeout naming trainer.dist_timeout_s, whatever
form the error reaches the rank in, and lets every other error through unchanged."""

import pytest

from moe_rl.trainer.distributed import Dist, DistributedTimeout


def _raise(message: str):
    def fn():
        raise RuntimeError(message)

    return fn


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: Connection reset by peer",
    "Application timeout caused pair closure",  # a timeout inside DDP's backward, rethrown by autograd
])
def test_a_peer_failure_becomes_a_distributed_timeout(message):
    with pytest.raises(DistributedTimeout, match=r"did not answer within trainer.dist_timeout_s=3 s"):
        Dist(0, 2, 3.0).collective(_raise(message))


def test_other_errors_pass_through():
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        Dist(0, 2, 3.0).collective(_raise("shape mismatch"))
    assert type(info.value) is RuntimeError
