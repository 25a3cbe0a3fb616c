"""The GPU check script (tests/gpu/run.sh) keeps working: its dry run on the CPU, every step, small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads the default model, starts a server, builds a one-layer 1B shape

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tests/gpu/run.sh", str(out), "--dry-run", "--work", str(tmp_path / "work")],
                          cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=900)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"], log[-4000:]
    assert list(summary["steps"]) == ["1_env", "2_greedy", "3_server", "4_one_batch", "5_offline", "6_1b_greedy",
                                      "6_1b_one_batch", "6_1b_offline", "6_1b_profile"]
    assert all(step["ok"] for step in summary["steps"].values())
    assert summary["steps"]["2_greedy"]["equal_prompts"] == 3  # fp32 in a dry run: transformers' tokens exactly
    assert summary["steps"]["6_1b_greedy"]["equal_prompts"] == 3
    assert json.loads(summary["steps"]["3_server"]["json_schema"])["is_capital"] in (True, False)
    assert summary["steps"]["5_offline"]["hf_output_tok_s"] > 0
    assert summary["steps"]["6_1b_profile"]["eager_kernels_per_step"] > 10  # torch ops here, in a dry run
    assert summary["bandwidth_1b"]["weight_bytes"] > 500e6  # the 1B shape's embedding alone is 525 MB in bf16
