"""Shared test setup: offline W&B, deterministic small CPU runs."""

import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe")


def pytest_addoption(parser):
    parser.addoption(
        "--reliability-report",
        default=None,
        metavar="PATH",
        help="write the fault-injection table (tests/integration/test_fault_injection.py) of this run to PATH (docs/reliability.md)",
    )


REPORT_HEADER = """# Reliability: what each fault does

Produced by the fault-injection suite's own run (`tests/integration/test_fault_injection.py`, slow-marked; CI runs it):

    pytest -m slow tests/integration/test_fault_injection.py --reliability-report docs/reliability.md

Each row is one case as it ran: the fault injected, what the user saw (warnings and errors, with the
test's folder shown as RUN), and what survived. The fast contracts behind them (checkpoint format,
strict JSON, start-up checks, the warm-start cache) are in tests/unit/trainer/test_reliability_contracts.py and
tests/unit/warmstart/test_warm_start_build_and_cache.py.

| fault | what the user sees | what survives | test (tests/integration/test_fault_injection.py) |
|---|---|---|---|
"""
KEEP_MARKER = "<!-- The rows above are written by the fault suite; the text below is kept as it is. -->"
"""What follows this line in the report file survives a regeneration (rows checked by fast tests elsewhere)."""


@pytest.fixture(scope="session")
def _fault_rows(request):
    rows: list[tuple[str, str, str, str]] = []
    yield rows
    path = request.config.getoption("--reliability-report")
    if path and rows:
        cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        body = "".join(f"| {cell(a)} | {cell(b)} | {cell(c)} | `{d}` |\n" for a, b, c, d in rows)
        old = open(path).read() if os.path.exists(path) else ""
        kept = old[old.index(KEEP_MARKER):] if KEEP_MARKER in old else KEEP_MARKER + "\n"
        with open(path, "w") as f:
            f.write(REPORT_HEADER + body + "\n" + kept)


@pytest.fixture
def fault_report(_fault_rows, request):
    """Record one fault case (fault, what the user sees, what survives, and the test) for --reliability-report."""
    return lambda fault, seen, survives: _fault_rows.append((fault, seen, survives, request.node.name))


@pytest.fixture(scope="session")
def tokenizer():
    """The default character tokenizer over the tasks' alphabet."""
    from moe_rl.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> Path:
    """One warm-start cache for the session's tests that only use warm starts (not those that test the cache):
    entries are content-addressed by everything that determines their weights, so tests that ask for the same
    warm start share one build, and different ones never mix. Under pytest-xdist (-n) the workers share it
    too (the run's temporary root, above each worker's own): the cache's lock makes a second worker that
    asks for an entry being built wait for it rather than build it again."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "warm_cache"
    cache.mkdir(exist_ok=True)
    return cache


WARM = ["warmstart.target_low=0.1", "warmstart.target_high=0.9", "warmstart.eval_every=10", "warmstart.eval_size=64"]


@pytest.fixture(scope="session")
def warm_overrides(warm_cache):
    """Hydra overrides under which the tiny test runs start from a warm start built once per session."""
    from moe_rl.warmstart import warm_start
    from tests.integration.test_train_loop import TINY, compose_config

    overrides = [*WARM, f"warmstart.cache_dir={warm_cache}"]
    cfg = compose_config([*TINY, *overrides])
    warm_start(cfg.model, cfg.task.name, cfg.task.difficulty, cfg.warmstart, cfg.seed,
               max_new_tokens=cfg.sampler.max_new_tokens, progress=False)
    return overrides
