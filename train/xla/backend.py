"""TPU training on PyTorch/XLA: the Backend (train/distributed/backend.py) on XLA devices.

spmd (the default): one process per host drives all its chips as one program over a ("replica",
"fsdp") mesh, and the partitioner inserts the gradient reduction. spawn: one process per chip
(spawn_train), with one xm.all_reduce a step. A run compiles a fixed number of programs: fixed
shapes, one graph cut a step, nothing read back inside a step.

torch_xla is being superseded (RFC pytorch/xla #9684), so it stays inside train/xla/,
train/checkpoint/xla_shards.py and train/remat.py: the rest of codex sees only the Backend. The
modes, the compile count and the cache: docs/tpu.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from codex.core.config import ConfigError, from_dict, to_dict
from codex.train.distributed.backend import BackendError, autocast_context, resolve_dtype, unwrap
from codex.train.distributed.control import ControlPlane, control_timeout
from codex.train.plan.presets import get_preset
from codex.train.plan.world import set_xla_import_env
from codex.train.xla import sharding as xla_sharding
from codex.train.xla.flash import use_flash_attention, xla_attention
from codex.train.xla.platform import cache_dir, check_attention, check_platform
from codex.train.xla.reduce_scatter import set_phases

log = logging.getLogger("codex.xla")


class CompileLimitError(RuntimeError):
    """More XLA compilations than train.max_compiles: something recompiles every step."""


# --- the backend --------------------------------------------------------------------------------


@dataclass
class XLABackend:
    """The Backend protocol (train/distributed/backend.py) on XLA devices, SPMD or one process per
    chip."""

    device: torch.device
    mode: str  # "spmd" or "spawn"
    rank: int  # spmd: process index (host); spawn: global ordinal (chip)
    world_size: int  # data-parallel replicas = chips in the slice (both modes)
    local_rank: int
    autocast_dtype: torch.dtype | None
    loader_rank: int  # which of loader_world host loaders this process is
    loader_world: int
    devices_per_loader: int  # spmd: local chips (one loader feeds them all); spawn: 1
    global_values: bool  # spmd: one program holds global values (no cross-rank sums)
    fixed_shapes: bool = True  # XLA compiles one graph per shape: masked full val batches
    lagged_logs: bool = True  # a log step never drains the device (train/loop.py: _log_train)
    max_compiles: int = 0
    mesh: Any = None
    chips_per_host: int = 1  # the slice's: fsdp reduces across hosts, then within one
    flash_attention: bool = False  # flash runs (train/xla/flash.py: xla_attention)
    flash_chip: str | None = None  # the chip whose flash block sizes apply; None: this VM's
    # train.xla_step: cached = micro-batches in one While (train/xla/step.py)
    xla_step: str = "cached"
    kind: str = "tpu"  # the preset's kind; the device type is "xla" (also on PJRT_DEVICE=CPU)
    pinned_copy_device: None = None  # batches go through send_cpu_data_to_device, not a pinned copy
    # gloo over processes (train/distributed/control.py)
    control: ControlPlane = field(default_factory=ControlPlane)
    _specs: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        return autocast_context("xla", self.autocast_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Under SPMD an unannotated tensor is replicated on every chip: the data-parallel layout.
        model = model.to(self.device)
        if self.flash_attention:
            use_flash_attention(unwrap(model), self.mesh, self.flash_chip)
        return model

    def build_model(self, model_cfg, seed: int, layout=None) -> torch.nn.Module:
        """build_model's weights, replicated, or sharded on a (replica, fsdp) mesh
        (train/xla/sharding.py)."""
        from codex.model.gpt import build_model

        model = build_model(model_cfg, seed=seed)
        if layout is None or not layout.sharded:
            return self.prepare_model(model)
        if self.mode != "spmd":
            raise ConfigError(
                "train.parallel=fsdp on TPU runs under --xla-mode spmd (one process per host "
                "drives the mesh): use --xla-mode spmd or train.parallel=replicate"
            )
        self.mesh, self._specs = xla_sharding.make_mesh(layout.replicas, layout.shard), {}
        set_phases(self.mesh, self.chips_per_host)
        scanned = hasattr(model, "blocks_runner") and layout.shard > 1
        if scanned:
            from codex.train.xla.layer_scan import ScannedBlocks, stack_blocks

            stack_blocks(model)  # the block weights [n_layer, ...] for the run, sharded
        xla_sharding.shard_model(model, self.mesh, self.device)
        if scanned:
            # validation's forward: the same layer loop as the training step's (forward only)
            model.blocks_runner = ScannedBlocks(self.mesh, self.autocast_dtype, train=False)
        return self.prepare_model(model)

    def set_grad_sync(self, model: torch.nn.Module, on: bool) -> None:
        pass  # the gradient reduction is the partitioner's (spmd) or all_reduce_grads' (spawn)

    def device_accumulation(self, model: torch.nn.Module, accum: int):
        """train.xla_step=cached: a callable running the step's `accum` micro-batches from the
        loader as one While traced once (train/xla/step.py); traced: None, the loop re-traces each
        one."""
        if self.xla_step != "cached":
            return None
        from codex.train.xla.step import DeviceAccumulation, stack_micro_batches

        def loss(x, y):
            with self.autocast():
                return model(x, y)

        # SPMD: the While runs per device, one gradient reduction after it (train/xla/step.py);
        # spawn: each process's While is already its own device's.
        mesh = self.mesh if self.mode == "spmd" else None
        accumulation = DeviceAccumulation(unwrap(model), loss, accum, mesh, self.autocast_dtype)
        return lambda loader: accumulation(*self.to_device(stack_micro_batches(loader, accum)))

    def cached_update(self, model: torch.nn.Module, optimizer, max_norm: float):
        """train.xla_step=cached: gradient clipping + optimizer.step as one computation traced
        once (train/xla/update.py), called with the step's lr; traced: None."""
        if self.xla_step != "cached":
            return None
        from codex.train.xla.update import CachedUpdate

        return CachedUpdate(unwrap(model), optimizer, max_norm)

    def _spec(self, ndim: int):
        """Shard dim 0 over the mesh; minibatch=True: the tensor is this host's part of the global
        batch (on one host, the whole batch)."""
        if ndim not in self._specs:
            import torch_xla.distributed.spmd as xs

            self._specs[ndim] = xs.ShardingSpec(
                self.mesh, xla_sharding.batch_spec(ndim), minibatch=True
            )
        return self._specs[ndim]

    def to_device(self, batch):
        if self.mesh is None:
            return tuple(t.to(self.device) for t in batch)
        import torch_xla.core.xla_model as xm

        # One host-to-device transfer per tensor, each host sending only its local shards.
        return tuple(
            xm.send_cpu_data_to_device([t], self.device, self._spec(t.dim()))[0] for t in batch
        )

    @torch.no_grad()
    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """THE gradient all-reduce. SPMD: nothing to do here, the partitioner already inserted it
        into the step's graph (the program computes the gradient of the global batch's mean loss).
        spawn: one xm.all_reduce(SUM, scale=1/W) over all gradients, once per optimizer step."""
        if self.mode == "spmd":
            return
        import torch_xla.core.xla_model as xm

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # In place, one collective for the list (XLA fuses it); a no-op on one chip unless
        # XLA_ALWAYS_ALLREDUCE=1 (the tests set it so the collective really runs).
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.global_values:
            return tensor  # SPMD: the value is already the sum over the global (sharded) batch
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def any_flag(self, flag: bool) -> bool:
        """True on every process when any process's flag is set: the control plane's host-side
        gloo all-reduce, every step, with no device value read back (the pipeline keeps running
        ahead)."""
        return self.control.any_flag(flag)

    def first_step_done(self) -> None:
        pass  # the control plane's gloo group keeps its timeout; XLA's own collectives have none

    def step_boundary(self) -> None:
        import torch_xla

        torch_xla.sync()  # cut the graph: one compiled program per optimizer step, dispatched async
        if self.max_compiles > 0:
            n = self.compile_count()
            if n > self.max_compiles:
                raise CompileLimitError(
                    f"XLA compiled {n} programs, more than train.max_compiles={self.max_compiles}: "
                    "a shape or a constant changes between steps, or a tensor is read on the host "
                    "inside the step. "
                    "Run with PT_XLA_DEBUG_LEVEL=2 to see what triggers each compilation."
                )

    def synchronize(self) -> None:
        """Run what is still pending and wait for the device. The sync also materialises small
        host-side updates made between steps (the loop zeroing its loss sum after a log line), so
        the next step's graph is the usual one instead of a variant that costs a compilation."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()

    def barrier(self) -> None:
        # gloo across processes: under SPMD xm.rendezvous would span one process
        self.control.barrier()

    def memory_stats(self) -> dict[str, float]:
        """HBM of the busiest local chip: the largest bytes in use and peak over this host's
        physical devices. Per physical device because under SPMD the one device torch sees is
        virtual and the runtime refuses its memory info (pytorch/xla #9022). {} where the runtime
        has none (the XLA CPU backend). Not run on a TPU yet."""
        import torch_xla

        devices = torch_xla._XLAC._xla_get_runtime_devices() if self.mode == "spmd" else []
        used, peak = [], []
        for device in devices or [str(self.device)]:
            try:
                info = torch_xla._XLAC._xla_memory_info(device)
            except Exception:  # the XLA CPU backend has no memory info
                return {}
            used.append(info.get("bytes_used", 0))
            peak.append(info.get("peak_bytes_used", 0))
        out = {"mem_gb": max(used) / 1e9}
        if any(peak):
            out["mem_peak_gb"] = max(peak) / 1e9
        return out

    def compile_count(self) -> int:
        """XLA compilations in this process so far (torch_xla's CompileTime metric)."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def close(self, ok: bool = True) -> None:
        """ok: finish the device work, then the clean-exit barrier. Not ok (this process raised):
        neither, the peers may sit in a collective this process will never join; its exit fails
        them at once."""
        if not ok:
            return
        self.synchronize()
        if self.control.world > 1 and dist.is_initialized():
            self.control.barrier()
            dist.destroy_process_group()


def make_xla_backend(cfg, preset, spawned: bool = False) -> XLABackend:
    """The XLA backend for a TPU preset (called by train.launch.make_backend); `spawned`: this
    process was started by spawn_train (train.xla_mode=spawn). The checks, the runtime start, then
    the mode's fields (_spmd_backend, _spawn_backend), in the order the runtime must see them."""
    mode = cfg.train.xla_mode
    platform = check_platform(cfg, preset)
    check_attention(cfg, platform)
    if mode == "spawn" and not spawned:
        raise BackendError(
            "train.xla_mode=spawn starts one process per chip through torch_xla's launcher: run "
            "`codex train --xla-mode spawn ...` (train.xla.backend.spawn_train), "
            "not train() directly"
        )
    set_xla_import_env()
    import torch_xla
    import torch_xla.runtime as xr

    if not torch_xla._XLAC._xla_computation_cache_is_initialized():
        # Before any computation. spawn: one writer per host (the others read), no racing writes.
        readonly = mode == "spawn" and int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")) != 0
        xr.initialize_cache(cache_dir(cfg), readonly=readonly)
    make = functools.partial(
        XLABackend,
        mode=mode,
        autocast_dtype=resolve_dtype(cfg.train.dtype, preset.kind),
        max_compiles=cfg.train.max_compiles,
        flash_attention=xla_attention(cfg.model.attention, platform) == "flash",
        xla_step=cfg.train.xla_step,
    )
    fix = (
        "Fix: use the preset that matches this machine (`codex hardware`)"
        + (", or set CPU_NUM_DEVICES" if platform == "CPU" else "")
        + "."
    )
    if mode == "spmd":
        backend = _spmd_backend(make, preset, platform, fix)
    else:
        backend = _spawn_backend(make, preset, platform, fix)
    backend.control = _control_plane(backend.loader_world)
    if backend.is_main:
        log.info(
            "XLA %s on PJRT_DEVICE=%s: %d chip(s), %d process(es), compilation cache %s",
            mode,
            platform,
            backend.world_size,
            backend.loader_world,
            os.environ.get("XLA_PERSISTENT_CACHE_PATH"),
        )
    return backend


def _spmd_backend(make: Callable[..., XLABackend], preset, platform: str, fix: str) -> XLABackend:
    """SPMD: one process per host drives all its chips as one program, over a mesh of the slice's
    chips (replicate; build_model reshapes it under fsdp)."""
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    local = xr.addressable_runtime_device_count()
    hosts, host = xr.process_count(), xr.process_index()
    if n != preset.devices or (platform == "TPU" and hosts != preset.hosts):
        raise BackendError(
            f"hardware preset '{preset.name}' has {preset.devices} chips on "
            f"{preset.hosts} host(s), "
            f"but PJRT_DEVICE={platform} found {n} devices on {hosts} process(es) "
            f"({xr.device_type()}). {fix}"
        )
    mesh = xla_sharding.make_mesh(n, 1)  # replicate; build_model reshapes it under fsdp
    return make(
        device=torch_xla.device(),
        rank=host,
        world_size=n,
        local_rank=0,
        loader_rank=host,
        loader_world=hosts,
        devices_per_loader=local,
        global_values=True,
        mesh=mesh,
        chips_per_host=preset.devices_per_host,
    )


def _spawn_backend(make: Callable[..., XLABackend], preset, platform: str, fix: str) -> XLABackend:
    """spawn: this process is one chip's, started by torch_xla's launcher."""
    import torch_xla
    import torch_xla.runtime as xr

    world, rank = xr.world_size(), xr.global_ordinal()
    if world != preset.devices:
        raise BackendError(
            f"hardware preset '{preset.name}' has {preset.devices} chips, "
            "but torch_xla's launcher "
            f"started {world} process(es) on PJRT_DEVICE={platform}. {fix}"
        )
    return make(
        device=torch_xla.device(),
        rank=rank,
        world_size=world,
        local_rank=xr.local_ordinal(),
        loader_rank=rank,
        loader_world=world,
        devices_per_loader=1,
        global_values=False,
    )


def _control_plane(processes: int) -> ControlPlane:
    """The host-side gloo group over this job's processes (hosts under SPMD), rendezvous through
    torch_xla's xla:// handler as its distributed-checkpoint docs do; one process needs none."""
    if processes == 1:
        return ControlPlane()
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// init method)

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="xla://", timeout=control_timeout())
    if dist.get_world_size() != processes:
        raise BackendError(
            f"the gloo control group has {dist.get_world_size()} processes, XLA reports {processes}"
        )
    return ControlPlane(dist.group.WORLD, dist.get_rank(), processes)


# --- --xla-mode spawn: one process per chip -----------------------------------------------------


def _spawn_main(
    index: int, train_fn: Callable[..., dict], cfg_dict: dict, result_path: str
) -> None:
    """Runs in every process torch_xla's launcher starts: the ordinary training loop."""
    result = train_fn(from_dict(cfg_dict), xla_spawned=True)
    if index == 0:
        with open(result_path, "w") as f:
            json.dump(result, f, default=str)


def spawn_train(cfg, train_fn: Callable[..., dict]) -> dict:
    """`codex train --xla-mode spawn`: run `train_fn` (train/loop.py's train with its evaluate
    bound; a module-level function, as the launcher pickles it) in one process per local chip
    (torch_xla.launch); returns process 0's summary. Multi-host: the same command on every
    worker."""
    preset = get_preset(cfg.train.hardware)
    if preset.kind != "tpu":
        raise ConfigError(
            f"train.xla_mode=spawn is for TPU presets; '{preset.name}' is {preset.kind} "
            "(use torchrun for several GPUs)"
        )
    # fail here, in the parent, before any process starts
    check_attention(cfg, check_platform(cfg, preset))
    set_xla_import_env()
    import torch_xla

    with tempfile.TemporaryDirectory(prefix="codex-spawn-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        torch_xla.launch(_spawn_main, args=(train_fn, to_dict(cfg), result_path))
        if not os.path.exists(result_path):
            raise RuntimeError("xla spawn: process 0 finished without a result (see the log above)")
        with open(result_path) as f:
            return json.load(f)
