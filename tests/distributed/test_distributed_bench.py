"""`servelm.bench.allreduce`: runs a real world of 2 and reports every (size, mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelm.bench.allreduce import main, parse_size

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("16K", "1M", "4mb", "512", "0.5K")] == [16384, 1 << 20, 4 << 20, 512, 512]


def test_bench_allreduce_world_of_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert main(["--sizes", "16K,64K", "--modes", "none,deterministic,fp,int4", "--iters", "2",
                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["bytes"], r["mode"]) for r in rows] == [(b, m) for b in (16384, 65536)
                                                      for m in ("none", "deterministic", "fp", "int4")]
    for r in rows:
        assert r["world_size"] == 2 and r["us"] > 0
        # exact modes vs the lossy one (Gaussian data, int4: ~10% of the absmax)
        assert (r["max_rel_err"] < 1e-6) == (r["mode"] != "int4"), r
    assert "all-reduce, world size 2, float32" in capsys.readouterr().out
