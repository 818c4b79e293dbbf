"""The edge of the adapter residency state machine (residency.py): the version it is asked about, the
port its loads' I/O goes through, its limits, and what it answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from policy.adapter_tiers import Tier
from policy.load_failures import Failure


class VersionRef(Protocol):
    """An adapter version as the registry names it (gpu_worker's AdapterRef, or the simulator's)."""
    @property
    def name(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def registered_ms(self) -> int: ...


class LoadPort(Protocol):
    """The loads' I/O, as the driver does it."""

    def start_read(self, ref: VersionRef) -> None:
        """Read `ref`'s files into host memory; the driver reports `read_done` or `read_failed`."""

    def start_copy(self, ref: VersionRef, slot: int) -> bool:
        """Copy `ref`'s host copy into GPU slot `slot`: True if done already, else the driver reports
        `copy_done`. Raises if it cannot start (the version's load fails)."""

    def release_slot(self, slot: int) -> None:
        """GPU slot `slot` holds nothing now."""

    def release_host(self, digest: str) -> None:
        """The host copy of version `digest` is no longer held."""

    def observe_load(self, source: str, seconds: float) -> None:
        """A load from `source` ("disk": into host memory; "host": onto the GPU) took `seconds`."""

    def load_failed(self, ref: VersionRef, names: list[str], failure: Failure, error: BaseException) -> None:
        """A load of `ref` (known under `names`) failed; requests for it fail until `failure.until`."""


@dataclass(frozen=True)
class ResidencyLimits:
    gpu_slots: int                            # adapters the GPU holds at once at most (kernel table rows)
    gpu_bytes: int
    host_bytes: int
    # The most a version takes on the GPU, and what its read reserves in host memory, before its files are
    # read (by its rank, and its task head's size where it has one).
    gpu_bytes_of: Callable[[VersionRef], int]
    host_bytes_of: Callable[[VersionRef], int]


class Residence(NamedTuple):  # not a frozen dataclass: asked for each waiting request at every pass, and 8x cheaper
    """What a request for a version finds now."""
    failure: str | None        # why its load failed, while its backoff lasts (nothing else holds then)
    slot: int | None           # its GPU slot from placement on (the copy may still run)
    rank: int                  # its weights' rank, once read
    usable: bool               # on the GPU, its copy completed
    in_host: bool              # its host copy is read
    copy_left_s: float | None  # about how long its copy onto the GPU still runs; None: no GPU placement yet


@dataclass(frozen=True)
class AdapterPlacement:
    """One adapter version held, under one of its names (what the registry is told)."""
    name: str
    sha256: str
    tier: Tier      # GPU: usable there; HOST: its host copy is read; DISK: neither yet (it is loading or waits for room)
    loading: bool   # on its way to the GPU: disk -> host, or host -> GPU
    pinned: bool    # by an operator's order (the admin API), not by requests
    newest: bool    # the version a new request for `name` gets (an older one serves its in-flight requests)
