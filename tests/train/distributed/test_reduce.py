"""The replicated gradient all-reduce (train/distributed/reduce.py through TorchBackend) on 2 gloo
ranks:
exactly one reduction of every gradient element per optimizer step, issued from the last
micro-batch's backward while it still computes (overlap), for accumulation 1 and 4 through
`codex train`; the mean of the ranks' gradients, bitwise in fp32 and within bf16's rounding under
train.reduce_dtype=bf16, eager, with activation checkpointing and under torch.compile (AOTAutograd's
compiled backward, CPU: aot_eager)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.runs import TINY_MODEL, VOCAB, child_env, make_run

ROOT = Path(__file__).resolve().parents[3]
BUCKET_BYTES = 16 << 10  # 11 buckets for the tiny model (222 KB of gradients)

# `codex train` with the collectives and the step's events recorded, per rank, as one JSON list:
# ["micro", last] before each micro-batch, ["ready"] when a parameter's gradient is final (a hook
# registered after the reducer's, so a bucket's all-reduce comes before its last "ready"),
# ["all_reduce", numel, dtype, in_backward], ["step"] after all_reduce_grads.
COUNT_REDUCE = """
import json, os, sys, torch
import torch.distributed as dist
from codex.train.distributed.backend import TorchBackend, unwrap
events, state, hooked = [], {{"backward": False}}, []
real_backward = torch.Tensor.backward
def backward(self, *a, **k):
    state["backward"] = True
    try:
        return real_backward(self, *a, **k)
    finally:
        state["backward"] = False
torch.Tensor.backward = backward
real_all_reduce = dist.all_reduce
def all_reduce(tensor, *a, **k):
    events.append(["all_reduce", tensor.numel(), str(tensor.dtype), state["backward"]])
    return real_all_reduce(tensor, *a, **k)
dist.all_reduce = all_reduce
real_sync = TorchBackend.set_grad_sync
def set_grad_sync(self, model, on):
    self.bucket_bytes = {bucket_bytes}
    real_sync(self, model, on)
    if not hooked:
        hooked.extend(p for p in unwrap(model).parameters() if p.requires_grad)
        events.append(["params", sum(p.numel() for p in hooked)])
        for p in hooked:
            p.register_post_accumulate_grad_hook(lambda p: events.append(["ready"]))
    events.append(["micro", on])
TorchBackend.set_grad_sync = set_grad_sync
real_reduce = TorchBackend.all_reduce_grads
def all_reduce_grads(self, model):
    real_reduce(self, model)
    events.append(["step"])
TorchBackend.all_reduce_grads = all_reduce_grads
from codex.cli.__main__ import main
try:
    code = main(["train", *[a for a in sys.argv[1:] if a != "--"]])
finally:
    with open(os.path.join("{out}", "events_rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(events, f)
sys.exit(code)
"""


def _steps(events: list) -> tuple[int, list[list]]:
    """(the parameter count, each optimizer step's events from its first micro-batch to its
    all_reduce_grads; the loss's and the stop flag's all-reduces come after that)."""
    params = next(e[1] for e in events if e[0] == "params")
    steps, current = [], []
    for e in events:
        if e[0] == "step":
            steps.append(current[next(i for i, c in enumerate(current) if c[0] == "micro") :])
            current = []
        elif e[0] != "params":
            current.append(e)
    return params, steps


@pytest.mark.slow
@pytest.mark.parametrize("accum,remat,dtype", [(1, "none", "bf16"), (4, "block", "fp32")])
def test_one_reduction_per_step_issued_inside_the_last_backward(tmp_path, accum, remat, dtype):
    """2 gloo ranks under torchrun, `codex train` with train.parallel=replicate: each optimizer
    step all-reduces exactly the parameter count (every gradient element once), in several
    buckets, all issued while the step's last backward runs (none in the earlier micro-batches)
    and the first of them before that backward finished its last gradient. accum 4 runs with
    train.remat=block (the hooks under activation checkpointing), accum 1 with
    train.reduce_dtype=bf16 (bf16 buckets)."""
    from tests.fixtures.runs import train_cli_args  # here: the spawned ranks below skip its imports

    run = make_run(tmp_path / "run")
    script = tmp_path / "count.py"
    script.write_text(COUNT_REDUCE.format(bucket_bytes=BUCKET_BYTES, out=tmp_path))
    keys = dict(
        max_steps=3,
        device_batch=2,
        batch_tokens=2 * 16 * 2 * accum,
        parallel="replicate",
        remat=remat,
        reduce_dtype=dtype,
        optimizer="adamw",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(script), "--", *train_cli_args(run, **keys)]
    proc = subprocess.run(
        cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"accum {accum}" in proc.stderr
    for rank in range(2):
        params, steps = _steps(json.loads((tmp_path / f"events_rank{rank}.json").read_text()))
        assert len(steps) == 3
        for events in steps:
            micros = [i for i, e in enumerate(events) if e[0] == "micro"]
            assert [events[i][1] for i in micros] == [False] * (accum - 1) + [True]
            reduces = [i for i, e in enumerate(events) if e[0] == "all_reduce"]
            assert sum(events[i][1] for i in reduces) == params  # every element, once
            want = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
            assert len(reduces) > 2 and all(events[i][2] == want for i in reduces)
            assert min(reduces) > micros[-1]  # nothing in the earlier micro-batches
            assert all(events[i][3] for i in reduces)  # issued from inside the backward
            last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
            assert min(reduces) < last_ready  # while gradients were still being computed


# --- the reduced values: 2 ranks through mp.spawn ------------------------------------------------


def _tiny_model_cfg():
    from codex.core.config import build_config

    cfg = build_config(overrides=TINY_MODEL).model
    cfg.vocab_size = VOCAB
    return cfg


def _reduce_worker(rank: int, world: int, port: int, out: str) -> None:
    """On each variant (eager, remat, compiled) and reduce dtype: this rank's gradients of two
    micro-batches (no reduction), then the same two micro-batches through TorchBackend's
    set_grad_sync / all_reduce_grads, with the all-reduces recorded."""
    import torch.distributed as dist

    from codex.model.gpt import build_model
    from codex.train.distributed.backend import TorchBackend
    from codex.train.remat import apply_remat

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cfg = _tiny_model_cfg()
    gen = torch.Generator().manual_seed(rank)  # each rank its own data
    windows = [torch.randint(0, VOCAB, (2, 17), generator=gen) for _ in range(2)]
    batches = [(w[:, :-1], w[:, 1:]) for w in windows]
    events: list[tuple] = []
    in_backward = [False]
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        events.append(("all_reduce", tensor.numel(), tensor.dtype, in_backward[0]))
        return real(tensor, *a, **k)

    dist.all_reduce = counting
    results: dict = {}
    for variant in ("eager", "remat", "compiled"):
        model = build_model(cfg, seed=0)
        if variant == "remat":
            apply_remat(model, "block", "cpu")
        run = torch.compile(model, backend="aot_eager") if variant == "compiled" else model
        for x, y in batches:  # this rank's own gradients
            (run(x, y) / len(batches)).backward()
        results[variant, "local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        for dtype in (torch.float32, torch.bfloat16):
            model.zero_grad(set_to_none=True)
            backend = TorchBackend(
                "cpu", torch.device("cpu"), rank, world, bucket_bytes=BUCKET_BYTES
            )
            backend.reduce_dtype = dtype
            events.clear()
            handles = []
            for micro, (x, y) in enumerate(batches):
                backend.set_grad_sync(run, micro == len(batches) - 1)
                if micro == 0:  # after the reducer's hooks: a bucket goes out before its "ready"
                    handles = [
                        p.register_post_accumulate_grad_hook(lambda p: events.append(("ready",)))
                        for p in model.parameters()
                    ]
                events.append(("micro", micro))
                in_backward[0] = True
                (run(x, y) / len(batches)).backward()
                in_backward[0] = False
            backend.all_reduce_grads(model)
            assert backend._reducer is not None
            backend._reducer.remove()
            for h in handles:
                h.remove()
            results[variant, str(dtype)] = {
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "events": list(events),
                "params": sum(p.numel() for p in model.parameters()),
            }
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.heavy  # ~15 s on an idle 2-core machine (two compiles), ~40 s shared
def test_the_reduced_gradient_is_the_ranks_mean_in_fp32_and_within_bf16_rounding(tmp_path):
    """fp32: every gradient bitwise (g0 + g1) / 2 of the ranks' own gradients; bf16: within
    bf16's rounding of each rank's gradient and of the sum, and not the fp32 result (it really was
    reduced in bf16). Eager, train.remat=block and torch.compile (aot_eager), each with its
    buckets' all-reduces issued in the second micro-batch's backward only, each element once."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    mp.spawn(_reduce_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for variant in ("eager", "remat", "compiled"):
        g0, g1 = ranks[0][variant, "local"], ranks[1][variant, "local"]
        assert any(not torch.equal(g0[n], g1[n]) for n in g0)  # the ranks' data differ
        want = {n: (g0[n] + g1[n]) / 2 for n in g0}
        for dtype in ("torch.float32", "torch.bfloat16"):
            for r in ranks:
                got = r[variant, dtype]
                if dtype == "torch.float32":
                    for n in want:
                        assert torch.equal(got["grads"][n], want[n]), (variant, n)
                else:
                    worst = 0.0
                    for n in want:
                        err = (got["grads"][n] - want[n]).abs()
                        bound = 2**-8 * (g0[n].abs() + g1[n].abs())  # bf16: 8 bits of mantissa
                        assert bool((err <= bound).all()), (variant, n)
                        worst = max(worst, err.max().item())
                    assert worst > 0  # not the fp32 sum
                reduces = [e for e in got["events"] if e[0] == "all_reduce"]
                assert sum(e[1] for e in reduces) == got["params"]
                assert len(reduces) > 2 and {str(e[2]) for e in reduces} == {dtype}
                assert all(e[3] for e in reduces)
                second = got["events"].index(("micro", 1))
                assert got["events"].index(reduces[0]) > second
                readies = [i for i, e in enumerate(got["events"]) if e[0] == "ready"]
                assert got["events"].index(reduces[0]) < max(readies)  # overlap
    # both ranks end with the same gradients
    for key, v in ranks[0].items():
        if key[1] != "local":
            for n, g in v["grads"].items():
                assert torch.equal(g, ranks[1][key]["grads"][n]), (key, n)


def _unused_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 leaves the second layer out of its loss: it has no gradient there."""
    import torch.distributed as dist

    from codex.train.distributed.backend import TorchBackend

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    backend = TorchBackend("cpu", torch.device("cpu"), rank, world)
    backend.set_grad_sync(model, True)
    x = torch.full((2, 4), float(rank + 1))
    (model(x) if rank == 0 else model[0](x)).sum().backward()
    backend.all_reduce_grads(model)
    torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_parameter_without_a_gradient_on_one_rank_gets_the_same_gradient_on_every_rank(tmp_path):
    """As DDP: rank 1 computed no gradient for the second layer, rank 0 did; both end with rank
    0's gradient / 2 there (else the replicas' optimizers step apart), and the same elsewhere."""
    import torch.multiprocessing as mp

    from tests.fixtures.procs import free_port

    mp.spawn(_unused_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    g0, g1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert g0.keys() == g1.keys()
    for n in g0:
        assert g0[n] is not None and torch.equal(g0[n], g1[n]), n
    assert g0["1.weight"].abs().sum() > 0
