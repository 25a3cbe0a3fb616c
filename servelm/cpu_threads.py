"""CPU threads of the model: how many, and how idle OpenMP workers wait.

torch 2.13's CPU wheel runs its intra-op pool, MKL and oneDNN on GNU OpenMP
(the bundled libgomp.so.1). Two of its defaults hurt on shared machines:

* Wait policy. After each parallel region libgomp's workers spin for
  GOMP_SPINCOUNT=300000 iterations of a `pause` loop before sleeping. On a
  recent Xeon that is milliseconds, i.e. a whole decode step: the workers never
  sleep, and when another process wants a core they fight it (and the thread
  that lost its core holds up every barrier). A passive policy (spin count 0)
  lets a finished worker sleep at once. libgomp reads OMP_WAIT_POLICY and
  GOMP_SPINCOUNT once, when the library is loaded, so this must be in the
  environment before torch is imported: `apply_wait_policy()` runs first thing
  in `servelm` and `Engine`, and the spawned scheduler / TP worker processes
  inherit the environment.
* Thread count. libgomp and MKL use every CPU of the machine, not those this
  process may run on: a container limited by its affinity mask or its cgroup
  CPU quota gets more threads than CPUs, and the surplus only waits at barriers.

A user's own OMP_* / GOMP_* settings always win over these defaults; an
explicit `--num-threads` wins over everything. The names we set ourselves are
listed in SERVELM_DEFAULTED_ENV so that a later call (or a child process) can
tell our defaults from the user's settings.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Names this module set itself (comma-separated), so they are not mistaken for the user's.
DEFAULTED_ENV = "SERVELM_DEFAULTED_ENV"

# The wait policy we default to. Measured on the 2-core dev machine (see README, "Speed switches"):
# passive costs nothing measurable idle and recovers most of what spinning loses under a competing load.
WAIT_POLICY_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these set by the user means the user chose the waiting behaviour: we leave it alone.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
THREAD_COUNT_VARS = ("OMP_NUM_THREADS",)

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


def apply_wait_policy(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Default OMP_WAIT_POLICY to passive unless the user chose any waiting setting; returns what is in force.

    Call before torch is imported: libgomp reads it once, when it is loaded (a
    process that already has torch keeps the policy it started with; threads
    spawned from it, i.e. our scheduler and TP workers, get the new one).
    """
    env = os.environ if env is None else env
    if not any(_user_set(env, name) for name in WAIT_POLICY_VARS):
        for name, value in WAIT_POLICY_DEFAULTS.items():
            _set_default(env, name, value)
    return {name: env[name] for name in WAIT_POLICY_VARS if name in env}


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
    """Set the wait policy and thread count for this process and every process it spawns afterwards.

    The count goes into OMP_NUM_THREADS (read by the children's libgomp and MKL at
    load) and, when torch is already loaded here, into torch.set_num_threads
    (omp_set_num_threads applies to a running pool). The wait policy only reaches
    a libgomp that is not loaded yet.
    """
    env = os.environ if env is None else env
    policy = apply_wait_policy(env)
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


def describe_threads(settings: ThreadSettings) -> str:
    policy = " ".join(f"{k}={v}" for k, v in settings.wait_policy.items()) or "libgomp default (spin)"
    return f"{settings.num_threads} CPU threads ({settings.source}), {policy}"


# Importing this module is the earliest point servelm can act for an in-process user
# (`from servelm.entrypoints.engine import Engine` imports it before torch): the policy
# only reaches a libgomp that loads after it. It is a default; the user's settings win.
apply_wait_policy()
