"""Hosts of a multi-host TPU slice simulated on the XLA CPU backend: one process per host, each
with its own XLA CPU runtime of CPU_NUM_DEVICES devices, told the process count and index that a
slice's runtime reports (v4-16: 2 hosts x 4 chips).

    python -m tests.xla_hosts HOSTS INDEX -- train --run ... (codex's CLI arguments)

torch_xla 2.9 cannot join CPU processes into one runtime (its CPU client takes no process id or
coordinator), so a device program here spans one process's devices only. The simulation patches
exactly what needs that cross-host runtime, and nothing else:

    xr.process_count, xr.process_index    the host count and this host's index (make_xla_backend
                                          and torch_xla's xla:// rendezvous read them)
    xr.global_runtime_device_count        hosts x local devices, the slice's chips, where
                                          make_xla_backend asks (the preset check, world_size, the
                                          batch plan)
    train.xla.sharding.make_mesh          over this process's devices (a slice's mesh spans every
                                          host's chips)
    XLABackend.all_reduce_grads           the gradient mean over the hosts through the control
                                          plane's gloo group (on a slice: the step program's own
                                          all-reduce, over the chips' interconnect), each mean put
                                          back with its parameter's sharding (fsdp)
    XLABackend.all_reduce_sum             likewise for validation's sums

Everything else is codex's multi-host path as it runs on a slice: make_xla_backend's multi-host
branch, the xla:// gloo control plane, one loader per host (loader_rank, loader_world,
devices_per_loader), the stop flag, the shared-folder check, DCP checkpoints written by every host,
resume. The step program itself is one host's, so what only a slice shows (the cross-host
collectives in the compiled program, their speed) is not simulated.

fsdp: a host's mesh holds its own chips only, so the simulation shards the state within each host
and replicates it across hosts (train.fsdp_size = chips per host: HSDP, each host one replica).
What crosses hosts is the checkpoint: each host writes its share of the shards and reads back only
the pieces its chips hold, whatever mesh wrote them.

With RSS_ENV set, the host records its resident memory around the resume (restore_training) to
VALUE.INDEX.json: VmRSS before it, and the peak (VmHWM, reset first) until it returned and its
tensors were on the chips. A host's chips are CPU devices of its process, so that peak counts the
state the chips receive as well as the host's own load buffers.
"""

from __future__ import annotations

import os
import sys

RECORD_ENV = "CODEX_SIM_RECORD_BATCH"  # save each host's first batch to VALUE.INDEX.pt
RSS_ENV = "CODEX_SIM_RECORD_RSS"  # record the resume's resident memory to VALUE.INDEX.json


def simulate(hosts: int, index: int) -> None:
    """Patch torch_xla's runtime queries and codex's mesh and cross-host sums (module doc)."""
    from codex.core.progress import setup_logging
    from codex.train.plan.world import set_xla_import_env

    # before torch_xla's first import, as codex's CLI does: its import logs through the root
    # logger, which would otherwise get logging's default handler in place of codex's
    setup_logging()
    set_xla_import_env()
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.runtime as xr

    from codex.train.xla import sharding
    from codex.train.xla.backend import XLABackend

    local = xr.addressable_runtime_device_count()
    # (hosts == 1: the same runtime, unpatched but for the recorder: the reference run)
    xr.process_count = lambda: hosts
    xr.process_index = lambda: index
    global_count = xr.global_runtime_device_count

    def slice_device_count() -> int:
        # The slice's chips for make_xla_backend; torch_xla's own checks (xs.Mesh) keep this
        # runtime's count.
        caller = sys._getframe(1).f_globals.get("__name__")
        return hosts * local if caller == "codex.train.xla.backend" else global_count()

    xr.global_runtime_device_count = slice_device_count
    make_mesh = sharding.make_mesh

    def local_mesh(replicas: int, shard: int):
        if replicas % hosts:
            raise ValueError(f"the simulation splits the replica axis over {hosts} hosts")
        return make_mesh(replicas // hosts, shard)

    sharding.make_mesh = local_mesh

    def host_sum(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        torch_xla.sync()
        flat = torch.cat([t.detach().cpu().reshape(-1).float() for t in tensors])
        dist.all_reduce(flat)  # the control plane's gloo group
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype).to(t.device))
            offset += t.numel()
        return out

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.grad is not None]
        for p, g in zip(params, host_sum([p.grad for p in params]), strict=True):
            mean = g / hosts
            if sharding.sharding_of(p):  # the layout the step program gives it on a slice
                torch_xla._XLAC._xla_mark_sharding(mean, torch_xla._XLAC._get_xla_op_sharding(p))
            p.grad = mean

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return host_sum([tensor])[0]

    if hosts > 1:
        XLABackend.all_reduce_grads = all_reduce_grads
        XLABackend.all_reduce_sum = all_reduce_sum
    record = os.environ.get(RECORD_ENV)
    if record:
        _record_first_batch(XLABackend, f"{record}.{index}.pt")
    rss = os.environ.get(RSS_ENV)
    if rss:
        _record_resume_memory(f"{rss}.{index}.json")


def _record_first_batch(backend_class, path: str) -> None:
    """Save the first batch this host's loader hands to_device (CPU tensors): the tests compare
    the hosts' batches with one host's."""
    import torch

    to_device = backend_class.to_device

    def recording(self, batch):
        if not os.path.exists(path):
            torch.save([t.clone() for t in batch], path)
        return to_device(self, batch)

    backend_class.to_device = recording


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _record_resume_memory(path: str) -> None:
    """Wrap the loop's restore_training: VmRSS before, VmHWM (reset before) after its tensors are
    on the chips, in bytes."""
    import json

    import torch_xla.core.xla_model as xm

    from codex.train import loop

    restore = loop.restore_training

    def measured(*args, **kwargs):
        before = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        out = restore(*args, **kwargs)
        xm.wait_device_ops()
        with open(path, "w") as f:
            json.dump({"rss_before": before * 1024, "peak": _status_kb("VmHWM") * 1024}, f)
        return out

    loop.restore_training = measured


def main() -> int:
    hosts, index, sep, *args = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: python -m tests.xla_hosts HOSTS INDEX -- CODEX_ARGS")
    simulate(int(hosts), int(index))
    from codex.cli.__main__ import main as codex_main

    return codex_main(args)


if __name__ == "__main__":
    sys.exit(main())
