"""The scheduler process's loop without a model: its periodic throughput line."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from servelm.managers.scheduler_process import SchedulerLoop


class Counting:
    """A scheduler stand-in with counters and the server_info fields the line reads."""

    def __init__(self) -> None:
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}
        self.busy = False

    def has_work(self) -> bool:
        return self.busy

    def server_info(self) -> dict[str, Any]:
        return {"kv_total_tokens": 1000, "kv_in_use_tokens": 100, "kv_cached_tokens": 150, "num_running": 3,
                "num_waiting": 1, "cache_hit_rate": 0.25}


def test_throughput_line_while_busy_and_silence_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    sched = Counting()
    loop = SchedulerLoop(sched, recv=None, send=None, stats_interval_s=3600)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="servelm.scheduler_process"):
        loop.log_stats(force=True)  # first call: the baseline
        sched.stats.update(prompt_tokens=500, generation_tokens=80)
        sched.busy = True
        loop.log_stats()  # within the interval: nothing
        assert "throughput" not in caplog.text
        loop.log_stats(force=True)
        line = caplog.records[-1].getMessage()
        assert "Avg prompt throughput:" in line and "Avg generation throughput:" in line
        assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0% (10.0% by running requests)" in line
        assert "Prefix cache hit rate: 25.0%" in line
        count = len(caplog.records)
        sched.busy = False
        loop.log_stats(force=True)  # idle and nothing new: no line
        assert len(caplog.records) == count
