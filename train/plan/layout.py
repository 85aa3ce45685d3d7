"""How the training state is laid out over the data-parallel ranks (train.parallel,
train.fsdp_size): replicate (every rank holds everything) or fsdp over `shard` ranks x `replicas`
groups (HSDP when replicas > 1). The memory plan resolves train.parallel=auto first;
train/distributed/fsdp.py (CPU/CUDA) and train/xla/sharding.py (TPU) build the model in the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from codex.core.config import ConfigError


@dataclass(frozen=True)
class Layout:
    """How the training state is laid out over the world_size data-parallel ranks."""

    parallel: str = "replicate"  # "replicate" (every rank holds everything) or "fsdp"
    shard: int = 1  # ranks one copy of the state is sharded over (fsdp)
    replicas: int = 1  # copies of the sharded state (HSDP when > 1 under fsdp)
    # fsdp: True frees each block's gathered weights after its forward and gathers them again in
    # its backward (ZeRO-3); False keeps them from forward to backward (ZeRO-2: one all-gather
    # per block a micro-batch instead of two). Decided by the memory plan (MemoryPlan's field of
    # the same name, train/plan/plan.py: make_plan); read by train/distributed/fsdp.py.
    reshard_after_forward: bool = True

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"

    def describe(self) -> str:
        if not self.sharded:
            return "replicate"
        return (
            f"fsdp over {self.shard}"
            + (f" x {self.replicas} replicas (HSDP)" if self.replicas > 1 else "")
            + (
                ", gathered weights freed after forward (ZeRO-3)"
                if self.reshard_after_forward
                else ", gathered weights kept from forward to backward (ZeRO-2)"
            )
        )


def layout_for(parallel: str, fsdp_size: int, world_size: int) -> Layout:
    """The Layout for train.parallel (replicate | fsdp: auto is resolved by the memory plan first)
    and train.fsdp_size on world_size ranks. One process is always replicated: sharding over one
    rank is the same layout."""
    if parallel == "replicate" or world_size == 1:
        return Layout("replicate")
    size = fsdp_size or world_size
    if size > world_size or world_size % size:
        raise ConfigError(
            f"train.fsdp_size={size} must divide the world size {world_size} "
            f"(0 = all {world_size} ranks)"
        )
    return Layout("fsdp", shard=size, replicas=world_size // size)
