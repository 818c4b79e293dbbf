"""Where the CPU LoRA workers run: the NUMA topology this process may use, the node nearest a GPU,
disjoint core sets for the workers, and pinning (CaraServe-style: each CPU worker is pinned to cores
of the node its GPU worker hangs off, so LoRA activations cross no socket link).

Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# One item of the kernel's list format: "8" or "10-11" (as in "0-3,8,10-11").
_CPULIST_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
# "0000:3b:00.0" (sysfs) or "00000000:3B:00.0" (torch, NVML): domain:bus:device.function.
_PCI_BUS_ID = re.compile(r"([0-9a-f]{4}|[0-9a-f]{8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
_NODE_DIR = re.compile(r"node[0-9]+")


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a kernel cpulist ("0-3,8,10-11\\n" -> [0, 1, 2, 3, 8, 10, 11]), sorted and unique.
    An empty list (a CPU-less node) is "". Raises ValueError on anything else."""
    text = text.strip()
    if not text:
        return []
    cpus: set[int] = set()
    for item in text.split(","):
        match = _CPULIST_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"malformed cpulist item {item!r} in {text!r}")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise ValueError(f"descending range {item!r} in cpulist {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's list format for `cpus`, runs collapsed: [0, 1, 2, 3, 8, 10, 11] -> "0-3,8,10-11"."""
    ordered = sorted(set(cpus))
    if ordered and ordered[0] < 0:
        raise ValueError(f"negative CPU id {ordered[0]}")
    runs: list[str] = []
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            runs.append(str(ordered[start]) if start == i else f"{ordered[start]}-{cpu}")
            start = i + 1
    return ",".join(runs)


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # sorted; only CPUs that are online and allowed to this process


def _node_dirs(sys_root: Path) -> list[Path]:
    node_root = sys_root / "devices/system/node"
    if not node_root.is_dir():
        return []
    return sorted((p for p in node_root.iterdir() if _NODE_DIR.fullmatch(p.name)), key=lambda p: int(p.name[4:]))


def read_topology(sys_root: Path = Path("/sys")) -> list[NumaNode]:
    """The NUMA nodes this process can run on, by id, each with its online CPUs that
    os.sched_getaffinity(0) allows; nodes left without such CPUs are dropped. Without a node
    directory (containers, non-NUMA kernels) it is one node 0 holding every usable CPU."""
    usable = set(os.sched_getaffinity(0))
    online_file = sys_root / "devices/system/cpu/online"
    if online_file.is_file():
        usable &= set(parse_cpulist(online_file.read_text()))
    dirs = _node_dirs(sys_root)
    if not dirs:
        return [NumaNode(0, tuple(sorted(usable)))]
    nodes = (NumaNode(int(d.name[4:]), tuple(c for c in parse_cpulist((d / "cpulist").read_text()) if c in usable))
             for d in dirs)
    return [node for node in nodes if node.cpus]


def gpu_numa_node(pci_bus_id: str, sys_root: Path = Path("/sys")) -> int | None:
    """The NUMA node of the PCI device `pci_bus_id` (either domain width, any case), or None when
    the kernel does not know it (-1, no NUMA) or the device is not there."""
    match = _PCI_BUS_ID.fullmatch(pci_bus_id.strip().lower())
    if match is None:
        raise ValueError(f"malformed PCI bus id {pci_bus_id!r}; expected like 0000:3b:00.0")
    # sysfs pads the domain to 4 digits; the 8-digit form only adds leading zeros.
    sysfs_id = f"{int(match[1], 16):04x}:{match[2]}:{match[3]}.{match[4]}"
    numa_file = sys_root / "bus/pci/devices" / sysfs_id / "numa_node"
    if not numa_file.is_file():
        return None
    node = int(numa_file.read_text())
    return None if node < 0 else node


def choose_cores(nodes: list[NumaNode], node: int | None, workers: int, cores_each: int,
                 reserved: int = 1) -> list[tuple[int, ...]]:
    """Disjoint sets of `cores_each` cores for `workers` CPU LoRA workers. Nodes are used nearest
    `node` first (by id distance, ties to the lower id; by id when `node` is None); the first of them
    is the GPU worker's home and keeps its first `reserved` cores for the engine thread. A worker's
    cores never span two nodes. Raises ValueError when they do not fit."""
    if workers < 0 or cores_each < 1 or reserved < 0:
        raise ValueError(f"need workers >= 0, cores_each >= 1, reserved >= 0; "
                         f"got {workers}, {cores_each}, {reserved}")
    home = node if node is not None else 0
    ordered = sorted(nodes, key=lambda n: (abs(n.id - home), n.id))
    pools = [n.cpus[reserved:] if i == 0 else n.cpus for i, n in enumerate(ordered)]
    sets = [pool[k:k + cores_each] for pool in pools for k in range(0, len(pool) - cores_each + 1, cores_each)]
    if len(sets) < workers:
        raise ValueError(
            f"{workers} CPU LoRA workers x {cores_each} cores asked for {workers * cores_each} cores, but "
            f"nodes {[n.id for n in ordered]} have {sum(map(len, pools))} usable cores (after reserving "
            f"{reserved} for the GPU worker), room for {len(sets)} workers kept within one node each")
    return sets[:workers]


def pin(pid: int, cpus: Iterable[int]) -> None:
    """Restrict process `pid` to `cpus` (its threads started later inherit the mask)."""
    mask = set(cpus)
    if not mask:
        raise ValueError(f"refusing to pin process {pid} to no CPU")
    os.sched_setaffinity(pid, mask)


def allowed_cpus(pid: int) -> list[int]:
    """The CPUs process `pid` may run on, as the kernel reports them in /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Cpus_allowed_list":
            return parse_cpulist(value)
    raise ValueError(f"no Cpus_allowed_list in /proc/{pid}/status")


def membind_prefix(node: int, sys_root: Path = Path("/sys")) -> list[str]:
    """A command prefix binding a child's memory and CPUs to `node`, or [] when numactl is missing
    or the machine has one node. Best effort: without it the child still runs, just with memory
    placed by the kernel's first-touch policy (usually the node it runs on, given pin())."""
    if len(_node_dirs(sys_root)) < 2 or shutil.which("numactl") is None:
        return []
    return ["numactl", f"--membind={node}", f"--cpunodebind={node}"]
