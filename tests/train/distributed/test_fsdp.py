"""train.parallel=fsdp on the CPU (FSDP2, two gloo processes under torchrun) and its DCP
checkpoints: the same parameters as replicate and one process, each rank holding and writing half,
exact resume after SIGKILL, resume across layouts and world sizes, damaged-shard fallback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from codex.train.checkpoint import folders as checkpoint
from tests.fixtures.runs import (  # noqa: F401
    assert_close,
    child_env,
    final_model,
    make_run,
    one_thread,
    run_train,
    train_cli_args,
)

ROOT = Path(__file__).resolve().parents[3]

# lr 1e-3 as in test_train's equivalence test: at 1e-2 Adam's first steps amplify summation-order
# rounding in near-zero gradients to ~3e-5.
STEPS = dict(max_steps=5, lr=1e-3, device_batch=4)


def torchrun(run: str, nproc: int = 2, script: str | None = None, check: bool = True, **train_keys):
    target = [script, "--"] if script else ["-m", "codex.cli", "--", "train"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *target,
        *train_cli_args(run, **train_keys),
    ]
    proc = subprocess.run(
        cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def chunks(folder: str, key: str) -> list[tuple[list[int], list[int]]]:
    """(offsets, sizes) of every chunk DCP wrote for `key`: what each rank held."""
    md = FileSystemReader(folder).read_metadata().state_dict_metadata[key]
    return sorted((list(c.offsets), list(c.sizes)) for c in md.chunks)


@pytest.mark.slow
def test_fsdp_replicate_and_one_process_agree_and_each_rank_holds_half(tmp_path):
    runs = {n: make_run(tmp_path / n) for n in ("fsdp", "replicate", "one")}
    err = torchrun(runs["fsdp"], parallel="fsdp", **STEPS).stderr
    assert "fsdp over 2" in err
    assert "replicate" in torchrun(runs["replicate"], parallel="replicate", **STEPS).stderr
    # the same 8-row global batch in one process
    run_train(runs["one"], **{**STEPS, "device_batch": 8})
    one = final_model(runs["one"])
    assert_close(final_model(runs["fsdp"]), one, 1e-5)
    assert_close(final_model(runs["replicate"]), one, 1e-5)

    # Each fsdp rank held (and wrote) one half of every weight: two chunks split on dim 0.
    folder = checkpoint.step_dir(runs["fsdp"], 5)
    for key, t in one.items():
        half = t.shape[0] // 2
        rest = list(t.shape[1:])
        assert chunks(folder, f"model.{key}") == [
            ([0] + [0] * len(rest), [half] + rest),
            ([half] + [0] * len(rest), [half] + rest),
        ], key
    # The replicated run wrote each weight once, whole.
    assert all(
        len(chunks(checkpoint.step_dir(runs["replicate"], 5), f"model.{k}")) == 1 for k in one
    )


@pytest.mark.slow
def test_fsdp_with_accumulation_and_muon_matches_one_process(tmp_path):
    """Two micro-batches per step (one reduce-scatter, in the last backward) and Muon on sharded
    matrices (orthogonalised whole) against one process with the same 8-row global batch."""
    fsdp, one = make_run(tmp_path / "fsdp"), make_run(tmp_path / "one")
    keys = dict(STEPS, max_steps=3, device_batch=2, batch_tokens=8 * 16, optimizer="muon")
    torchrun(fsdp, parallel="fsdp", **keys)
    out = run_train(one, **{**keys, "device_batch": 8})
    assert out["accum"] == 1
    assert_close(final_model(fsdp), final_model(one), 1e-5)


@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_match_one_process(tmp_path):
    """train.fsdp_size=2 on 4 ranks: a 2-D mesh (2 replicas x 2 shards), FSDP2's HSDP path, with
    Muon's owner-rank exchange inside each replica's shard group. Each rank holds half of every
    weight (the checkpoint has two chunks per tensor, the replicas' copies written once), and the
    weights equal one process's on the same 8-row global batch."""
    hsdp, one = make_run(tmp_path / "hsdp"), make_run(tmp_path / "one")
    steps = dict(STEPS, max_steps=3, device_batch=2)
    err = torchrun(hsdp, nproc=4, parallel="fsdp", fsdp_size=2, **steps).stderr
    assert "fsdp over 2 x 2 replicas (HSDP)" in err
    run_train(one, **dict(steps, device_batch=8))
    want = final_model(one)
    assert_close(final_model(hsdp), want, 1e-5)
    folder = checkpoint.step_dir(hsdp, 3)
    for key, t in want.items():
        half, rest = t.shape[0] // 2, [0] * (t.dim() - 1)
        assert [c[0] for c in chunks(folder, f"model.{key}")] == [[0, *rest], [half, *rest]], key


KILL_IN_SAVE = """
import os, signal, sys
from codex.train.checkpoint import dcp as dcp_io
real = dcp_io.write_tree
def write_tree(folder, tree, control):
    records = real(folder, tree, control)
    if tree["step"] == {kill_step} and control.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)   # after writing its shards, before DONE
    return records
dcp_io.write_tree = write_tree
from codex.cli.__main__ import main
sys.exit(main(["train", *[a for a in sys.argv[1:] if a != "--"]]))
"""


@pytest.mark.slow
def test_fsdp_sigkill_then_resume_is_bitwise_identical(tmp_path):
    # accum 2
    keys = dict(
        max_steps=8, save_every=2, parallel="fsdp", device_batch=2, batch_tokens=2 * 2 * 16 * 2
    )
    ref, run = make_run(tmp_path / "ref"), make_run(tmp_path / "killed")
    torchrun(ref, **keys)
    script = tmp_path / "kill.py"
    script.write_text(KILL_IN_SAVE.format(kill_step=6))
    killed = torchrun(run, script=str(script), check=False, **keys)
    assert killed.returncode != 0
    assert checkpoint.latest_step(run) == 4  # step 6 has its shards but no DONE
    assert (Path(checkpoint.step_dir(run, 6)) / "__0_0.distcp").exists()
    err = torchrun(run, **keys).stderr
    assert "rank 1/2: resumed from step 4" in err
    a, b = checkpoint.load(ref), checkpoint.load(run)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for fqn, st in a["optimizer"]["adamw"]["state"].items():
        for name, t in st.items():
            assert torch.equal(t, b["optimizer"]["adamw"]["state"][fqn][name]), (fqn, name)
    assert a["loader"] == b["loader"] and a["log_window"] == b["log_window"]
    assert set(a["rng"]) == {"rank_0", "rank_1"}  # one RNG state per rank
    assert checkpoint.complete_steps(run) == [4, 6, 8]


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_one_process_and_under_replicate(tmp_path):
    full = make_run(tmp_path / "full")
    torchrun(full, parallel="fsdp", max_steps=6, save_every=3, device_batch=4)
    final = final_model(full)
    # Each rank wrote only its own part: two shard files of about half the tensor bytes each.
    files = checkpoint_files(full, 3)
    sizes = [files[f]["bytes"] for f in ("__0_0.distcp", "__1_0.distcp")]
    assert set(files) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json"}
    assert abs(sizes[0] - sizes[1]) < 0.05 * sum(sizes), sizes

    for name, how in (("one", None), ("replicate", "replicate")):
        resumed = str(tmp_path / name)
        shutil.copytree(full, resumed)
        shutil.rmtree(checkpoint.step_dir(resumed, 6))
        if how is None:
            out = run_train(resumed, max_steps=6, save_every=3, device_batch=8)
            assert out["step"] == 6
        else:
            err = torchrun(resumed, parallel=how, max_steps=6, save_every=3, device_batch=4).stderr
            assert "rank 1/2: resumed from step 3" in err
        assert_close(final_model(resumed), final, 1e-6)


def checkpoint_files(run: str, step: int) -> dict:
    import json

    return json.loads((Path(checkpoint.step_dir(run, step)) / "DONE").read_text())["files"]


@pytest.mark.slow
def test_a_damaged_shard_in_the_newest_checkpoint_makes_every_rank_use_the_previous(tmp_path):
    run = make_run(tmp_path / "run")
    torchrun(run, parallel="fsdp", max_steps=4, save_every=2, device_batch=4)
    shard = Path(checkpoint.step_dir(run, 4)) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    err = torchrun(run, parallel="fsdp", max_steps=6, save_every=2, device_batch=4).stderr
    assert "damaged" in err and "__1_0.distcp" in err
    for r in (0, 1):
        assert f"rank {r}/2: resumed from step 2 " in err, err[-3000:]
    assert checkpoint.complete_steps(run) == [2, 4, 6]  # step 4 rewritten by the resumed run


@pytest.mark.slow
def test_fsdp_size_must_divide_the_world_and_every_kind_takes_fsdp():
    from codex.core.config import ConfigError, build_config
    from codex.train.plan.layout import layout_for
    from codex.train.plan.memory import setting_for

    with pytest.raises(ConfigError, match="train.fsdp_size=3 must divide the world size 4"):
        layout_for("fsdp", 3, 4)
    layout = layout_for("fsdp", 2, 4)
    assert (layout.shard, layout.replicas) == (2, 2) and "HSDP" in layout.describe()
    assert (layout_for("fsdp", 0, 4).shard, layout_for("fsdp", 0, 4).replicas) == (4, 1)
    assert not layout_for("fsdp", 0, 1).sharded  # one process: nothing to shard
    assert not layout_for("replicate", 0, 4).sharded
    tcfg = build_config(overrides=["train.parallel=fsdp", "train.fsdp_size=2"]).train
    assert setting_for(tcfg, "cuda").layout == "fsdp" and setting_for(tcfg, "cuda").fsdp_size == 2
    assert setting_for(tcfg, "tpu").layout == "fsdp"  # XLA SPMD (train/xla/sharding.py)
    auto = build_config(overrides=[]).train
    assert setting_for(auto, "tpu").layout == "auto"  # resolved by the memory plan, as on CUDA


@pytest.mark.slow
def test_async_save_writes_what_a_blocking_save_writes(tmp_path):
    """train.async_save on 2 fsdp ranks: the periodic checkpoints are written by each rank's
    writer process (its own gloo group) while training goes on, from a copy taken at the step:
    every checkpoint equals the blocking run's bitwise."""
    keys = dict(parallel="fsdp", max_steps=6, save_every=2, keep_last=5, device_batch=4)
    sync, background = make_run(tmp_path / "sync"), make_run(tmp_path / "async")
    torchrun(sync, **keys)
    err = torchrun(background, async_save=True, **keys).stderr
    assert "checkpoint (periodic): " in err and "(writing in the background)" in err
    assert checkpoint.complete_steps(background) == checkpoint.complete_steps(sync) == [2, 4, 6]
    for step in (2, 4, 6):
        a, b = checkpoint.load(sync, step), checkpoint.load(background, step)
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (step, k)
        for fqn, st in a["optimizer"]["adamw"]["state"].items():
            for name, t in st.items():
                assert torch.equal(t, b["optimizer"]["adamw"]["state"][fqn][name]), (
                    step,
                    fqn,
                    name,
                )


# --- FSDP2's precision, ZeRO-2 / ZeRO-3 and the compiled head, on 2 gloo ranks in-process -------


@pytest.mark.slow
def test_the_fsdp_backend_computes_without_autocast_when_the_policy_casts():
    """Under fsdp the MixedPrecisionPolicy casts (bf16 weights and block inputs): autocast on top
    would cast again, so the backend's context is a null one; replicate keeps bf16 autocast."""
    from codex.train.distributed.backend import TorchBackend
    from codex.train.plan.layout import Layout

    cpu = torch.device("cpu")
    for layout, on in ((Layout("fsdp", shard=2), False), (Layout("replicate"), True)):
        backend = TorchBackend("cpu", cpu, 0, 2, autocast_dtype=torch.bfloat16, layout=layout)
        with backend.autocast():
            assert torch.is_autocast_enabled("cpu") is on, layout


def _tiny_batch():
    from codex.core.config import build_config
    from tests.fixtures.runs import TINY_MODEL, VOCAB

    m = build_config(overrides=TINY_MODEL).model
    m.vocab_size = VOCAB
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (4, 16), generator=gen) for _ in range(2))
    return m, x, y


def _sharded_bf16_step(rank: int, world: int, port: int, out: str) -> None:
    """One forward + backward of the tiny model under fsdp over `world` gloo ranks in bf16 (the
    backend's model and autocast context), every rank on the same batch: ZeRO-3, ZeRO-2, and
    ZeRO-2 with GPT.head_loss compiled (inductor on the CPU). Rank 0 saves what it saw."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from codex.train.distributed.backend import TorchBackend
    from codex.train.distributed.fsdp import compile_head
    from codex.train.plan.layout import Layout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    m, x, y = _tiny_batch()
    seen = {}
    for name, reshard, compiled in (
        ("zero3", True, False),
        ("zero2", False, False),
        ("compiled", False, True),
    ):
        layout = Layout("fsdp", shard=world, reshard_after_forward=reshard)
        cpu = torch.device("cpu")
        backend = TorchBackend("cpu", cpu, rank, world, autocast_dtype=torch.bfloat16)
        model = backend.build_model(m, 0, layout)
        if compiled:
            compile_head(model)
        with backend.autocast():
            autocast = torch.is_autocast_enabled("cpu")
            loss = model(x, y)
        # after the forward: is each block's registered weight its shard (resharded) or the
        # gathered bf16 copy, kept for the backward?
        kept = [not isinstance(b.attn.c_q.weight, DTensor) for b in model.blocks]
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad(), backend.autocast():  # validation's reduction
            per_token = model(x, y, reduction="none")
        seen[name] = {
            "autocast": autocast,
            "kept": kept,
            "loss": loss.detach(),
            "per_token": per_token,
            "grads": grads,
            "keys": list(model.state_dict()),
        }
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_bf16_zero2_zero3_and_the_compiled_head_match_replicated_autocast(tmp_path):
    """train.dtype=bf16 under fsdp on 2 gloo ranks: no autocast (the policy casts), yet the loss is
    the replicated model's under bf16 autocast and the gradients agree within bf16 rounding.
    reshard_after_forward=True (ZeRO-3) frees a block's gathered weights after its forward (the
    last block's kept, as the backward needs it first); False (ZeRO-2) keeps every block's, with
    the same numbers. The compiled head + loss gives eager's loss and keeps the state_dict keys."""
    import torch.multiprocessing as mp

    from codex.model.gpt import build_model
    from tests.fixtures.procs import free_port

    out = str(tmp_path / "seen.pt")
    mp.spawn(_sharded_bf16_step, args=(2, free_port(), out), nprocs=2)
    seen = torch.load(out)
    m, x, y = _tiny_batch()
    ref = build_model(m, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(x, y)
    loss.backward()
    fp32_loss = build_model(m, 0)(x, y).detach()
    assert {k: s["kept"] for k, s in seen.items()} == {
        "zero3": [False, True],
        "zero2": [True, True],
        "compiled": [True, True],
    }
    for name, s in seen.items():
        assert s["autocast"] is False, name
        assert s["keys"] == list(ref.state_dict()), name  # no '_orig_mod.'
        # the same bf16 numbers as autocast: measured equal (fp32 differs by ~2e-5)
        assert abs(s["loss"] - loss.detach()) < 1e-3, (name, s["loss"], loss)
        assert s["loss"] != fp32_loss, name  # it did compute in bf16
        for n, p in ref.named_parameters():  # gradients up to ~0.1; bf16 rounding ~1e-3
            assert (s["grads"][n] - p.grad).abs().max() < 5e-3, (name, n)
    assert torch.equal(seen["zero2"]["loss"], seen["zero3"]["loss"])
    for n in seen["zero2"]["grads"]:
        assert torch.equal(seen["zero2"]["grads"][n], seen["zero3"]["grads"][n]), n
    # compiled head + cross-entropy (inductor's kernels): eager's losses, mean and per token
    assert abs(seen["compiled"]["loss"] - seen["zero2"]["loss"]) < 1e-3
    assert (seen["compiled"]["per_token"] - seen["zero2"]["per_token"]).abs().max() < 1e-2
    assert torch.allclose(seen["zero2"]["per_token"].mean(), seen["zero2"]["loss"], atol=1e-5)
