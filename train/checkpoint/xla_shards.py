"""XLA SPMD tensors in a checkpoint: each host writes and reads only the shards its own chips hold,
as torch_xla's SPMDSavePlanner and SPMDLoadPlanner do, inside codex's DCP folder format.

    pieces = host_shards(t)            # save: this host's distinct shards of t, on the CPU
    target = host_targets(like, dtype) # load: empty CPU pieces where `like` has its local shards
    t = to_device(target)              # a new XLA tensor with like's sharding, built from them
    place(param, target)               # the same, swapped into a parameter (param.data)

Loading never makes a tensor whole, on a host or a chip. How pieces become DCP chunks, and why
the planners find a piece by its offset: docs/checkpoints.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.utils import find_state_dict_object

Offsets = tuple[int, ...]


@dataclass
class HostShards:
    """One tensor's pieces held by this host: {offsets in the global tensor: CPU tensor}. `like`:
    the XLA tensor whose sharding the pieces go back into (load targets only)."""

    shape: torch.Size
    dtype: torch.dtype
    pieces: dict[Offsets, torch.Tensor]
    like: Any = field(default=None, repr=False)

    def size(self) -> torch.Size:  # DCP compares it with the saved tensor's size
        return self.shape

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pieces.values())

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset or ())
        if offsets not in self.pieces:
            raise ValueError(f"checkpoint state key {index.fqn!r}: no piece at {offsets}")
        return self.pieces[offsets]

    # DCP's tensor protocol (torch/distributed/checkpoint/planner_helpers.py), as DTensor has it

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), piece.shape),
                    properties=props,
                    size=self.shape,
                ),
            )
            for offsets, piece in self.pieces.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(offsets), piece.shape)
            for offsets, piece in self.pieces.items()
        ]


def lookup(flat: dict, index: MetadataIndex) -> Any:
    """DCP's find_state_dict_object, which also finds a HostShards' piece."""
    obj = flat.get(index.fqn)
    if isinstance(obj, HostShards):
        return obj.piece(index)
    return find_state_dict_object(flat, index)


class HostShardsSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (its deduplication over ranks included) for trees that hold
    HostShards."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return lookup(self.state_dict, index)


class HostShardsLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for targets that hold HostShards: each piece is filled in place
    from the chunks that overlap it. DCP's set-up replaces every leaf it does not know (a
    HostShards) with None, in the caller's tree: it sees a copy with a stand-in tensor there, and
    the HostShards go back into its flat view after."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        flat, _ = flatten_state_dict(state_dict)
        shards = {k: v for k, v in flat.items() if isinstance(v, HostShards)}
        super().set_up_planner(_stand_ins(state_dict), metadata, is_coordinator)
        self.state_dict.update(shards)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return lookup(self.state_dict, index)


def _stand_ins(tree):
    """`tree` with every HostShards replaced by an empty tensor (new dicts; leaves shared)."""
    if isinstance(tree, HostShards):
        return torch.empty(0)
    if isinstance(tree, dict):
        return {k: _stand_ins(v) for k, v in tree.items()}
    return tree


# --- XLA: which shards this host's chips hold -----------------------------------------------------


def is_sharded(t: torch.Tensor) -> bool:
    """An XLA tensor with a sharding other than replicated."""
    if t.device.type != "xla":
        return False
    from codex.train.xla.sharding import sharding_of

    spec = sharding_of(t)
    return bool(spec) and spec != "{replicated}"


def _local_indices(t: torch.Tensor) -> list[tuple[slice, ...] | None]:
    """Per addressable chip, in the runtime's order, the slices of `t` it holds (None: whole)."""
    import torch_xla

    places = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    return [None if index is Ellipsis else tuple(index) for _replica, index in places]


def _offsets(index: tuple[slice, ...]) -> Offsets:
    return tuple(int(s.start) for s in index)


def host_shards(t: torch.Tensor) -> HostShards:
    """This host's distinct shards of the sharded XLA tensor `t`, copied to the CPU (each chip's
    piece without the padding of an uneven split)."""
    import torch_xla

    torch_xla._XLAC._xla_sync_multi([t], devices=[], wait=True)  # t's pending work, if any
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    pieces: dict[Offsets, torch.Tensor] = {}
    for (data, _device), index in zip(shards, _local_indices(t), strict=True):
        if index is None:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} is sharded but held whole")
        offsets = _offsets(index)
        if offsets not in pieces:
            pieces[offsets] = data[tuple(slice(0, s.stop - s.start) for s in index)].clone()
    return HostShards(t.shape, t.dtype, pieces)


def host_targets(like: torch.Tensor, dtype: torch.dtype) -> HostShards:
    """Empty CPU pieces of `dtype` where the sharded XLA tensor `like` has this host's shards: what
    DCP loads a checkpointed tensor of like's shape into."""
    pieces: dict[Offsets, torch.Tensor] = {}
    for index in _local_indices(like):
        assert index is not None
        pieces.setdefault(
            _offsets(index), torch.empty([s.stop - s.start for s in index], dtype=dtype)
        )
    return HostShards(like.shape, dtype, pieces, like)


def _padded_shape(t: torch.Tensor) -> list[int]:
    """The shape every chip's buffer of `t` has: each sharded dim divided by its tile count,
    rounded up (an uneven split pads the last shard)."""
    from codex.train.xla.sharding import sharding_of

    m = re.search(r"devices=\[([\d,]+)\]", sharding_of(t))
    if m is None:
        return list(t.shape)
    tiles = [int(n) for n in m.group(1).split(",")][: t.dim()]
    return [math.ceil(size / n) for size, n in zip(t.shape, tiles, strict=True)]


def to_device(target: HostShards) -> torch.Tensor:
    """A new XLA tensor with the sharding of target.like, each local chip sent only its piece."""
    import torch_xla

    like = target.like
    padded = _padded_shape(like)
    per_chip = []
    for index in _local_indices(like):
        assert index is not None
        piece = target.pieces[_offsets(index)]
        if list(piece.shape) != padded:
            full = torch.zeros(padded, dtype=piece.dtype)
            full[tuple(slice(0, n) for n in piece.shape)] = piece
            piece = full
        per_chip.append(piece)
    sharding = torch_xla._XLAC._get_xla_op_sharding(like)
    return torch_xla._XLAC._global_tensor_from_cpu_shards(per_chip, sharding, list(like.shape))


@torch.no_grad()
def place(param: torch.Tensor, target: HostShards) -> None:
    """Swap the loaded pieces into `param` (its sharding kept; the object, which the optimizer
    refers to, too)."""
    param.data = to_device(target).to(param.dtype)


def layer(shards: HostShards, i: int) -> HostShards:
    """Layer i of a stacked [n_layer, ...] tensor's pieces: each piece's slice i (a view, so a
    load into it fills the stacked piece), at the piece's offsets without the layer dim."""
    pieces: dict[Offsets, torch.Tensor] = {}
    for offsets, piece in shards.pieces.items():
        if offsets[0] != 0 or piece.shape[0] != shards.shape[0]:
            raise ValueError(f"a stacked tensor of shape {tuple(shards.shape)} split by layer")
        pieces[offsets[1:]] = piece[i]
    return HostShards(shards.shape[1:], shards.dtype, pieces)
