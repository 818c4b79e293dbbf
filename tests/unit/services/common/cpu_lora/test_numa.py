"""services.common.cpu_lora.numa: cpulists, topology from a fake sysfs tree, GPU nodes, core choice, pinning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.cpu_lora import numa
from services.common.cpu_lora.numa import (
    NumaNode,
    allowed_cpus,
    choose_cores,
    format_cpulist,
    gpu_numa_node,
    membind_prefix,
    parse_cpulist,
    pin,
    read_topology,
)

ALLOWED = sorted(os.sched_getaffinity(0))


def write_sysfs(root: Path, nodes: dict[int, list[int]] | None, online: list[int] | None) -> Path:
    """A fake /sys: node<id>/cpulist per node (no node directory when `nodes` is None), cpu/online."""
    if nodes is not None:
        for node_id, cpus in nodes.items():
            node_dir = root / f"devices/system/node/node{node_id}"
            node_dir.mkdir(parents=True)
            (node_dir / "cpulist").write_text(format_cpulist(cpus) + "\n")
        (root / "devices/system/node/online").write_text(format_cpulist(nodes) + "\n")
    if online is not None:
        (root / "devices/system/cpu").mkdir(parents=True)
        (root / "devices/system/cpu/online").write_text(format_cpulist(online) + "\n")
    return root


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
    ("5", [5]),
    ("0-0", [0]),
    ("", []),
    ("\n", []),
    ("2,0-1\n", [0, 1, 2]),
])
def test_parse_cpulist_reads_the_kernel_format(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("cpus", [[], [7], [0, 1, 2, 3, 8, 10, 11], [1, 3, 5], list(range(64)), [0, 2, 3, 4, 9]])
def test_format_then_parse_round_trips(cpus: list[int]) -> None:
    assert parse_cpulist(format_cpulist(cpus)) == cpus


def test_format_cpulist_collapses_runs_and_ignores_order_and_duplicates() -> None:
    assert format_cpulist([11, 0, 2, 1, 3, 8, 10, 3]) == "0-3,8,10-11"


@pytest.mark.parametrize("text", ["a", "1,,2", "1,", ",1", "3-1", "-1", "1-", "1-2-3", "0x3", "1 ,2", "0-7:2", "١"])
def test_parse_cpulist_rejects_malformed_input(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_format_cpulist_rejects_negative_ids() -> None:
    with pytest.raises(ValueError, match="negative"):
        format_cpulist([-1, 0])


def test_read_topology_drops_cpus_this_process_may_not_use(tmp_path: Path) -> None:
    outside = [ALLOWED[-1] + 1, ALLOWED[-1] + 2]  # not in os.sched_getaffinity(0)
    half = (len(ALLOWED) + 1) // 2
    tree = write_sysfs(tmp_path, {0: ALLOWED[:half] + outside[:1], 1: ALLOWED[half:] + outside[1:]},
                       online=ALLOWED + outside)
    expected = [NumaNode(0, tuple(ALLOWED[:half]))] + ([NumaNode(1, tuple(ALLOWED[half:]))] if ALLOWED[half:] else [])
    assert read_topology(tree) == expected


def test_read_topology_drops_offline_cpus_and_nodes_left_empty(tmp_path: Path) -> None:
    tree = write_sysfs(tmp_path, {0: ALLOWED[:1], 1: ALLOWED[1:]}, online=ALLOWED[1:])  # node 0's CPU offline
    assert read_topology(tree) == ([NumaNode(1, tuple(ALLOWED[1:]))] if ALLOWED[1:] else [])


def test_read_topology_without_node_directory_is_one_node_of_allowed_online_cpus(tmp_path: Path) -> None:
    assert read_topology(write_sysfs(tmp_path / "a", None, online=ALLOWED)) == [NumaNode(0, tuple(ALLOWED))]
    # No cpu/online file either: every allowed CPU counts as online.
    assert read_topology(write_sysfs(tmp_path / "b", None, online=None)) == [NumaNode(0, tuple(ALLOWED))]


def test_read_topology_of_this_machine_partitions_allowed_cpus() -> None:
    nodes = read_topology()
    cpus = [cpu for node in nodes for cpu in node.cpus]
    assert len(cpus) == len(set(cpus)) and set(cpus) <= set(ALLOWED) and cpus


def write_pci_device(root: Path, sysfs_id: str, numa_node: str) -> None:
    device = root / "bus/pci/devices" / sysfs_id
    device.mkdir(parents=True)
    (device / "numa_node").write_text(numa_node + "\n")


@pytest.mark.parametrize("bus_id", ["0000:3b:00.0", "00000000:3B:00.0", "0000:3B:00.0", "00000000:3b:00.0"])
def test_gpu_numa_node_accepts_both_domain_widths(tmp_path: Path, bus_id: str) -> None:
    write_pci_device(tmp_path, "0000:3b:00.0", "1")
    assert gpu_numa_node(bus_id, tmp_path) == 1


def test_gpu_numa_node_is_none_when_unknown_or_missing(tmp_path: Path) -> None:
    write_pci_device(tmp_path, "0000:af:00.0", "-1")
    assert gpu_numa_node("00000000:AF:00.0", tmp_path) is None
    assert gpu_numa_node("0000:18:00.0", tmp_path) is None


@pytest.mark.parametrize("bus_id", ["3b:00.0", "000:3b:00.0", "0000:3b:00", "0000:3g:00.0", "0000:3b:00.8"])
def test_gpu_numa_node_rejects_malformed_bus_ids(tmp_path: Path, bus_id: str) -> None:
    with pytest.raises(ValueError, match="PCI bus id"):
        gpu_numa_node(bus_id, tmp_path)


TWO_NODES = [NumaNode(0, tuple(range(8))), NumaNode(1, tuple(range(8, 16)))]


def assert_disjoint(sets: list[tuple[int, ...]], size: int) -> None:
    cpus = [cpu for cores in sets for cpu in cores]
    assert len(cpus) == len(set(cpus))
    assert all(len(cores) == size for cores in sets)


def node_of(cpu: int, nodes: list[NumaNode]) -> int:
    return next(node.id for node in nodes if cpu in node.cpus)


def test_choose_cores_gives_disjoint_sets_on_the_preferred_node() -> None:
    sets = choose_cores(TWO_NODES, node=1, workers=3, cores_each=2)
    assert len(sets) == 3
    assert_disjoint(sets, 2)
    assert {node_of(cpu, TWO_NODES) for cores in sets for cpu in cores} == {1}


def test_choose_cores_leaves_reserved_cores_of_the_preferred_node_free() -> None:
    # Node 1 has 8 cores; reserving 2 leaves room for exactly 3 workers of 2 there.
    sets = choose_cores(TWO_NODES, node=1, workers=3, cores_each=2, reserved=2)
    used = {cpu for cores in sets for cpu in cores}
    assert len(used & set(TWO_NODES[1].cpus)) == 6
    assert {node_of(cpu, TWO_NODES) for cpu in used} == {1}


def test_choose_cores_falls_back_to_the_nearest_other_node() -> None:
    nodes = [NumaNode(0, (0, 1, 2, 3)), NumaNode(1, (4, 5, 6, 7)), NumaNode(3, (8, 9, 10, 11))]
    # Node 1 keeps one core, so it holds one worker of 2; the next goes to node 0 (distance 1), not 3.
    sets = choose_cores(nodes, node=1, workers=3, cores_each=2)
    assert_disjoint(sets, 2)
    assert [node_of(cores[0], nodes) for cores in sets] == [1, 0, 0]
    assert all(len({node_of(cpu, nodes) for cpu in cores}) == 1 for cores in sets)  # no set spans nodes


def test_choose_cores_without_a_gpu_node_starts_at_the_lowest_id() -> None:
    sets = choose_cores(TWO_NODES, node=None, workers=2, cores_each=3)
    assert {node_of(cpu, TWO_NODES) for cores in sets for cpu in cores} == {0}


def test_choose_cores_says_how_many_cores_there_are_when_too_few() -> None:
    nodes = [NumaNode(0, (0, 1, 2, 3))]
    with pytest.raises(ValueError, match=r"asked for 8 cores.* 3 usable cores"):
        choose_cores(nodes, node=0, workers=4, cores_each=2)


@pytest.mark.parametrize(("workers", "cores_each", "reserved"), [(1, 0, 1), (-1, 1, 1), (1, 1, -1)])
def test_choose_cores_rejects_nonsense_counts(workers: int, cores_each: int, reserved: int) -> None:
    with pytest.raises(ValueError):
        choose_cores(TWO_NODES, node=0, workers=workers, cores_each=cores_each, reserved=reserved)


def test_pin_restricts_a_running_child_to_one_cpu() -> None:
    cpu = ALLOWED[-1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert allowed_cpus(child.pid) == ALLOWED  # inherited before pinning
        pin(child.pid, [cpu])
        assert allowed_cpus(child.pid) == [cpu]
        assert os.sched_getaffinity(child.pid) == {cpu}
    finally:
        child.kill()
        child.wait()


def test_pin_refuses_an_empty_cpu_set() -> None:
    with pytest.raises(ValueError):
        pin(os.getpid(), [])


def test_membind_prefix_only_with_several_nodes_and_numactl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one = write_sysfs(tmp_path / "one", {0: ALLOWED}, online=ALLOWED)
    two = write_sysfs(tmp_path / "two", {0: [0, 1], 1: [2, 3]}, online=[0, 1, 2, 3])
    monkeypatch.setattr(numa.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert membind_prefix(0, one) == []
    assert membind_prefix(1, two) == ["numactl", "--membind=1", "--cpunodebind=1"]
    monkeypatch.setattr(numa.shutil, "which", lambda name: None)
    assert membind_prefix(1, two) == []
