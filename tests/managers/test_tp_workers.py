"""TPWorkers.report_death without processes: which rank it names, from the exit codes it reads."""

from __future__ import annotations

import os
import threading

import pytest

from servelm.managers.tp_worker import PEER_LOST_EXIT_CODE, TPWorkers


class _Ended:
    """A worker whose sentinel has fired; `codes`: what successive reads of its exit code give (the last one
    from then on). Reading the exit code of a process that has just become a zombie reaps it, so a worker reads
    None and then its code."""

    def __init__(self, *codes: int | None) -> None:
        self._codes = list(codes)
        read, write = os.pipe()
        os.close(write)  # an ended process's sentinel: readable (EOF)
        self.sentinel = read

    @property
    def exitcode(self) -> int | None:
        return self._codes.pop(0) if len(self._codes) > 1 else self._codes[0]

    def join(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture
def workers():
    """TPWorkers over the given fake workers (no processes started); their sentinels closed after the test."""
    made: list[TPWorkers] = []

    def make(procs: dict) -> TPWorkers:
        w = object.__new__(TPWorkers)
        w.procs, w._stopping, w._report_lock, w._report = procs, False, threading.Lock(), None
        made.append(w)
        return w

    yield make
    for w in made:
        for proc in w.procs.values():
            os.close(proc.sentinel)


def test_a_worker_reaped_between_two_reads_is_still_named(workers) -> None:
    """A killed worker whose exit code reads None once (not yet a zombie), then -9: it is the rank that died.
    (One pass had read the codes twice, for the ended and for the running workers: a worker that became a
    zombie between the two was in neither, and the death was logged as an unnamed one.)"""
    line = workers({1: _Ended(None, -9)}).report_death(grace_s=5.0)
    assert line == "TP rank 1 died (exit code -9 / killed by SIGKILL); shutting down"


def test_the_rank_that_died_is_named_over_its_witnesses(workers) -> None:
    tp = workers({1: _Ended(PEER_LOST_EXIT_CODE), 2: _Ended(None, None, 1)})
    assert tp.report_death(grace_s=5.0) == "TP rank 2 died (exit code 1); shutting down"
    assert tp.report_death(grace_s=5.0) == "TP rank 2 died (exit code 1); shutting down"  # once, then kept
