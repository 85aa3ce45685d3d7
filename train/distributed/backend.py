"""The backend interface: everything the training loop needs from a device, in one small place.

    backend = make_backend(cfg)            # train/launch.py: CPU/CUDA here, TPU in train/xla/
    model = backend.prepare_model(model)   # move (and torch.compile on CUDA)
    for each optimizer step:
        for each micro-batch:
            backend.set_grad_sync(model, last)  # reduce in the step's last backward only
            x, y = backend.to_device(batch)
            with backend.autocast():
                loss = model(x, y) / accum
            loss.backward()                     # last: the gradient buckets' all-reduces start
        backend.all_reduce_grads(model)    # THE gradient all-reduce, once per step: finished here
        clip, optimizer.step()
        backend.step_boundary()            # XLA: cut the graph; CPU/CUDA: nothing

Why not DistributedDataParallel: DDP all-reduces inside every backward unless each micro-batch
but the last is wrapped in no_sync(), and hides where the communication happens. Here the one
all-reduce per optimizer step is ours (train/distributed/reduce.py, owned by TorchBackend),
overlapped
with the backward as DDP's is: set_grad_sync(model, last) arms per-parameter hooks for the step's
last micro-batch, whose backward issues each bucket's async all-reduce as soon as its gradients
are final; `all_reduce_grads` is still the one place to find, time and test it (it issues what
the backward did not, waits, and writes the result into .grad). Gradients are summed in buckets
(fp32, or bf16 under train.reduce_dtype=bf16) and divided by the world size, so the result is the
gradient of the mean loss over every token of the global batch;
tests/train/distributed/test_reduce.py counts one
reduction of every gradient element per step.

Launch: one process, or `torchrun --nproc_per_node=N -m codex.cli -- train ...` (and --nnodes for
several machines). torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; we use gloo on the CPU and NCCL
on CUDA. There is no silent fallback: a CUDA preset without CUDA, or a device count that does not
match the launch, is an error that says what was found and how to fix it. One GPU per process
(Slurm's --gpus-per-task=1: CUDA_VISIBLE_DEVICES names one device) runs on that process's cuda:0.

Failure handling, as torchtitan does it (`process_group_env`, `TorchBackend.first_step_done`,
`TorchBackend.close`): before the process group exists, the NCCL flight recorder is switched on
(dumped on a watchdog timeout, under RUN/logs/ for a local run) and GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME name the interface that reaches MASTER_ADDR, each only where the user left it
unset; collectives wait train.dist_init_timeout_s until this process's first step is done, then
train.dist_timeout_s; a rank that raises aborts its process groups instead of waiting for peers.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from codex.core import fsio
from codex.core.config import ConfigError
from codex.model.gpt import GPT, build_model
from codex.train.distributed.control import ControlPlane, control_timeout
from codex.train.distributed.fsdp import build_sharded, compile_head, set_grad_sync
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
        return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # KiB on Linux

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


# NCCL's flight recorder (torchtitan's settings): the last collectives of each rank in a ring,
# written to DUMP_FILE + rank when the watchdog sees a timeout, so a hang names the rank and the
# collective that never arrived (`python -m torch.distributed.flight_recorder.fr_trace`).
# The TORCH_NCCL_* names are the ones every torch >= 2.5 reads; newer torch prefers TORCH_FR_*.
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_ALIASES = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}
DUMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def process_group_env(kind: str, run: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables make_torch_backend sets before the process group exists, each only where
    `environ` (and its newer alias) leaves it unset: on CUDA the flight recorder (its dump under
    RUN/logs/ for a local run, else torch's /tmp default); on several hosts (MASTER_ADDR not a
    loopback address) GLOO_SOCKET_IFNAME, and on CUDA NCCL_SOCKET_IFNAME, set to the interface that
    reaches MASTER_ADDR (gloo otherwise picks the one its hostname resolves to, which on many
    clusters is not the one the nodes reach each other by)."""

    def unset(name: str) -> bool:
        alias = FLIGHT_RECORDER_ALIASES.get(name)
        return name not in environ and (alias is None or alias not in environ)

    wanted = dict(FLIGHT_RECORDER) if kind == "cuda" else {}
    if kind == "cuda" and not fsio.is_remote(run):
        wanted[DUMP_FILE] = os.path.join(os.path.abspath(run), "logs", "nccl_trace_rank_")
    names = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if kind == "cuda" else [])
    master = environ.get("MASTER_ADDR", "")
    if master and any(unset(n) for n in names) and not is_loopback(master):
        interface = route_interface(master)
        if interface:
            wanted |= dict.fromkeys(names, interface)
    return {k: v for k, v in wanted.items() if unset(k)}


def is_loopback(host: str) -> bool:
    """True when `host` (a name or an address) resolves to a loopback address (one host)."""
    try:
        return all(
            ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
            for info in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError):
        return False


def route_interface(host: str) -> str | None:
    """The network interface (e.g. "eth0", "lo") whose address this machine sends from to reach
    `host`: a UDP socket connected to it (no packet is sent) gives the source address the kernel's
    routing picks, then the interface that holds that address. None when unknown."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            local = str(s.getsockname()[0]).split("%")[0]
    except OSError:
        return None
    return interface_with_address(local)


def interface_with_address(address: str) -> str | None:
    """The interface that holds `address` (Linux: SIOCGIFADDR for IPv4, /proc/net/if_inet6 for
    IPv6; the standard library has no getifaddrs)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:  # address (32 hex digits), index, prefix, scope, flags, name
                    fields = line.split()
                    if len(fields) == 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                        return fields[5]
        except OSError:
            return None
        return None
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:  # no IPv4 address on this interface
                continue
            if got == address:
                return name
    return None


def die_with_launcher() -> None:
    """A rank torchrun started gets SIGTERM when its agent dies (Linux's parent-death signal): a
    SIGKILL of the agent alone would otherwise leave it training and holding the run lock. SIGTERM
    stops it as a preemption does (the step ends, every rank stops there, a checkpoint is saved)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent:  # the agent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


# The caching allocator's settings: expandable segments grow one mapping instead of caching
# blocks of fixed sizes, so memory freed between the forward's activations and the backward's
# gradients is reused at any size (fragmentation is what the memory plan's headroom pays for).
# Newer torch reads PYTORCH_ALLOC_CONF first (the CUDA name is its deprecated alias, read only
# when it is unset, so no warning), older torch only PYTORCH_CUDA_ALLOC_CONF: both are set.
ALLOCATOR_CONF = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_env(kind: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables make_torch_backend sets before the first CUDA allocation (the
    allocator reads them once): ALLOCATOR_CONF under both names on CUDA, nothing where the user
    set either name (their settings stand whole) or on another kind."""
    if kind != "cuda" or any(name in environ for name in ALLOCATOR_ENV):
        return {}
    return dict.fromkeys(ALLOCATOR_ENV, ALLOCATOR_CONF)


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


def set_process_group_env(kind: str, run: str, rank: int) -> None:
    """process_group_env(...) into os.environ (NCCL and gloo read it when the process group is
    made), the flight recorder's folder made, and the choice logged once."""
    env = process_group_env(kind, run, os.environ)
    os.environ.update(env)
    if DUMP_FILE in env:
        with contextlib.suppress(OSError):  # no folder: NCCL's dump fails, training does not
            os.makedirs(os.path.dirname(env[DUMP_FILE]), exist_ok=True)
    if env and rank == 0:
        log.info("process group environment: %s", " ".join(f"{k}={v}" for k, v in env.items()))
