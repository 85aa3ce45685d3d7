"""The TPU compiler on a machine without a TPU: libtpu's compile-only client compiles HLO modules
for a named slice topology (as MaxText's train_compile.py does for JAX).

Runs in its own interpreter, `python -m codex.train.xla.tpu_compile REQUEST.json`, with JAX and
libtpu but never torch_xla: both bundle XLA, so each gets a process of its own. It prints one JSON
line per program: per-chip memory, cost analysis, compile seconds. The request, and the private
JAX entry points the `tpu-aot` extra pins: docs/tpu.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# The packages of pyproject.toml's `tpu-aot` extra; the import names they provide.
EXTRA = "tpu-aot"
REQUIRES = {"jax": "jax==0.7.1", "jaxlib": "jaxlib==0.7.1", "libtpu": "libtpu==0.0.21"}


def missing_packages() -> list[str]:
    """The pins of the tpu-aot extra whose package cannot be imported here (no import done)."""
    return [pin for name, pin in REQUIRES.items() if importlib.util.find_spec(name) is None]


def _hlo_module(hlo_proto: bytes) -> bytes:
    """Field 1 (the HloModuleProto) of an HloProto, as XLA's --xla_dump_hlo_as_proto writes it."""
    from google.protobuf.internal.decoder import _DecodeVarint

    pos = 0
    while pos < len(hlo_proto):
        tag, pos = _DecodeVarint(hlo_proto, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _DecodeVarint(hlo_proto, pos)
        elif wire == 2:
            size, pos = _DecodeVarint(hlo_proto, pos)
            if number == 1:
                return hlo_proto[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unexpected wire type {wire} in an HloProto")
    raise ValueError("no HloModuleProto (field 1) in the HloProto")


def compile_programs(topology: str, protos: list[str]) -> list[dict]:
    """Compile each HLO proto for `topology` (e.g. "v6e:2x2") with libtpu: an HloModuleProto
    (*.hlo_module.pb) or an HloProto as XLA dumps it; each program's TPU text is written to
    PROTO + ".tpu.txt"."""
    # libtpu takes a lock file (/tmp/libtpu_lockfile) so that one process owns a host's TPUs; a
    # compile-only client owns none, and a second compile (another run, a test) must not abort
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    # torch_xla's modules carry GSPMD shardings (mhlo.sharding); Shardy would ignore them.
    jax.config.update("jax_use_shardy_partitioner", False)
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    out = []
    for path in protos:
        data = Path(path).read_bytes()
        module_proto = data if path.endswith(".hlo_module.pb") else _hlo_module(data)
        stablehlo = _jax.mlir.hlo_to_stablehlo(module_proto)
        with mlir.make_ir_context():
            module = ir.Module.parse(stablehlo)
            options = compiler.get_compile_options(
                num_replicas=1,
                num_partitions=len(devices),
                device_assignment=np.array(devices).reshape(1, len(devices)),
            )
            # as torch_xla compiles a sharded program: outputs keep the shardings propagated to
            # them (an updated weight stays sharded) instead of being replicated
            options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
            start = time.perf_counter()
            executable = compiler.backend_compile_and_load(
                devices[0].client, module, _jax.DeviceList(tuple(devices)), options, []
            )
            seconds = time.perf_counter() - start
        stats = executable.get_compiled_memory_stats()
        cost = executable.cost_analysis() or {}
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        text_path = path + ".tpu.txt"
        Path(text_path).write_text(executable.hlo_modules()[0].to_string())
        out.append(
            {
                "proto": path,
                "text": text_path,
                "device_kind": devices[0].device_kind,
                "chips": len(devices),
                "compile_s": seconds,
                "argument_bytes": stats.argument_size_in_bytes,
                "output_bytes": stats.output_size_in_bytes,
                "alias_bytes": stats.alias_size_in_bytes,
                "temp_bytes": stats.temp_size_in_bytes,
                "code_bytes": stats.generated_code_size_in_bytes,
                "flops": float(cost.get("flops", 0.0)),
                "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            }
        )
    return out


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    for program in compile_programs(request["topology"], request["protos"]):
        print("CODEX_TPU_PROGRAM " + json.dumps(program), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
