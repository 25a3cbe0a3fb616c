"""servelm.cpu_threads: the CPU count (affinity, cgroup v1/v2 quota), precedence of the user's settings,
that spawned processes (our scheduler and TP workers) start their OpenMP runtime with them, and the thread
governor's decisions (with a fake sampler: which other processes run is the machine's business).

No timing here: the speed of the policies is measured by `servelm bench one-batch --competing-load`.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from servelm import cpu_threads
from servelm.cpu_threads import (
    DEFAULTED_ENV,
    ThreadGovernor,
    available_cpus,
    cgroup_cpu_limit,
    configure_cpu_threads,
    parse_cfs_quota,
    parse_cpu_max,
    resolve_num_threads,
    serving_family,
)


@pytest.fixture
def clean_environ() -> Iterator[None]:
    """os.environ without any threading setting; restored (with torch's thread count) afterwards."""
    saved, threads = dict(os.environ), torch.get_num_threads()
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", DEFAULTED_ENV):
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ CPU count
def test_parse_cpu_max() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("400000 100000") == 4.0
    assert parse_cpu_max("50000") == 0.5  # period defaults to 100000
    assert parse_cpu_max("") is None and parse_cpu_max("garbage x") is None


def test_parse_cfs_quota() -> None:
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("250000\n", "100000\n") == 2.5
    assert parse_cfs_quota("x", "100000") is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "cpu.max", "300000 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "max 100000\n")
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "0::/kubepods/pod1\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(root, proc) == 1.5


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names a host path that the container's mount does not have.
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "200000 100000\n")
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "0::/system.slice/docker-abc.scope\n")
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    mount = root / "cpu,cpuacct"
    _write(mount / "cpu.cfs_quota_us", "-1\n")
    _write(mount / "cpu.cfs_period_us", "100000\n")
    _write(mount / "docker" / "c1" / "cpu.cfs_quota_us", "50000\n")
    _write(mount / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc_self_cgroup"
    _write(proc, "12:memory:/docker/c1\n4:cpu,cpuacct:/docker/c1\n1:name=systemd:/docker/c1\n")
    assert cgroup_cpu_limit(root, proc) == 0.5
    _write(mount / "docker" / "c1" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "no_proc_file") is None


def test_available_cpus_is_affinity_capped_by_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    root, proc = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    _write(proc, "0::/\n")
    _write(root / "cpu.max", "max 100000\n")
    assert available_cpus(root, proc) == 6
    _write(root / "cpu.max", "250000 100000\n")
    assert available_cpus(root, proc) == 2  # a fractional CPU rounds down
    _write(root / "cpu.max", "20000 100000\n")
    assert available_cpus(root, proc) == 1  # never 0
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    _write(root / "cpu.max", "400000 100000\n")
    assert available_cpus(root, proc) == 1  # taskset -c 3


# ------------------------------------------------------------------ precedence
def test_the_wait_policy_is_the_users_and_is_reported() -> None:
    assert configure_cpu_threads(None, env={}, cpus=2).wait_policy == {}  # libgomp's own default
    for user in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}, {"KMP_BLOCKTIME": "1"}):
        env = dict(user)
        assert configure_cpu_threads(None, env=env, cpus=2).wait_policy == user
        assert {k: v for k, v in env.items() if k in user} == user  # left as the user set it


def test_thread_count_precedence() -> None:
    assert resolve_num_threads(None, env={}, cpus=4) == (4, "available CPUs")
    assert resolve_num_threads(None, processes=2, env={}, cpus=4) == (2, "available CPUs")
    assert resolve_num_threads(None, processes=4, env={}, cpus=2) == (1, "available CPUs")
    user = {"OMP_NUM_THREADS": "3"}
    assert resolve_num_threads(None, env=user, cpus=4) == (3, "OMP_NUM_THREADS")
    assert resolve_num_threads(None, env={"OMP_NUM_THREADS": "3,1"}, cpus=4) == (3, "OMP_NUM_THREADS")
    assert resolve_num_threads(5, env=user, cpus=4) == (5, "--num-threads")
    # A value we set ourselves (listed in SERVELM_DEFAULTED_ENV, e.g. inherited from a servelm parent) is recomputed.
    ours = {"OMP_NUM_THREADS": "3", DEFAULTED_ENV: "OMP_NUM_THREADS,OMP_WAIT_POLICY"}
    assert resolve_num_threads(None, env=ours, cpus=4) == (4, "available CPUs")


def test_configure_sets_the_environment_for_children() -> None:
    env: dict[str, str] = {"OMP_NUM_THREADS": "3"}
    settings = configure_cpu_threads(None, env=env, cpus=8)
    assert (settings.num_threads, settings.source) == (3, "OMP_NUM_THREADS")
    assert env["OMP_NUM_THREADS"] == "3" and "OMP_NUM_THREADS" not in env.get(DEFAULTED_ENV, "")
    settings = configure_cpu_threads(2, env=env, cpus=8)
    assert (settings.num_threads, settings.source) == (2, "--num-threads") and env["OMP_NUM_THREADS"] == "2"
    env = {}
    settings = configure_cpu_threads(None, processes=2, env=env, cpus=8)
    assert env["OMP_NUM_THREADS"] == "4" and settings.wait_policy == {}


def test_configure_applies_to_the_running_torch(clean_environ: None) -> None:
    configure_cpu_threads(1)
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1" and "OMP_WAIT_POLICY" not in os.environ


# ------------------------------------------------------------------ spawned processes
def _child_report(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import torch as child_torch

    queue.put((child_torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY")))


def _spawned_report() -> tuple[int, str | None]:
    ctx = multiprocessing.get_context("spawn")  # as the server's scheduler and the TP workers
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_report, args=(queue,))
    proc.start()
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(30)


def test_spawned_child_starts_openmp_with_the_settings(clean_environ: None, capfd: pytest.CaptureFixture[str]) -> None:
    configure_cpu_threads(1)
    os.environ["OMP_DISPLAY_ENV"] = "VERBOSE"  # the child's libgomp prints what it read, at load
    assert _spawned_report() == (1, None)
    assert "OMP_NUM_THREADS = '1'" in capfd.readouterr().err  # what the child's libgomp read at load


def test_spawned_child_keeps_the_users_settings(clean_environ: None, capfd: pytest.CaptureFixture[str]) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "1234", "OMP_DISPLAY_ENV": "VERBOSE"})
    configure_cpu_threads(None)
    assert _spawned_report() == (1, None)
    assert "GOMP_SPINCOUNT = '1234'" in capfd.readouterr().err


def test_engine_num_threads(tiny_llama, clean_environ: None) -> None:
    from servelm.entrypoints.engine import Engine

    folder, _ = tiny_llama
    engine = Engine(model_path=str(folder), max_total_tokens=256, num_threads=1)
    try:
        assert torch.get_num_threads() == 1
        assert (engine.cpu_threads.num_threads, engine.cpu_threads.source) == (1, "--num-threads")
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})["output_ids"]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ the governor
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_governor(gov: ThreadGovernor, clock: Clock, samples: list[int]) -> None:
    for _ in samples:
        clock.t += gov.interval_s
        gov.tick()


def test_governor_runs_on_the_cpus_others_leave_free() -> None:
    seen: list[int] = []
    load = iter([1, 1, 0, 1, 1] + [1] * 5 + [0] * 5 + [3] * 5)
    clock, set_to = Clock(), []
    gov = ThreadGovernor(2, 2, interval_s=0.2, window=5, sample=lambda: seen.append(0) or next(load),
                         set_threads=set_to.append, clock=clock)
    gov.tick()
    gov.tick()  # within the interval: no sample
    assert len(seen) == 1
    run_governor(gov, clock, [0] * 4)  # the window fills: mean 0.8 of another process running -> 1 thread
    assert set_to == [1] and gov.threads == 1
    run_governor(gov, clock, [0] * 5)  # still one other process: stays
    assert set_to == [1]
    run_governor(gov, clock, [0] * 5)  # it is gone: all threads again
    assert set_to == [1, 2] and gov.threads == 2
    run_governor(gov, clock, [0] * 5)  # three others on two CPUs: never fewer than one thread
    assert set_to == [1, 2, 1]


def test_governor_starts_afresh_after_a_pause() -> None:
    """What others did while the model was idle (no ticks) is not counted: a busy window before a pause does
    not decide after it."""
    clock, set_to = Clock(), []
    load = iter([1.0] * 4 + [1.0] + [0.0] * 5 + [1.0] * 5)
    gov = ThreadGovernor(2, 2, interval_s=0.2, window=5, sample=lambda: next(load), set_threads=set_to.append,
                         clock=clock)
    run_governor(gov, clock, [0] * 4)  # four busy samples, one short of a decision
    clock.t += 5.0  # idle: no ticks
    run_governor(gov, clock, [0] * 6)  # the sample spanning the pause is dropped, and the four before it
    assert set_to == []
    run_governor(gov, clock, [0] * 5)  # a busy window of its own
    assert set_to == [1]


def test_governor_is_off_where_the_count_is_the_users(clean_environ: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda *a: 2)
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 2)
    assert ThreadGovernor.for_process(None) is not None
    assert ThreadGovernor.for_process(2) is None  # --num-threads
    assert ThreadGovernor.for_process(None, deterministic=True) is None  # results must not depend on load
    assert ThreadGovernor.for_process(None, processes=2) is None  # one thread per TP rank: nothing to adapt
    os.environ["OMP_NUM_THREADS"] = "2"
    assert ThreadGovernor.for_process(None) is None  # the user's OMP_NUM_THREADS
    del os.environ["OMP_NUM_THREADS"]
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 64)
    assert ThreadGovernor.for_process(None) is None  # a quota on a bigger machine: others are not rivals


def _fake_proc(root: Path, busy: int, spent: dict[str, int]) -> None:
    """/proc/stat with `busy` jiffies of user time and /proc/<name>/stat with `spent` jiffies of utime."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 500 7 0 0 0 0 0\ncpu0 1 2 3\nprocs_running 5\n")
    for name, jiffies in spent.items():
        (root / name).mkdir(exist_ok=True)
        fields = ["S", "1"] + ["0"] * 9 + [str(jiffies), "0"] + ["0"] * 8
        (root / name / "stat").write_text(f"{name} (python (x) y) {' '.join(fields)}\n")


def test_others_load_is_the_cpu_time_of_other_processes(tmp_path: Path) -> None:
    """Busy time of the machine less this process's and its family's, over the wall time between calls."""
    ticks = cpu_threads._CLOCK_TICKS
    clock = Clock()
    family = [7, 8]
    load = cpu_threads.OthersLoad(tmp_path, family=lambda: family, clock=clock)
    _fake_proc(tmp_path, 1000, {"self": 300, "7": 50, "8": 10})
    assert load() is None  # the first call only starts the count
    clock.t = 1.0
    # 1.5 CPU-seconds busy in 1 s: this process 0.5, the API process 0.2, the detokenizer 0, others 0.8
    _fake_proc(tmp_path, 1000 + int(1.5 * ticks), {"self": 300 + int(0.5 * ticks), "7": 50 + int(0.2 * ticks),
                                                   "8": 10})
    assert load() == pytest.approx(0.8)
    clock.t = 2.0
    family.remove(8)  # gone, and a new relative that has spent 30 jiffies before it counts
    family.append(9)
    _fake_proc(tmp_path, 1000 + int(1.6 * ticks), {"self": 300 + int(0.6 * ticks), "7": 50 + int(0.2 * ticks),
                                                   "9": 30})
    assert load() == pytest.approx(0.0)
    assert cpu_threads.OthersLoad(tmp_path / "missing")() is None
    real = cpu_threads.OthersLoad()  # this machine's /proc
    assert real() is None
    time.sleep(0.2)
    assert 0.0 <= real() <= (os.cpu_count() or 1) + 1.0  # jiffies: a tick or two of rounding each way


def test_serving_family_reads_the_process_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads.os, "getpid", lambda: 20)
    monkeypatch.setattr(cpu_threads.os, "getppid", lambda: 10)
    tree = {10: {10: "20 21", 11: "22"}, 20: {20: "30"}, 21: {21: ""}}  # pid -> its threads' children files
    for pid, threads in tree.items():
        for tid, kids in threads.items():
            (tmp_path / str(pid) / "task" / str(tid)).mkdir(parents=True)
            (tmp_path / str(pid) / "task" / str(tid) / "children").write_text(kids)
    assert serving_family(tmp_path) == [10, 21, 22, 30]
    # and on this machine: the parent (pytest's, or a shell) is in it, this process is not
    assert os.getppid() in serving_family() or os.getppid() == 1
    assert os.getpid() not in serving_family()
