"""The Backend protocol: everything the training loop and eval need from a device, and its
CPU/CUDA implementation, TorchBackend (one process, or one per device under torchrun: gloo on the
CPU, NCCL on CUDA). TPUs: train/xla/backend.py.

    backend.set_grad_sync(model, last)  # before each micro-batch: reduce in the last backward only
    backend.all_reduce_grads(model)     # THE gradient all-reduce, once per optimizer step
    backend.step_boundary()             # XLA: cut the graph; CPU/CUDA: nothing

Why not DDP, the launch and the failure handling: docs/training.md and docs/cuda.md.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from codex.core.config import ConfigError
from codex.model.gpt import GPT, build_model
from codex.train.distributed.control import ControlPlane, control_timeout
from codex.train.distributed.fsdp import build_sharded, compile_head, set_grad_sync
from codex.train.distributed.process_env import (
    allocator_env,
    die_with_launcher,
    set_process_group_env,
)
from codex.train.distributed.reduce import GradReducer
from codex.train.plan.layout import Layout
from codex.train.plan.memory import compute_dtype
from codex.train.plan.world import launch_env

resource: ModuleType | None
try:
    import resource
except ImportError:  # pragma: no cover - Windows has no resource module
    resource = None

log = logging.getLogger("codex.train")


class BackendError(ConfigError):
    """The requested hardware does not match what this machine / launch provides. A ConfigError,
    so the CLI reports it in one line and exits 2."""


class Backend(Protocol):
    """What train/loop.py and eval/ use. TorchBackend (CPU/CUDA) and train/xla/backend.py implement
    it."""

    kind: str  # the hardware preset's kind: "cpu", "cuda" or "tpu"
    device: torch.device
    rank: int  # global rank of this process (0 .. world_size-1 on CPU/CUDA)
    world_size: int  # data-parallel replicas = devices (batch arithmetic, MFU)
    local_rank: int
    autocast_dtype: torch.dtype | None  # bf16 on CUDA/TPU by default, None = fp32
    control: ControlPlane  # host-side gloo group: barrier, stop flag (train/distributed/control.py)

    # How data is loaded: one process per device on CPU/CUDA (loader_rank/world = rank/world_size,
    # devices_per_loader 1); under XLA SPMD one process per host feeds all its chips.
    # loader_rank, loader_world and pinned_copy_device are read-only properties here: TorchBackend
    # derives them, XLABackend stores them (dataclass fields); either satisfies the protocol.
    devices_per_loader: int  # devices one process's batch is split over
    # A loss on this process is already the mean over every replica (SPMD).
    global_values: bool
    # Validation needs full, masked batches of one shape (XLA compiles per shape).
    fixed_shapes: bool
    # A log step reads the previous log step's values instead of its own, so it never waits for
    # the device (XLA: the host keeps running ahead; train/loop.py: _log_train).
    lagged_logs: bool

    @property
    def loader_rank(self) -> int: ...  # this process among the processes that load data
    @property
    def loader_world(self) -> int: ...
    @property
    def pinned_copy_device(self) -> torch.device | None: ...  # the loader's pinned copies go here
    @property
    def is_main(self) -> bool: ...
    def autocast(self) -> contextlib.AbstractContextManager: ...
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module: ...
    # Training's model, in `layout`.
    def build_model(self, model_cfg, seed: int, layout) -> torch.nn.Module: ...
    # Before each micro-batch's backward: whether it reduces (the step's last one only).
    def set_grad_sync(self, model: torch.nn.Module, on: bool) -> None: ...
    # XLA: the step's micro-batches as one While; None: the loop's Python micro-batch loop.
    def device_accumulation(self, model: torch.nn.Module, accum: int) -> Callable | None: ...
    # XLA: clip + optimizer.step traced once, called with the lr; None: the loop calls the two.
    def cached_update(
        self, model: torch.nn.Module, optimizer, max_norm: float
    ) -> Callable | None: ...
    def to_device(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    def all_reduce_grads(self, model: torch.nn.Module) -> None: ...
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def any_flag(self, flag: bool) -> bool: ...  # True on every rank if any rank's flag is set
    def step_boundary(self) -> None: ...
    # Every rank, once, after its first optimizer step: collectives get the shorter timeout.
    def first_step_done(self) -> None: ...
    def synchronize(self) -> None: ...
    def barrier(self) -> None: ...
    def memory_stats(self) -> dict[str, float]: ...
    def compile_count(self) -> int | None: ...
    def close(self, ok: bool = True) -> None: ...  # ok False: a rank failed, no clean-exit barrier


def loader_layout(backend: Backend, device_batch: int) -> tuple[int, int, int]:
    """(rank, world, rows) for this process's train/val loader: the global batch of
    device_batch * world_size rows is split over `world` loaders of `rows` rows each."""
    return backend.loader_rank, backend.loader_world, device_batch * backend.devices_per_loader


def replica_mean(backend: Backend, tensor: torch.Tensor) -> torch.Tensor:
    """The mean of a per-replica value (e.g. a loss) over all replicas, on every rank."""
    if backend.global_values:
        return tensor
    return backend.all_reduce_sum(tensor.clone()) / backend.world_size


def autocast_context(
    device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """bf16 matmuls under autocast (parameters stay fp32, the master weights); None = plain fp32."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile's wrapper (its state_dict keys have no '_orig_mod.')."""
    return getattr(model, "_orig_mod", model)


@dataclass
class TorchBackend:
    """CPU or CUDA, one process or several under torchrun (gloo / NCCL)."""

    kind: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    autocast_dtype: torch.dtype | None = None
    compile: bool = False
    bucket_bytes: int = 64 << 20  # gradient all-reduce bucket size (fewer, larger collectives)
    # train.reduce_dtype: the replicated all-reduce's buffers (and FSDP2's reduce_dtype)
    reduce_dtype: torch.dtype = torch.float32
    distributed: bool = False
    step_timeout_s: float = 300.0  # train.dist_timeout_s: collectives after the first step
    # host-side gloo (train/distributed/control.py)
    control: ControlPlane = field(default_factory=ControlPlane)
    devices_per_loader: int = 1
    global_values: bool = False
    fixed_shapes: bool = False
    lagged_logs: bool = False
    layout: Layout = field(default_factory=Layout)  # set by build_model (train/distributed/fsdp.py)
    _compiled: list = field(default_factory=list)
    # replicate over several ranks: the bucketed all-reduce and its hooks
    # (train/distributed/reduce.py)
    _reducer: GradReducer | None = field(default=None, repr=False)

    @property
    def loader_rank(self) -> int:
        return self.rank

    @property
    def loader_world(self) -> int:
        return self.world_size

    @property
    def pinned_copy_device(self) -> torch.device | None:
        return self.device if self.kind == "cuda" else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """bf16 autocast (replicate), or a null context under fsdp: there FSDP2's mixed-precision
        policy already gathers bf16 weights and casts each block's inputs
        (train/distributed/fsdp.py),
        so autocast would only cast again (torchtitan's maybe_enable_amp does the same)."""
        if self.layout.sharded:
            return contextlib.nullcontext()
        return autocast_context(self.device.type, self.autocast_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Parameters stay fp32 (the master weights); autocast runs the matmuls in bf16.
        model = model.to(self.device)
        if self.compile and self.world_size > 1:
            # Each block's forward and the head compiled apart, as under fsdp: a whole-model
            # compile's backward is one graph that hands out every gradient at its end, so the
            # reduction's buckets (train/distributed/reduce.py) could only start once it is over.
            for block in cast(GPT, model).blocks:
                block.forward = torch.compile(block.forward, fullgraph=True)  # type: ignore[method-assign]
            compile_head(cast(GPT, model))
        elif self.compile:
            # an OptimizedModule; fullgraph: a graph break fails at once instead of running part
            # of the step eagerly
            model = cast(torch.nn.Module, torch.compile(model, fullgraph=True))
            self._compiled.append(model)
        return model

    def build_model(self, model_cfg, seed: int, layout: Layout) -> torch.nn.Module:
        """build_model(model_cfg, seed)'s weights: replicated on this device, or sharded (fsdp:
        built on the meta device and materialised already sharded, train/distributed/fsdp.py)."""
        self.layout = layout
        if not layout.sharded:
            # same seed on every rank: identical weights
            return self.prepare_model(build_model(model_cfg, seed=seed))
        return build_sharded(
            model_cfg,
            seed,
            layout,
            self.device,
            self.autocast_dtype,
            self.compile,
            reduce_dtype=self.reduce_dtype,
        )

    def set_grad_sync(self, model: torch.nn.Module, on: bool) -> None:
        """Before each micro-batch: reduce gradients in this backward only when `on` (the step's
        last micro-batch), so a step has one gradient reduction. fsdp: FSDP2 reduce-scatters.
        replicate over several ranks: the reducer's hooks issue each bucket's all-reduce as its
        gradients become ready (made, with its buckets, at the first call); all_reduce_grads
        finishes it."""
        if self.layout.sharded:
            set_grad_sync(model, on)
        elif self.world_size > 1:
            self._reducer_for(model).arm(on)

    def device_accumulation(self, model: torch.nn.Module, accum: int) -> None:
        # eager and compiled torch: the loop's Python micro-batch loop costs no tracing
        return None

    def cached_update(self, model: torch.nn.Module, optimizer, max_norm: float) -> None:
        return None  # likewise: the optimizer's Python is not traced

    def to_device(self, batch):
        non_blocking = self.device.type == "cuda"
        return tuple(t.to(self.device, non_blocking=non_blocking) for t in batch)

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """THE gradient all-reduce: average .grad over the replicas. Call once per optimizer step,
        after the last micro-batch's backward and before clipping. replicate: that backward has
        already issued the buckets whose gradients were ready (async, overlapping the rest of the
        backward; set_grad_sync armed it); this issues any it did not, waits for every one and
        writes the mean back into .grad, in fp32 or via bf16 (train.reduce_dtype;
        train/distributed/reduce.py). fsdp: nothing to do, the last micro-batch's backward already
        reduce-scattered every gradient (set_grad_sync)."""
        if self.world_size == 1 or self.layout.sharded:
            return
        self._reducer_for(model).finish()

    def _reducer_for(self, model: torch.nn.Module) -> GradReducer:
        """The reducer of `model` (its plain module, under torch.compile's wrapper): made at the
        first call, its buckets fixed from then on; another module replaces it."""
        module = unwrap(model)
        if self._reducer is None or self._reducer.module is not module:
            if self._reducer is not None:
                self._reducer.remove()
            dtype = None if self.reduce_dtype == torch.float32 else self.reduce_dtype
            self._reducer = GradReducer(module, self.bucket_bytes, dtype, self.world_size)
        return self._reducer

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all replicas, in place; returns it (a no-op on one process)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any_flag(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank (all ranks stop at the same step).
        Runs on the host through the control plane's gloo group, so on CUDA it does not wait for
        the GPU."""
        return self.control.any_flag(flag)

    def step_boundary(self) -> None:
        pass  # eager CPU/CUDA: nothing to cut; XLA cuts the graph here

    def first_step_done(self) -> None:
        """torchtitan's set_pg_timeouts: start-up (checkpoint load, torch.compile, the first
        step) ran under train.dist_init_timeout_s; from here every process group but the control
        plane's (which waits for checkpoint writes) times out after train.dist_timeout_s, so a hung
        peer ends the job in minutes, not half an hour. Every rank calls it at the same step; the
        barrier first, so no rank waits under the short timeout for a peer still in its first
        step."""
        if not (self.distributed and dist.is_initialized()):
            return
        self.control.barrier()
        self.synchronize()
        from torch.distributed import distributed_c10d as c10d

        timeout = datetime.timedelta(seconds=self.step_timeout_s)
        keep = self.control.groups()
        for group in list(c10d._world.pg_map):
            if all(group is not g for g in keep) and not c10d._rank_not_in_group(group):
                c10d._set_pg_timeout(timeout, group)
        if self.is_main:
            log.info(
                "collectives now time out after %g s (train.dist_timeout_s)", self.step_timeout_s
            )

    def synchronize(self) -> None:
        """Block until the device has finished all queued work (timing must come after this)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.control.barrier()  # host-side (gloo), with the control plane's timeout

    def memory_stats(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {
                "mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9,
                "mem_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 1e9,
            }
        if resource is None:  # pragma: no cover - Windows
            return {}
        # the process's peak resident memory; ru_maxrss is in KiB on Linux
        return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}

    def compile_count(self) -> int | None:
        """Graphs dynamo has compiled in this process (torch.compile on), else None: a count that
        grows after the first steps is a recompile, each a stall of seconds."""
        if not self.compile:
            return None
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def close(self, ok: bool = True) -> None:
        """ok: wait for every rank, then tear down (a rank that destroys its gloo group while a peer
        is still connected can abort at exit). Not ok (this rank raised): no barrier, since the
        peers may sit in a collective this rank will never join; leaving closes this rank's
        sockets, so their collectives fail at once and the job ends non-zero instead of hanging
        until a timeout."""
        if not (self.distributed and dist.is_initialized()):
            return
        if ok:
            self.control.barrier()
            dist.destroy_process_group()
            return
        with contextlib.suppress(Exception):
            if self.device.type == "cuda":
                # NCCL: abort every communicator (ncclCommAbort) so that this process exits now
                # instead of waiting for its unfinished collectives, and its peers' fail
                from torch.distributed import distributed_c10d as c10d

                c10d._abort_process_group()
            else:
                dist.destroy_process_group()  # gloo: closes the sockets now


def resolve_dtype(setting: str, device_kind: str) -> torch.dtype | None:
    """train.dtype -> autocast dtype: the compute dtype the memory plan counts
    (train/plan/memory.py: compute_dtype; auto = bf16 on accelerators, fp32 on the CPU), as torch
    names it; None = fp32, no autocast."""
    return torch.bfloat16 if compute_dtype(setting, device_kind) == "bf16" else None


def _cuda_device(preset, local_rank: int, local_world: int) -> torch.device:
    """This process's GPU, after checking the launch against the preset (exit 2 with the fix)."""
    if not torch.cuda.is_available():
        raise BackendError(
            f"hardware preset '{preset.name}' needs CUDA GPUs, "
            f"but torch {torch.__version__} found none "
            f"(torch.cuda.is_available() is False; torch.version.cuda={torch.version.cuda}). "
            "Fix: run on a GPU machine with a CUDA build of torch, or pass --hardware cpu."
        )
    found = torch.cuda.device_count()
    # One GPU per process (Slurm --gpus-per-task=1, or a launcher that sets CUDA_VISIBLE_DEVICES
    # per rank): each process sees only its own GPU, as cuda:0. Ranks given the same one fail
    # loudly in NCCL's init ("Duplicate GPU detected").
    own_gpu = found == 1 and len(visible_devices()) == 1
    if local_world != preset.devices_per_host:
        raise BackendError(
            f"hardware preset '{preset.name}' has {preset.devices_per_host} GPU(s) per host "
            f"but this launch runs {local_world} process(es) per host. "
            f"Fix: torchrun --nproc_per_node={preset.devices_per_host} "
            "-m codex.cli -- train ... (or pick the preset that matches, "
            f"e.g. --hardware {preset.family}-{local_world})."
        )
    if found < local_world and not own_gpu:
        raise BackendError(
            f"hardware preset '{preset.name}' wants {local_world} GPU(s) on this host, "
            f"found {found} "
            f"({', '.join(torch.cuda.get_device_name(i) for i in range(found)) or 'none'}). "
            f"Fix: use --hardware {preset.family}-{found}"
            + (" or" if found else "")
            + " check CUDA_VISIBLE_DEVICES (one GPU per process is fine: it must name exactly one)."
        )
    device = torch.device("cuda", 0 if own_gpu else local_rank)
    torch.cuda.set_device(device)
    # TF32 for any fp32 matmul that autocast leaves alone (e.g. under dtype=fp32).
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device


def visible_devices() -> list[str]:
    """The devices CUDA_VISIBLE_DEVICES names (indices or UUIDs); [] when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [] if value is None else [d for d in value.split(",") if d.strip()]


def make_torch_backend(cfg, preset) -> TorchBackend:
    """The backend for a CPU or CUDA preset: one process, or one per device under torchrun."""
    rank, world, local_rank, local_world = launch_env()
    launched = "WORLD_SIZE" in os.environ and world > 1
    if preset.kind == "cuda":
        os.environ.update(allocator_env(preset.kind, os.environ))  # before CUDA starts
        device, pg_backend = _cuda_device(preset, local_rank, local_world), "nccl"
    elif preset.kind == "cpu":
        device = torch.device("cpu")
        pg_backend = "gloo"
    else:
        raise BackendError(f"hardware preset '{preset.name}': unknown kind {preset.kind!r}")

    if launched:
        die_with_launcher()
        set_process_group_env(preset.kind, cfg.run, rank)
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {
                "backend": pg_backend,
                # start-up, until first_step_done shortens it to train.dist_timeout_s
                "timeout": datetime.timedelta(seconds=cfg.train.dist_init_timeout_s),
            }
            if pg_backend == "nccl":
                kwargs["device_id"] = device
            dist.init_process_group(**kwargs)
        if dist.get_world_size() != world:
            raise BackendError(
                f"process group has {dist.get_world_size()} ranks, WORLD_SIZE says {world}"
            )
    control = ControlPlane()
    if launched:
        # Its own gloo group with the control plane's timeout (the default group's is
        # train.dist_init_timeout_s until the first step is done: a first gradient all-reduce may
        # wait for a peer's torch.compile; then train.dist_timeout_s).
        control = ControlPlane(
            dist.new_group(backend="gloo", timeout=control_timeout()), rank, world
        )
    return TorchBackend(
        kind=preset.kind,
        device=device,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        autocast_dtype=resolve_dtype(cfg.train.dtype, preset.kind),
        reduce_dtype=torch.bfloat16 if cfg.train.reduce_dtype == "bf16" else torch.float32,
        compile=bool(cfg.train.compile) and preset.kind == "cuda",
        distributed=launched,
        step_timeout_s=cfg.train.dist_timeout_s,
        control=control,
    )
