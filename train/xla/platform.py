"""Before the XLA runtime starts: the no-silent-fallback platform check (a TPU preset needs
PJRT_DEVICE=TPU and TPU chips; PJRT_DEVICE=CPU only with train.allow_cpu_xla), libtpu's flags
(LIBTPU_INIT_ARGS: async collectives and the chip's MaxText flags, set on TPU before torch_xla
is imported), the flash-attention requirements, and where XLA's persistent compilation cache
lives. Nothing here starts the runtime.
"""

from __future__ import annotations

import hashlib
import logging
import os

from codex.core import fsio
from codex.train.distributed.backend import BackendError
from codex.train.plan.world import set_xla_import_env
from codex.train.xla.flash import flash_unavailable, pallas_available, xla_attention

log = logging.getLogger("codex.xla")


# --- libtpu's flags -----------------------------------------------------------------------------

# MaxText's continuation fusion for all-gather and all-reduce (AI-Hypercomputer/maxtext e591f30,
# benchmarks/xla_flags_library.py: CF_FOR_ALL_REDUCE_AND_ALL_GATHER; the flags are described in
# src/maxtext/configs/README.md): the all-gathers and all-reduces run asynchronously and are fused
# into the compute XLA schedules between their start and done, so the fsdp weights' all-gather and
# the gradients' reduction overlap compute instead of stalling the chip. libtpu reads them once,
# when the runtime starts.
LIBTPU_FLAGS = (
    "--xla_enable_async_all_reduce=true",
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
)

# MaxText's further flags for its dense recipes on v6e (same commit; benchmarks/
# maxtext_trillium_model_configs.py, e.g. llama3_1-8b-8192; xla_flags_library.py names the groups):
# DENSE_VMEM_LIMIT_FLAG, the scoped VMEM a fusion may use (the rest prefetches the next op's
# operands), and LAYOUT_FOR_ALL_REDUCE_SCATTER ("better memory layout for all-reduce", for its
# rewrite into a reduce-scatter). Each changes libtpu's program for codex's fsdp step
# (tests/train/xla/test_tpu_compile.py). Not set: DATA_PARALLEL_OVERLAP, all that MaxText's v5p
# dense recipes add to continuation fusion (maxtext_v5p_model_configs.py, llama2_7b_v5p_*), and
# most of its v6e ones: it pipelines data-parallel all-reduces over DCN (between slices), and a
# one-slice program, the only kind codex builds, came out byte for byte the same with it on v6e
# and v5p (docs/tpu.md).
SCOPED_VMEM = ("--xla_tpu_scoped_vmem_limit_kib=98304",)
LAYOUT_FOR_REDUCE_SCATTER = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true",
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1",
    "--xla_tpu_assign_all_reduce_scatter_layout=true",
)
CHIP_FLAGS = {"v6e": SCOPED_VMEM + LAYOUT_FOR_REDUCE_SCATTER}


def libtpu_flags(chip: str = "") -> tuple[str, ...]:
    """codex's libtpu flags on `chip` (a preset's family: v6e, v5p, v5e, v4; "" for none)."""
    return LIBTPU_FLAGS + CHIP_FLAGS.get(chip, ())


def _flag_name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def libtpu_init_args(user: str, chip: str = "") -> str:
    """LIBTPU_INIT_ARGS with libtpu_flags(chip): the user's string kept as given, and each of ours
    appended unless the user's sets that flag (to any value): the user's value wins."""
    given = {_flag_name(a) for a in user.split()}
    ours = [f for f in libtpu_flags(chip) if _flag_name(f) not in given]
    return " ".join([user.strip(), *ours]).strip()


def set_libtpu_flags(chip: str = "") -> None:
    """LIBTPU_INIT_ARGS in this process's environment (inherited by spawn's processes), before
    torch_xla is imported: the import adds its own defaults to it, and libtpu reads it when the
    runtime starts."""
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args(os.environ.get("LIBTPU_INIT_ARGS", ""), chip)


# --- the no-silent-fallback check -------------------------------------------------------------


def _tpu_chips_on_host() -> int:
    """TPU chips on this host's PCI bus (does not start the XLA runtime)."""
    try:
        from torch_xla._internal import tpu

        return int(tpu.num_available_chips())
    except Exception:  # no /sys (containers), or torch_xla internals moved: count /dev/accel*
        return (
            len([d for d in os.listdir("/dev") if d.startswith("accel")])
            if os.path.isdir("/dev")
            else 0
        )


def check_platform(cfg, preset) -> str:
    """ "TPU" or "CPU" (the XLA CPU backend, only with train.allow_cpu_xla); otherwise a
    BackendError naming PJRT_DEVICE, the devices found and the fix. Starts nothing."""
    # Read before importing torch_xla: the import sets PJRT_DEVICE=CPU when it is unset.
    pjrt = os.environ.get("PJRT_DEVICE", "")
    # torch_xla reads them once, at import: this is the first import on the XLA path.
    set_xla_import_env()
    if pjrt == "TPU":
        set_libtpu_flags(preset.family)
    try:
        import torch_xla  # noqa: F401
    except ImportError as e:
        raise BackendError(
            f"hardware preset '{preset.name}' runs on PyTorch/XLA, "
            f"but torch_xla cannot be imported ({e}). "
            "Fix: on the TPU VM, pip install -e '.[tpu,gcs]' "
            "-f https://storage.googleapis.com/libtpu-releases/index.html "
            "(torch==2.9.0 + torch_xla[tpu]==2.9.0); or pick --hardware cpu or a GPU preset."
        ) from None
    chips = _tpu_chips_on_host()
    found = f"{chips} TPU chip(s) on this host's PCI bus"
    if pjrt == "TPU":
        if chips == 0:
            raise BackendError(
                f"hardware preset '{preset.name}' needs TPUs and PJRT_DEVICE=TPU, "
                f"but found {found} (no TPU here). "
                "Fix: run on a TPU VM of that type "
                "(gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...), "
                "or pick --hardware cpu or a GPU preset."
            )
        return "TPU"
    if pjrt == "CPU":
        if cfg.train.allow_cpu_xla:
            log.warning(
                "PJRT_DEVICE=CPU with --allow-cpu-xla: the XLA path runs on the CPU (%s devices); "
                "this is for tests, not for training",
                os.environ.get("CPU_NUM_DEVICES", "1"),
            )
            return "CPU"
        raise BackendError(
            f"hardware preset '{preset.name}' needs TPUs, "
            f"but PJRT_DEVICE=CPU selects the XLA CPU backend ({found}). "
            "Fix: export PJRT_DEVICE=TPU on a TPU VM; "
            "to run the XLA path on the CPU on purpose (tests), "
            "also pass --allow-cpu-xla (train.allow_cpu_xla=true)."
        )
    raise BackendError(
        f"hardware preset '{preset.name}' needs TPUs, but PJRT_DEVICE={pjrt or '(unset)'} "
        f"(torch_xla would fall back to the CPU) and found {found}. "
        "Fix: export PJRT_DEVICE=TPU on the TPU VM; or pick --hardware cpu or a GPU "
        "preset; PJRT_DEVICE=CPU plus --allow-cpu-xla runs the XLA path on the CPU for tests."
    )


def check_attention(cfg, platform: str) -> None:
    """model.attention=flash needs a real TPU (its Pallas kernel is a TPU custom call) and JAX
    (torch_xla traces the kernel with it at the first forward): refused here, before the run.
    auto runs flash where it can (train/xla/flash.py: xla_attention) and says so where a TPU
    lacks JAX."""
    requested = cfg.model.attention
    if requested == "auto":
        if platform == "TPU" and not pallas_available(platform):
            log.warning(
                "model.attention=auto: JAX is not installed, so torch_xla's Pallas flash kernel "
                "cannot run; attention runs blockwise in XLA ops "
                "(pip install 'torch_xla[pallas]==2.9.0' for flash)"
            )
        log.info("attention: %s", xla_attention(requested, platform))
    if requested != "flash":
        return
    if platform != "TPU":
        raise BackendError(
            flash_unavailable(f"PJRT_DEVICE={platform} runs the XLA path on the {platform}")
        )
    if not pallas_available(platform):
        raise BackendError(
            "model.attention=flash traces torch_xla's Pallas kernel with JAX, "
            "which is not installed. "
            "Fix: pip install 'torch_xla[pallas]==2.9.0' "
            "(see torch_xla's README for the JAX index), "
            "or --set model.attention=sdpa."
        )


def cache_dir(cfg) -> str:
    """The persistent compilation cache: train.xla_cache, else RUN/xla_cache. XLA writes it with
    local file I/O, so a gs:// run keeps its cache on the local disk (one per host)."""
    if cfg.train.xla_cache:
        path = cfg.train.xla_cache
    elif fsio.is_remote(cfg.run):
        key = hashlib.sha1(cfg.run.rstrip("/").encode()).hexdigest()[:12]
        path = os.path.join(os.path.expanduser("~"), ".cache", "codex", "xla_cache", key)
    else:
        path = fsio.join(cfg.run, "xla_cache")
    if fsio.is_remote(path):
        raise BackendError(
            f"train.xla_cache={path}: the XLA compilation cache must be a local directory"
        )
    os.makedirs(path, exist_ok=True)
    return path
