"""CPU threads of the model: how many, from what this process may really use, and fewer while other
processes want the same CPUs.

torch 2.13's CPU wheel runs its intra-op pool, MKL and oneDNN on GNU OpenMP (the bundled libgomp.so.1).
Two of its habits hurt on shared machines:

* Thread count. libgomp and MKL use every CPU of the machine, not those this process may run on: a
  container limited by its affinity mask or its cgroup CPU quota gets more threads than CPUs, and the
  surplus only waits at barriers. `configure_cpu_threads` counts the CPUs really available and puts the
  count in OMP_NUM_THREADS before the scheduler and TP worker processes are spawned (they inherit it).
* Competition. With as many threads as CPUs and another busy process on the machine, a thread that loses
  its core holds up every barrier of every op, and libgomp's workers spin between ops, taking CPU from the
  other process. `ThreadGovernor` watches the CPU time other processes take and runs the model on the
  CPUs they leave free, back to all of them once they are gone. Measured on the 2-core dev machine
  (README, "Speed switches"), this keeps the idle speed of libgomp's default (spinning) wait policy and
  more than doubles the decode speed next to a process that burns a core (x0.99 idle, x2.28 busy); a
  passive wait policy, the alternative, lost ~20% idle for about the same busy speed.

A user's own OMP_NUM_THREADS and OMP_WAIT_POLICY/GOMP_SPINCOUNT always win; an explicit `--num-threads`
wins over everything, and a count the user chose is never adapted. The names we set ourselves are listed in
SERVELM_DEFAULTED_ENV so that a later call (or a child process) can tell our defaults from the user's.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Names this module set itself (comma-separated), so they are not mistaken for the user's.
DEFAULTED_ENV = "SERVELM_DEFAULTED_ENV"

# The user's choice of how idle OpenMP workers wait (reported; libgomp's default spins, then sleeps).
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


# ------------------------------------------------------------------ how many CPUs
def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. `taskset`, docker --cpuset-cpus)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD", QUOTA "max" = no limit) -> CPUs, or None."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1 = no limit) -> CPUs, or None."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _own_cgroups(proc_self_cgroup: Path) -> list[tuple[str, str]]:
    """(controllers, path) lines of /proc/self/cgroup ("0::/a/b" for v2, "4:cpu,cpuacct:/a/b" for v1)."""
    text = _read(proc_self_cgroup) or ""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def _candidate_dirs(mount: Path, cgroup_path: str) -> list[Path]:
    """The process's cgroup directory and its ancestors under `mount` (each one's limit applies).

    Inside a container the mount's root usually *is* the container's cgroup while
    /proc/self/cgroup still names the host path, so the root is always checked too.
    """
    dirs = []
    rel = Path(cgroup_path.lstrip("/"))
    while True:
        d = mount / rel
        if d.is_dir() and d not in dirs:
            dirs.append(d)
        if rel == rel.parent:
            break
        rel = rel.parent
    if mount not in dirs:
        dirs.append(mount)
    return dirs


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The tightest CPU quota (in CPUs, may be fractional) of this process's cgroups, v2 or v1; None = none."""
    limits: list[float] = []
    for controllers, path in _own_cgroups(proc_self_cgroup):
        if controllers == "":  # cgroup v2 (unified): cpu.max in each directory
            for d in _candidate_dirs(cgroup_root, path):
                text = _read(d / "cpu.max")
                limit = parse_cpu_max(text) if text is not None else None
                if limit is not None:
                    limits.append(limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own mount
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                mount = cgroup_root / name
                if not mount.is_dir():
                    continue
                for d in _candidate_dirs(mount, path):
                    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                    limit = parse_cfs_quota(quota, period) if quota is not None and period is not None else None
                    if limit is not None:
                        limits.append(limit)
                break
    return min(limits) if limits else None


def available_cpus(cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """CPUs this process can actually use: its affinity mask, capped by its cgroup CPU quota.

    A fractional quota rounds down (at least 1), as Go's automaxprocs does: a thread
    that cannot get a whole CPU stalls every barrier the others wait at.
    """
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(cgroup_root, proc_self_cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


# ------------------------------------------------------------------ the environment
def _defaulted(env: MutableMapping[str, str]) -> set[str]:
    return {n for n in env.get(DEFAULTED_ENV, "").split(",") if n}


def _user_set(env: MutableMapping[str, str], name: str) -> bool:
    """True when `name` is in the environment and was not put there by us."""
    return name in env and name not in _defaulted(env)


def _set_default(env: MutableMapping[str, str], name: str, value: str) -> None:
    env[name] = value
    env[DEFAULTED_ENV] = ",".join(sorted(_defaulted(env) | {name}))


@dataclass(frozen=True)
class ThreadSettings:
    num_threads: int
    source: str  # "--num-threads", "OMP_NUM_THREADS", or "available CPUs"
    wait_policy: dict[str, str]


def resolve_num_threads(num_threads: int | None, processes: int = 1,
                        env: MutableMapping[str, str] | None = None,
                        cpus: int | None = None) -> tuple[int, str]:
    """Threads per process: --num-threads, else the user's OMP_NUM_THREADS, else available CPUs / processes.

    `processes` is how many model processes share this machine's CPUs (the TP ranks of this node).
    """
    env = os.environ if env is None else env
    if num_threads is not None:
        return max(1, num_threads), "--num-threads"
    if _user_set(env, "OMP_NUM_THREADS"):
        try:
            # OMP_NUM_THREADS may be a list ("4,2") for nested levels; the first is the pool size.
            return max(1, int(env["OMP_NUM_THREADS"].split(",")[0])), "OMP_NUM_THREADS"
        except ValueError:
            pass  # libgomp ignores a malformed value too
    cpus = available_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, processes)), "available CPUs"


def configure_cpu_threads(num_threads: int | None = None, processes: int = 1,
                          env: MutableMapping[str, str] | None = None, cpus: int | None = None) -> ThreadSettings:
    """Set the thread count for this process and every process it spawns afterwards.

    The count goes into OMP_NUM_THREADS (read by the children's libgomp and MKL at
    load) and, when torch is already loaded here, into torch.set_num_threads
    (omp_set_num_threads applies to a running pool).
    """
    env = os.environ if env is None else env
    policy = {name: env[name] for name in WAIT_POLICY_VARS if name in env}
    count, source = resolve_num_threads(num_threads, processes, env, cpus)
    if source == "--num-threads":
        # An explicit flag beats the environment; it is still ours to replace on the next call.
        _set_default(env, "OMP_NUM_THREADS", str(count))
    elif source == "available CPUs":
        _set_default(env, "OMP_NUM_THREADS", str(count))
    if env is os.environ and "torch" in sys.modules:
        import torch

        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
    return ThreadSettings(count, source, policy)


# ------------------------------------------------------------------ adapting to other processes
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's time unit


def _busy_seconds(proc_stat: Path) -> float | None:
    """CPU seconds the machine has spent busy since boot (/proc/stat's cpu line: user, nice, system, irq,
    softirq; guest time is inside user), or None where /proc does not say."""
    text = _read(proc_stat)
    line = next((ln for ln in (text or "").splitlines() if ln.startswith("cpu ")), None)
    if line is None:
        return None
    try:
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in line.split()[1:8])
    except ValueError:
        return None
    return (user + nice + system + irq + softirq) / _CLOCK_TICKS


def _process_seconds(stat_path: Path) -> float | None:
    """A process's CPU seconds (utime + stime of /proc/PID/stat, all its threads), or None once it is gone."""
    text = _read(stat_path)
    if not text:
        return None
    fields = text[text.rfind(")") + 2:].split()  # "pid (comm) S ...": comm may hold spaces and parentheses
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (IndexError, ValueError):
        return None


def serving_family(proc: Path = Path("/proc")) -> list[int]:
    """The processes that serve beside this one: its parent (the API server, or the program of an offline
    Engine), the parent's other children (detokenizer, other ranks and replicas) and this process's own
    children. Their work is this server's: the governor does not give them the model's cores."""
    def children(pid: int) -> list[int]:
        out: list[int] = []
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:
            return out
        for task in tasks:
            out.extend(int(c) for c in (_read(task / "children") or "").split())
        return out

    me, parent = os.getpid(), os.getppid()
    return sorted(pid for pid in {parent, *children(parent), *children(me)} - {me} if pid > 1)


class OthersLoad:
    """How many CPUs other processes kept busy since the previous call: the machine's busy CPU time less this
    process's and its serving family's, over the wall time between the two calls (None on the first call, or
    where /proc does not say).

    NOTE: this replaced a count of other processes' runnable tasks sampled every 0.2 s. On a shared 2-core VM
    that count averaged 0.4-0.8 with nothing of ours running (kernel threads, the host's agents: each
    instant caught a task on its way), and an embedding server's own API process (~0.2-0.3 CPU at 32
    requests in flight) counted as a rival too: MiniLM's model ran on one of its two threads most of the
    time, 72-82 inputs/s against 90-103 on two (docs/embeddings.md). Time spent is what a rival takes."""

    def __init__(self, proc: Path = Path("/proc"), family: Callable[[], list[int]] = serving_family,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self.family = family
        self.clock = clock
        self._last: tuple[float, float, dict[int, float]] | None = None

    def __call__(self) -> float | None:
        busy = _busy_seconds(self.proc / "stat")
        own = _process_seconds(self.proc / "self" / "stat")
        if busy is None or own is None:
            self._last = None
            return None
        ours = {0: own}  # key 0: this process
        for pid in self.family():
            spent = _process_seconds(self.proc / str(pid) / "stat")
            if spent is not None:
                ours[pid] = spent
        now, last = self.clock(), self._last
        self._last = (now, busy, ours)
        if last is None or now <= last[0]:
            return None
        # a relative that appeared since the last call counts from now; one that exited takes its last moments
        ours_spent = sum(t - last[2].get(pid, t) for pid, t in ours.items())
        return max(0.0, busy - last[1] - ours_spent) / (now - last[0])


class ThreadGovernor:
    """Runs the model with fewer threads while other processes want this machine's CPUs, and with all of
    them again once they are gone.

    With as many threads as CPUs and another busy process, a thread that loses its core holds up every
    barrier of every op (and libgomp's spinning workers take CPU from the other process): measured on the
    2-core dev machine, decode fell to a quarter; one thread keeps ~2/3 of the idle speed. So, every
    `interval_s` while it is working, it samples how many CPUs other processes kept busy (`OthersLoad`: not
    this server's own processes); over `window` samples it picks `cpus - round(mean)` threads (at least 1,
    at most `max_threads`).
    `tick()` is cheap between samples; the scheduler calls it every step.
    """

    def __init__(self, max_threads: int, cpus: int, *, interval_s: float = 0.2, window: int = 5,
                 sample: Callable[[], float | None] | None = None,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.cpus = cpus
        self.threads = max_threads
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self._sample = sample if sample is not None else OthersLoad()
        self._set_threads = set_threads or _set_torch_threads
        self._clock = clock
        self._next = 0.0

    @classmethod
    def for_process(cls, num_threads: int | None, processes: int = 1,
                    deterministic: bool = False) -> ThreadGovernor | None:
        """The governor of a model process, or None where the count must not move: the user chose it
        (--num-threads, OMP_NUM_THREADS), there is one thread anyway, deterministic inference (its results
        must not depend on the machine's load), or /proc/stat counts CPUs this process cannot use (a CPU
        quota or affinity smaller than the machine: other tasks there are not our rivals)."""
        if deterministic:
            return None
        count, source = resolve_num_threads(num_threads, processes)
        cpus = available_cpus()
        if source != "available CPUs" or count < 2 or cpus != (os.cpu_count() or cpus) or (
                _busy_seconds(Path("/proc/stat")) is None):
            return None
        return cls(count, cpus)

    def tick(self) -> None:
        """Call while working (each step). After a pause (no call for two intervals) the count starts afresh:
        what other processes did while the model had nothing to run (a local client preparing its requests:
        it had put the model on one thread before the first request came) is not what they do now."""
        now = self._clock()
        if now < self._next:
            return
        paused = self._next > 0.0 and now > self._next + self.interval_s
        self._next = now + self.interval_s
        others = self._sample()
        if paused:
            self._samples.clear()
            return  # `others` spans the pause
        if others is None:
            return
        self._samples.append(others)
        if len(self._samples) < (self._samples.maxlen or 1):
            return
        mean = sum(self._samples) / len(self._samples)
        want = max(1, min(self.max_threads, self.cpus - round(mean)))
        if want != self.threads:
            logger.info("Other processes keep %.1f CPU(s) busy: the model now runs on %d thread(s) (of %d)",
                        mean, want, self.max_threads)
            self._set_threads(want)
            self.threads = want
            self._samples.clear()


def _set_torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def describe_threads(settings: ThreadSettings) -> str:
    policy = " ".join(f"{k}={v}" for k, v in settings.wait_policy.items()) or "libgomp's default wait policy"
    adapts = ", fewer while other processes keep the CPUs busy" if (
        settings.source == "available CPUs" and settings.num_threads > 1) else ""
    return f"{settings.num_threads} CPU threads ({settings.source}{adapts}), {policy}"
