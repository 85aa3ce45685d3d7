"""One checkpoint folder through torch.distributed.checkpoint (DCP), local or gs://.

    records = write_tree(folder, tree, control)   # every rank, collective: its own tensors
    read_tensors(folder, targets, control)        # every rank, collective: into `targets`,
                                                  #   resharded

A state tree is a nested dict. Its tensor leaves go to DCP: every rank writes the tensors it
holds (its shards of a DTensor; a replicated tensor is written once, by one of the ranks that
hold it) to its own files `__RANK_N.distcp`, and rank 0 writes DCP's index `.metadata`. DCP reads
any tensor back into any layout: a DTensor target gets the slice it holds, a plain one the whole.

What is not a tensor stays out of DCP (whose non-tensor values are pickles): `skeleton(tree)`
is the tree with every tensor replaced by {"__tensor__": shape, "dtype": name}, plain JSON, from
which `targets_from_skeleton` makes the empty tensors a one-process reader loads into.

Every file is hashed while it is written (`HashingFileSystem`): write_tree returns this rank's
{file: {"bytes", "sha256"}}, so damage found later (a truncated or overwritten file) is told
apart from a read error without trusting DCP to notice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import threading
import warnings
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from codex import fsio

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
            self.errors.append(OSError(e.errno, e.strerror or str(e), e.filename or self.path))
            raise

    def __getattr__(self, name):  # tell, flush, close, fileno (fsync): the underlying file's
        return getattr(self.f, name)


class HashingFileSystem(FileSystem):
    """DCP's fsspec file system, opened through codex.fsio (emulator and gs:// options), recording
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
        with super().create_stream(path, mode) as stream:
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
# FsspecWriter/Reader would make a second, differently configured gcsfs client first).


def _writer(folder: str) -> FileSystemWriter:
    # fsync locally; on gs:// an object exists only once it is complete (there is nothing to sync).
    writer = FileSystemWriter(folder, sync_files=not fsio.is_remote(folder))
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
        if isinstance(v, torch.Tensor):
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
    global shape), tuples become lists."""
    if isinstance(tree, torch.Tensor):
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
    fsio.makedirs(folder)
    writer = _writer(folder)
    fs = cast(HashingFileSystem, writer.fs)
    try:
        dcp.save(
            tensors_only(tree),
            storage_writer=writer,
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
    if isinstance(exc, OSError):
        return OSError(exc.errno, exc.strerror or str(exc), exc.filename or folder)
    return RuntimeError(f"{folder}: rank {rank} could not write the checkpoint ({exc!r})")


def staged(tree: dict) -> dict:
    """`tree` with every tensor replaced by a copy taken now: what a background save writes while
    training changes the originals. CPU tensors (DTensors too) are cloned in one pass; device
    tensors are copied to host memory through DCP's stager, uncached: fresh, unpinned memory
    every save (DTensors stay DTensors)."""
    on_device: list[tuple[dict, str, torch.Tensor]] = []

    def copy(t: dict) -> dict:
        out: dict = {}
        for k, v in t.items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                on_device.append((out, k, v))
            elif isinstance(v, torch.Tensor):
                out[k] = v.detach().clone()
            else:
                out[k] = copy(v) if isinstance(v, dict) else v
        return out

    out = copy(tree)
    if on_device:
        copies = BlockingAsyncStager().stage({str(i): v for i, (_, _, v) in enumerate(on_device)})
        for i, (parent, k, _) in enumerate(on_device):
            parent[k] = copies[str(i)]
    return out


def read_tensors(folder: str, targets: dict, control=None) -> None:
    """Load the DCP checkpoint in `folder` into the tensors of `targets`, in place (DTensor
    targets get their own slices). control None: this process alone (eval, sample, export)."""
    one = control is None or control.world == 1
    reader = _reader(folder)
    # Every rank checks the index itself first: inside dcp.load a refusal would come back wrapped
    # in a CheckpointException (a traceback, not the one line naming the file).
    reader.read_metadata()
    dcp.load(
        tensors_only(targets),
        storage_reader=reader,
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
