"""What this host offers the server and the export: the cores a process may use, an NVIDIA driver.

Light on purpose (no ONNX Runtime, no numpy): the server's supervisor plans its processes with it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def gpu_present() -> bool:
    """An NVIDIA driver is loaded. onnxruntime-gpu lists CUDA as available on any machine."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


# cgroup v2: the CPU quota of this process's cgroup and its ancestors (a container's and its pod's).
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Cores this process may use: its CPU affinity (e.g. a container's cpuset), at most its cgroup's
    CPU quota (a pod's CPU limit, `docker run --cpus`).

    In a container the affinity is usually every core of the node: a pod limited to 2 CPUs on a
    64-core node would otherwise plan fronts and threads for 64.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpus(root, proc_cgroup)
    return min(cores, quota) if quota else cores


def cgroup_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Whole CPUs the tightest cgroup v2 `cpu.max` above this process allows (quota / period, rounded
    up); None where none is set ("max") or there is no cgroup v2 hierarchy."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    if own is None:
        return None
    here = root / own.strip().lstrip("/")
    limits = [_cpu_max(d / "cpu.max") for d in (here, *here.parents) if d.is_relative_to(root)]
    return min((n for n in limits if n is not None), default=None)


def _cpu_max(path: Path) -> int | None:
    try:
        quota, period = path.read_text(encoding="utf-8").split()
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None
