"""The schema stays a light composition: `import moe_rl.config` loads no torch, and config.py stays short
(each section's dataclass lives beside its package; config.py composes them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_LINES = 500
"""STYLE.md's module size: config.py holds `Config`, the composition and the checks across sections only."""
PROBE = "import sys, moe_rl.config; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"


def test_importing_the_schema_loads_no_torch():
    """A fresh interpreter that imports moe_rl.config (and validates a default Config) has not imported torch."""
    probe = PROBE.replace("print(", "moe_rl.config.Config().validate(); print(")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_probe_sees_torch_when_it_is_imported():
    """The probe reports torch when the interpreter has imported it (so the test above can fail)."""
    probe = "import torch; " + PROBE
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "['torch']", out.stdout + out.stderr


def test_config_module_stays_under_the_size_limit():
    """moe_rl/config.py has fewer than 500 lines."""
    lines = len((ROOT / "moe_rl" / "config.py").read_text().splitlines())
    assert lines < MAX_LINES, f"moe_rl/config.py has {lines} lines; move a section's schema beside its package"
