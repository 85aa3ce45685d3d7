"""One checkpoint folder through torch.distributed.checkpoint (DCP), local or gs://.

    records = write_tree(folder, tree, control)   # every rank, collective: its own tensors
    read_tensors(folder, targets, control)        # every rank, collective: into `targets`,
                                                  #   resharded
    new = staged(tree, cache, control)            # every rank, collective: copy its share now
    records = write_staged(folder, plan, views, control)   # the writer process: write that copy

Tensors go to DCP, the rest to JSON (`skeleton`); every file is hashed as it is written. How a
folder's files are written, read back and staged: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import pickle
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from codex.core import fsio, store
from codex.train.checkpoint.streams import StreamsWriter
from codex.train.checkpoint.xla_shards import (
    HostShards,
    HostShardsLoadPlanner,
    HostShardsSavePlanner,
    lookup,
)

TENSOR = "__tensor__"

# DCP warns on every one-process save and load that it assumes one process: here that is the design.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


class _HashingStream:
    """A write stream that hashes and counts what passes through (DCP writes sequentially). A
    failed write is kept in `errors` with the file's path: torch.save under DCP turns it into a
    RuntimeError without errno or path, and DCP wraps that in turn."""

    def __init__(self, f, path: str = "", errors: list[OSError] | None = None):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0
        self.path, self.errors = path, errors if errors is not None else []

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += memoryview(b).nbytes
        try:
            return self.f.write(b)
        except OSError as e:
            # an object store's error already names the object (codex/core/store.py)
            kept = e if isinstance(e, store.StoreError) else None
            self.errors.append(
                kept or OSError(e.errno, e.strerror or str(e), e.filename or self.path)
            )
            raise

    def __getattr__(self, name):  # tell, flush, close, fileno (fsync): the underlying file's
        return getattr(self.f, name)


class _KeepOpen:
    """A staged object's file as DCP's writer sees it: DCP closes the streams it writes, but the
    staged bytes must stay readable until their upload at the end of the block."""

    def __init__(self, f):
        self.f = f

    def close(self) -> None:
        self.f.flush()

    def __getattr__(self, name):
        return getattr(self.f, name)


@contextlib.contextmanager
def _staged(path: str):
    with fsio.atomic_open(path, "wb") as f:
        yield _KeepOpen(f)


class HashingFileSystem(FileSystem):
    """DCP's fsspec file system, opened through codex.core.fsio (emulator and gs:// options),
    recording
    the size and sha256 of every file written."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict] = {}
        self.errors: list[OSError] = []  # failed writes, with their paths (_HashingStream)
        self._lock = threading.Lock()

    def init_path(self, path, **kwargs):
        self.fs, local = fsio.filesystem(str(path))
        return str(path) if fsio.is_remote(str(path)) else local

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and fsio.is_remote(str(path)):
            # Staged whole (memory, then a temp file) and uploaded by fsio.put_object: an upload
            # the store loses mid-flight starts over from the staged bytes (a stream could not).
            opened = _staged(str(path))
        else:
            opened = super().create_stream(path, mode)
        with opened as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream, str(path), self.errors)
            yield hashing
        with self._lock:
            self.records[os.path.basename(str(path))] = {
                "bytes": hashing.n,
                "sha256": hashing.sha.hexdigest(),
            }

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:  # DCP writes .metadata.tmp, then renames it
            old = self.records.pop(os.path.basename(str(path)), None)
            if old is not None:
                self.records[os.path.basename(str(new_path))] = old


# DCP's writer and reader with their file system swapped for HashingFileSystem (DCP's own
# FsspecWriter/Reader would make a second, differently configured gcsfs client first); the writer
# writes a rank's share in several streams (streams.py).


def _writer(folder: str) -> FileSystemWriter:
    # fsync locally; on gs:// an object exists only once it is complete (there is nothing to sync).
    writer = StreamsWriter(folder, sync_files=not fsio.is_remote(folder))
    fs = HashingFileSystem()
    # torch annotates .fs as its local FileSystem; the writer takes any FileSystemBase.
    writer.fs = fs  # type: ignore[assignment]
    writer.path = fs.init_path(folder)
    return writer


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata index and nothing else: a pickle may name any function to call,
    so a forged .metadata could run code on load. Only DCP's metadata classes, torch.Size, dtypes
    and the layout lookup DCP's own pickles name are allowed."""

    _CLASSES_FROM = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
    )
    _NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._NAMES:
            return super().find_class(module, name)
        if "." in name:  # protocol 4 walks a dotted name through attributes: io.FileIO, ...Popen
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP's index never does")
        if module in self._CLASSES_FROM or module == "torch":  # importing these runs nothing new
            found = super().find_class(module, name)
            if isinstance(found, torch.dtype if module == "torch" else type):
                return found
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP's index never does")


class _SafeReader(FileSystemReader):
    """DCP's reader with .metadata read by _MetadataUnpickler: loading a checkpoint runs no code
    that came with it."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            try:
                metadata = _MetadataUnpickler(fh).load()
            except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as e:
                raise ValueError(
                    f"{path}: not a DCP index codex can trust ({e}); refusing to load this "
                    "checkpoint (damaged, or not written by codex)"
                ) from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not a DCP index ({type(metadata).__name__})")
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


def _reader(folder: str) -> FileSystemReader:
    reader = _SafeReader(folder)
    fs = HashingFileSystem()
    # torch annotates .fs as its local FileSystem; the reader takes any FileSystemBase.
    reader.fs = fs  # type: ignore[assignment]
    reader.path = fs.init_path(folder)
    return reader


def tensors_only(tree: dict) -> dict:
    """The tensor leaves of `tree`, nested as in it (subtrees without tensors dropped)."""
    out: dict = {}
    for k, v in tree.items():
        if isinstance(v, (torch.Tensor, HostShards)):
            out[k] = v
        elif isinstance(v, dict):
            sub = tensors_only(v)
            if sub:
                out[k] = sub
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            raise TypeError(f"checkpoint state key {k!r}: tensors must sit in dicts, not lists")
    return out


def skeleton(tree):
    """`tree` as JSON: each tensor becomes {"__tensor__": shape, "dtype": name} (a DTensor its
    global shape, a HostShards too), tuples become lists."""
    if isinstance(tree, (torch.Tensor, HostShards)):
        return {TENSOR: list(tree.shape), "dtype": str(tree.dtype).removeprefix("torch.")}
    if isinstance(tree, dict):
        return {str(k): skeleton(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [skeleton(v) for v in tree]
    return tree


def is_tensor_leaf(v) -> bool:
    return isinstance(v, dict) and TENSOR in v


def empty_like_leaf(leaf: dict, device="cpu") -> torch.Tensor:
    return torch.empty(leaf[TENSOR], dtype=getattr(torch, leaf["dtype"]), device=device)


def targets_from_skeleton(tree):
    """The skeleton with every tensor leaf made an empty CPU tensor of its shape and dtype."""
    if is_tensor_leaf(tree):
        return empty_like_leaf(tree)
    if isinstance(tree, dict):
        return {k: targets_from_skeleton(v) for k, v in tree.items()}
    return tree


def merge(base, extra):
    """`base` with the keys of `extra` added, recursively (rank 0's tree + other ranks' own
    keys)."""
    if not (isinstance(base, dict) and isinstance(extra, dict)):
        return base
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if k in out else v
    return out


def write_tree(folder: str, tree: dict, control) -> dict[str, dict]:
    """Write the tensors of `tree` as one DCP checkpoint in `folder`: every rank of `control` (its
    group, rank, world) calls this with its own tree. Returns this rank's {file: {bytes,
    sha256}}."""
    return _dcp_save(folder, tensors_only(tree), None, control)


def _dcp_save(folder: str, state_dict: dict, planner, control) -> dict[str, dict]:
    fsio.makedirs(folder)
    writer = _writer(folder)
    fs = cast(HashingFileSystem, writer.fs)
    try:
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=planner or HostShardsSavePlanner(),
            process_group=control.group,
            no_dist=control.world == 1,
        )
    except CheckpointException as e:  # a BaseException: one line (a full disk named), not a trace
        raise _save_error(e, fs.errors, folder) from None
    return dict(fs.records)


def _save_error(e: CheckpointException, errors: list[OSError], folder: str) -> Exception:
    """The error a failed DCP save stands for: this rank's failed write (with its path), else
    the first rank's exception (an OSError given the folder as its path)."""
    if errors:
        return errors[0]
    rank = min(e.failures)
    exc = e.failures[rank][0]
    if isinstance(exc, store.StoreError):  # names its store and object already
        return exc
    if isinstance(exc, OSError):
        return OSError(exc.errno, exc.strerror or str(exc), exc.filename or folder)
    return RuntimeError(f"{folder}: rank {rank} could not write the checkpoint ({exc!r})")


_ALIGN = 64  # bytes: every staged tensor starts aligned for any dtype's loads


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """A write item's name across planning steps (DCP rewrites the index hint, not the offset)."""
    return index.fqn, tuple(index.offset or ())


@dataclass(frozen=True)
class Slot:
    """Where one write item's bytes sit in the staging buffer."""

    key: tuple[str, tuple[int, ...]]  # _key of its write item
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the buffer


@dataclass(frozen=True)
class StagedPlan:
    """What a writer process needs to write one rank's share: the rank's DCP plan, already
    deduplicated over the ranks, and where each item sits in the staging buffer. Picklable: sent
    to the writer with each new buffer."""

    plan: SavePlan
    slots: tuple[Slot, ...]
    nbytes: int


def _layout_key(flat: dict[str, Any]) -> tuple:
    """What this rank's DCP plan depends on, read from the flat {fqn: tensor} in microseconds a
    tensor (DCP's planning takes ~0.1 s for a 350m state): every name, shape, dtype and device,
    a DTensor's mesh and placements, a HostShards' pieces."""

    def where(t) -> tuple:
        if isinstance(t, HostShards):
            return ("host shards", tuple((o, tuple(p.shape)) for o, p in t.pieces.items()))
        if isinstance(t, DTensor):
            return (t.device.type, t.device_mesh, tuple(t.placements))
        return (t.device.type,)

    return tuple((fqn, tuple(t.shape), t.dtype, where(t)) for fqn, t in flat.items())


def _slots(plan: SavePlan) -> tuple[tuple[Slot, ...], int]:
    slots, start = [], 0
    for item in plan.items:
        if item.tensor_data is None or item.tensor_data.chunk is None:
            raise TypeError(f"checkpoint state key {item.index.fqn!r}: only tensors are staged")
        dtype, shape = item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes)
        slots.append(Slot(_key(item.index), dtype, shape, start))
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(slots), start


class StagingBuffer:
    """One anonymous shared-memory file (memfd: no file left behind whatever happens, and not
    limited by the size of /dev/shm) mapped into this process; the writer process maps the same
    pages through its `fd`. Pinned (cudaHostRegister) when it receives GPU tensors, so their
    copies are DMA transfers that need not block the host."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("codex-checkpoint-staging")
        else:  # not Linux: an unlinked temporary file
            with tempfile.TemporaryFile() as f:
                self.fd = os.dup(f.fileno())
        os.ftruncate(self.fd, max(nbytes, 1))
        self.map = mmap.mmap(self.fd, max(nbytes, 1))
        self.pinned = False
        if pin:
            ptr = torch.frombuffer(self.map, dtype=torch.uint8).data_ptr()
            pin_memory, unpin_memory = _host_pinning()
            pin_memory(ptr, max(nbytes, 1))
            self.pinned = True
            # not at exit: CUDA may be gone by then (the process's memory goes anyway)
            weakref.finalize(self, unpin_memory, ptr).atexit = False
        weakref.finalize(self, os.close, self.fd)


def _host_pinning() -> tuple[Callable[[int, int], None], Callable[[int], None]]:
    """(pin, unpin) of host memory by address: torch's private torch.cuda._pin_memory_utils where
    this torch has it (2.8 and later), else the same two CUDA runtime calls it makes."""
    try:
        from torch.cuda import _pin_memory_utils
    except ImportError:

        def pin(ptr: int, size: int) -> None:
            code = torch.cuda.cudart().cudaHostRegister(ptr, size, 1)
            if code != 0:
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")

        def unpin(ptr: int) -> None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

        return pin, unpin
    return _pin_memory_utils.pin_memory, _pin_memory_utils.unpin_memory


def buffer_views(buffer: mmap.mmap, slots: tuple[Slot, ...]) -> list[torch.Tensor]:
    """A tensor per slot over `buffer`, each with its own storage of exactly its bytes: DCP's
    writer clones a tensor whose storage is larger than itself, and torch.save would write the
    whole storage."""
    views = []
    for slot in slots:
        numel = torch.Size(slot.shape).numel()
        if numel == 0:  # an empty shard: frombuffer refuses a zero count
            views.append(torch.empty(slot.shape, dtype=slot.dtype))
            continue
        flat = torch.frombuffer(buffer, dtype=slot.dtype, count=numel, offset=slot.start)
        views.append(flat.view(slot.shape))
    return views


@dataclass
class StagingCache:
    """What staging keeps from one save to the next: this rank's deduplicated plan (`key`: the
    layout of the state it was made for, _layout_key), the buffer, and the tensors over it."""

    key: tuple | None = None
    plan: StagedPlan | None = None
    buffer: StagingBuffer | None = None
    views: list[torch.Tensor] = field(default_factory=list)


def staged(tree: dict, cache: StagingCache, control) -> bool:
    """Copy, now, the tensors of `tree` this rank will write into the cache's buffer: what a
    background save writes while training changes the originals. Every rank of `control` calls it
    together. The plan, and with it the buffer, is made on the first call and again only when the
    tensors' layout changes on some rank (one flag all-reduced tells); later calls only copy.
    Returns True when the buffer is new: the writer process must map it (cache.buffer.fd,
    cache.plan).

    Only what this rank writes is staged: its DTensor shards, and of the tensors every rank holds
    whole (replicate) the ones DCP's deduplication (dedup_save_plans, as dcp.save runs it) gives
    this rank."""
    flat, _ = flatten_state_dict(tensors_only(tree))  # DCP's names: "model.blocks.0.attn..."
    key = _layout_key(flat)
    new = control.any_flag(key != cache.key)
    if new:
        # dcp.save's own plan for this rank (its default planner, as write_tree uses), before and
        # after deduplication over every rank's
        planner = HostShardsSavePlanner()
        planner.set_up_planner(tensors_only(tree), is_coordinator=control.rank == 0)
        mine = dedup_save_plans(control.gather(planner.create_local_plan()))[control.rank]
        slots, nbytes = _slots(mine)
        sources = [lookup(flat, item.index) for item in mine.items]
        # the old buffer goes before the new one is made: two would need twice the memory
        cache.views, cache.buffer = [], None
        cache.buffer = StagingBuffer(nbytes, pin=any(t.is_cuda for t in sources))
        cache.views = buffer_views(cache.buffer.map, slots)
        cache.plan, cache.key = StagedPlan(mine, slots, nbytes), key
    else:
        assert cache.plan is not None
        sources = [lookup(flat, item.index) for item in cache.plan.plan.items]
    assert cache.buffer is not None
    with torch.no_grad():
        for slot, view, source in zip(cache.plan.slots, cache.views, sources, strict=True):
            if tuple(source.shape) != slot.shape:
                raise ValueError(
                    f"checkpoint state key {slot.key[0]!r}: this rank holds {tuple(source.shape)}, "
                    f"its plan says {slot.shape}"
                )
            view.copy_(source, non_blocking=cache.buffer.pinned and source.is_cuda)
        if any(t.is_cuda for t in sources):
            torch.cuda.synchronize()  # the buffer is complete before the writer reads it
    return new


class _StagedPlanner(HostShardsSavePlanner):
    """DCP's default planner with this rank's plan given (already deduplicated: planning again
    changes nothing) and its data taken from the staged tensors."""

    def __init__(self, plan: SavePlan, data: dict) -> None:
        super().__init__()
        self._given, self._data = plan, data

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator
        self.mappings = self._given.planner_data

    def create_local_plan(self) -> SavePlan:
        self.plan = self._given
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._data[_key(index)]


def write_staged(folder: str, plan: StagedPlan, views: list[torch.Tensor], control) -> dict:
    """write_tree for a staged share (in the writer process, every rank of `control` together):
    the same .metadata and files. Returns this rank's {file: {bytes, sha256}}."""
    data = {slot.key: view for slot, view in zip(plan.slots, views, strict=True)}
    return _dcp_save(folder, {}, _StagedPlanner(plan.plan, data), control)


def read_tensors(folder: str, targets: dict, control=None) -> None:
    """Load the DCP checkpoint in `folder` into the tensors of `targets`, in place (DTensor
    targets get their own slices, HostShards their host's pieces). control None: this process
    alone (eval, sample, export)."""
    one = control is None or control.world == 1
    reader = _reader(folder)
    # Every rank checks the index itself first: inside dcp.load a refusal would come back wrapped
    # in a CheckpointException (a traceback, not the one line naming the file).
    reader.read_metadata()
    dcp.load(
        tensors_only(targets),
        storage_reader=reader,
        planner=HostShardsLoadPlanner(),
        process_group=None if one else control.group,
        no_dist=one,
    )


def fill(tree, loaded):
    """The skeleton `tree` with its tensor leaves taken from `loaded` (same nesting)."""
    if is_tensor_leaf(tree):
        return loaded
    if isinstance(tree, dict):
        return {
            k: fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in tree.items()
        }
    return tree
