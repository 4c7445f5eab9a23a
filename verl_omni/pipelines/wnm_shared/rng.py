"""Request-level random number generation.

Every random draw of a rollout comes from its own ``torch.Generator`` seeded by a stable hash of the
tuple that identifies it, never from a global generator; the draws are made on the CPU in fp32 and moved
afterwards, so a request gives the same numbers on any worker, in any batch, in any order.

- initial noise: ``("init", run_seed, step, sample_id, stratum)`` (shared by the branches of a stratum;
  ``("init_branch", ..., stratum, branch)`` when the sampler's ``shared_initial_noise`` is off);
- SDE noise: ``("sde", run_seed, step, sample_id, stratum, branch, denoising_step)``;
- window choice: ``("window", run_seed, step)`` (one window per training step).
"""

from __future__ import annotations

import hashlib

import torch

_SEED_MASK = (1 << 63) - 1


def _encode(part) -> bytes:
    # Type-tagged, length-prefixed encoding: ("1", 2) and ("12",) cannot collide, ints and strings differ.
    if isinstance(part, bool) or not isinstance(part, (int, str)):
        raise TypeError(f"stable_seed parts must be int or str, got {type(part).__name__} ({part!r})")
    tag, data = (b"i", str(part).encode()) if isinstance(part, int) else (b"s", part.encode("utf-8"))
    return tag + len(data).to_bytes(4, "little") + data


def stable_seed(*parts: int | str) -> int:
    """63-bit seed from blake2b over a canonical encoding of ``parts`` (stable across processes)."""
    digest = hashlib.blake2b(b"".join(_encode(p) for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def generator_for(*parts: int | str) -> torch.Generator:
    """A fresh CPU generator seeded with :func:`stable_seed` of ``parts``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(stable_seed(*parts))
    return gen


def initial_noise(
    run_seed: int, step: int, sample_id: str, stratum: int, numel: int, branch: int | None = None
) -> torch.Tensor:
    """``x_0 ~ N(0, I)`` of one stratum: ``[numel]`` fp32 on CPU.

    With ``branch`` given, the noise is drawn per rollout instead (key ``("init_branch", ..., stratum,
    branch)``): the "independent initial noise" ablation, where branches no longer share ``x_0``.
    """
    if branch is None:
        gen = generator_for("init", run_seed, step, sample_id, stratum)
    else:
        gen = generator_for("init_branch", run_seed, step, sample_id, stratum, branch)
    return torch.randn(numel, generator=gen, dtype=torch.float32)


def sde_noise(
    run_seed: int, step: int, sample_id: str, stratum: int, branch: int, denoising_step: int, numel: int
) -> torch.Tensor:
    """Standard-normal SDE noise of one branch at one denoising step: ``[numel]`` fp32 on CPU."""
    gen = generator_for("sde", run_seed, step, sample_id, stratum, branch, denoising_step)
    return torch.randn(numel, generator=gen, dtype=torch.float32)
