"""GPU memory as nvidia-smi reports it, for the GPU tests and bench/bench_gpu.py."""

from __future__ import annotations

import subprocess

from tests.proc_tree import descendants


def gpu_memory_mib(pid: int | None = None) -> float:
    """GPU memory used by `pid` and its children (nvidia-smi's per-process figure); where nvidia-smi
    lists no process (a container's PID namespace hides them), the whole GPU's used memory."""
    apps = _smi("--query-compute-apps=pid,used_memory")
    pids = None if pid is None else set(descendants(pid))
    listed = [(int(p), float(m)) for p, _, m in (line.partition(",") for line in apps) if p.strip().isdigit()]
    if not listed:
        return sum(float(line) for line in _smi("--query-gpu=memory.used") if line.strip())
    return sum(m for p, m in listed if pids is None or p in pids)


def _smi(query: str) -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
    )
    return out.stdout.splitlines()
