"""Random streams that make seeded requests reproducible, and retries idempotent.

Each (request seed, cycle, role) gets its own torch.Generator, derived by hashing,
instead of one generator carried along a session. So a cycle replayed after a
fault, or served by a restarted replica, draws exactly the same numbers; and the
draft's and target's streams never overlap.
"""

from __future__ import annotations

import hashlib

import torch

DRAFT = "draft"
TARGET = "target"


def stream_seed(seed: int, cycle: int, role: str) -> int:
    """A 63-bit seed for (seed, cycle, role)."""
    digest = hashlib.blake2b(f"{seed}:{cycle}:{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def cycle_generator(seed: int, cycle: int, role: str, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, cycle, role))
    return generator
