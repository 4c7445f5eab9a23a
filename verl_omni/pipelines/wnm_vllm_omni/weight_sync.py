"""Bucketed, versioned weight sync from the FSDP2 actor to a rollout engine (no vllm import).

Sender side (the actor): :func:`plan_buckets` splits the DiT's tensors, by name and in state-dict order,
into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own); :func:`iter_buckets`
materializes one bucket at a time, so at most one bucket of full (unsharded) tensors exists at once. For
an FSDP2 module :func:`full_tensor_source` all-gathers each ``DTensor`` as its bucket is built: every rank
must walk the same plan (the all-gathers are collectives).

Receiver side (the engine worker): :class:`WeightReceiver` copies buckets into the live module and only
then advances the version. ``begin -> load x N -> commit``; while a sync is open, or after one broke off,
the weights are a mix of two versions and the receiver says so (``ready`` is False), so that the pipeline
refuses to sample with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 512 << 20


class WeightSyncError(RuntimeError):
    """A bucket out of order, of another version, with unknown names or shapes; or an incomplete sync."""


@dataclass(frozen=True)
class WeightBucket:
    """One bucket of a versioned sync: ``tensors`` by parameter name, all on CPU unless said otherwise."""

    version: int
    index: int
    num_buckets: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(sizes: Iterable[tuple[str, int]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """Consecutive groups of names whose byte sizes add up to at most ``bucket_bytes``.

    Args:
        sizes: ``(name, nbytes)`` in the order the receiver should see them (state-dict order).
        bucket_bytes: Bucket budget (> 0); a tensor larger than it forms a bucket alone.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    seen: set[str] = set()
    for name, nbytes in sizes:
        if name in seen:
            raise ValueError(f"plan_buckets: duplicate tensor name {name!r}")
        seen.add(name)
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def iter_buckets(
    plan: list[list[str]], source: Callable[[str], torch.Tensor], version: int, device: str | torch.device = "cpu"
) -> Iterator[WeightBucket]:
    """Buckets of ``plan``, each built when the caller asks for it; ``source(name)`` gives a full tensor."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")
    for i, names in enumerate(plan):
        tensors = {n: source(n).detach().to(device).contiguous() for n in names}
        yield WeightBucket(version=version, index=i, num_buckets=len(plan), tensors=tensors)


def mapping_source(named: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    return named.__getitem__


def full_tensor_source(module: nn.Module) -> tuple[list[tuple[str, int]], Callable[[str], torch.Tensor]]:
    """``(sizes, source)`` over ``module.state_dict()``; ``DTensor`` shards are all-gathered on demand.

    ``sizes`` uses the full (global) shapes, so every rank computes the same plan.
    """
    state = module.state_dict()
    sizes = [(name, t.numel() * t.element_size()) for name, t in state.items()]

    def source(name: str) -> torch.Tensor:
        t = state[name]
        full = getattr(t, "full_tensor", None)
        return full() if callable(full) else t

    return sizes, source


class WeightReceiver:
    """Loads versioned buckets into ``module`` in place (same names as its ``state_dict``)."""

    def __init__(self, module: nn.Module, version: int = 0) -> None:
        self.module = module
        self.version = int(version)
        self._open: dict | None = None
        self._broken: str | None = None

    @property
    def ready(self) -> bool:
        """The weights are exactly those of :attr:`version` (no sync open, none broken off)."""
        return self._open is None and self._broken is None

    def status(self) -> str:
        if self._broken is not None:
            return f"weights are mixed: a sync broke off ({self._broken}); sync a full version again"
        if self._open is not None:
            o = self._open
            return f"a sync to version {o['version']} is open ({len(o['seen'])}/{o['num_buckets']} buckets)"
        return f"weights at version {self.version}"

    def begin(self, version: int, num_buckets: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightSyncError(f"weight version must be a non-negative int, got {version!r}")
        if version < self.version:
            raise WeightSyncError(f"weight version goes backwards: {version} < current {self.version}")
        if num_buckets < 1:
            raise WeightSyncError(f"a sync needs at least one bucket, got {num_buckets}")
        # Reopening (e.g. a retry after a failed sync) is allowed: the full set is sent again.
        self._open = {"version": version, "num_buckets": num_buckets, "seen": set(), "names": set()}

    def load(self, bucket: WeightBucket) -> None:
        o = self._open
        if o is None:
            raise WeightSyncError(f"bucket {bucket.index} of version {bucket.version} arrived with no sync open")
        try:
            if bucket.version != o["version"] or bucket.num_buckets != o["num_buckets"]:
                raise WeightSyncError(
                    f"bucket {bucket.index}/{bucket.num_buckets} of version {bucket.version} does not belong to "
                    f"the open sync (version {o['version']}, {o['num_buckets']} buckets)"
                )
            if not 0 <= bucket.index < o["num_buckets"] or bucket.index in o["seen"]:
                raise WeightSyncError(f"bucket index {bucket.index} repeated or out of range")
            state = self.module.state_dict()
            for name, t in bucket.tensors.items():
                if name not in state:
                    raise WeightSyncError(f"unknown tensor name {name!r} in bucket {bucket.index}")
                if name in o["names"]:
                    raise WeightSyncError(f"tensor {name!r} sent twice in version {bucket.version}")
                if tuple(t.shape) != tuple(state[name].shape):
                    raise WeightSyncError(
                        f"{name}: shape {list(t.shape)} != {list(state[name].shape)} of the rollout module"
                    )
            with torch.no_grad():
                for name, t in bucket.tensors.items():
                    state[name].copy_(t.to(device=state[name].device, dtype=state[name].dtype))
                    o["names"].add(name)
            o["seen"].add(bucket.index)
        except WeightSyncError as e:
            self._broken = str(e)
            raise

    def commit(self, version: int) -> int:
        o = self._open
        if o is None or o["version"] != version:
            raise WeightSyncError(f"commit of version {version} without a matching open sync ({self.status()})")
        missing = sorted(set(self.module.state_dict()) - o["names"])
        if len(o["seen"]) != o["num_buckets"] or missing:
            self._broken = f"version {version} incomplete: {len(o['seen'])}/{o['num_buckets']} buckets"
            raise WeightSyncError(
                f"commit of version {version}: {len(o['seen'])}/{o['num_buckets']} buckets, "
                f"tensors never sent: {missing[:5]}"
            )
        self.version = version
        self._open = None
        self._broken = None
        return version
