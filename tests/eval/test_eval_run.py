"""`codex eval` on a run directory: run_eval's JSON record, --data, ranks (W=1 vs W=2 on gloo),
sampling, the loss plot, the commands, and training's validation against codex eval of its
checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codex.eval.evaluate import evaluate, summarize
from tests.fixtures import ROOT
from tests.fixtures.evaluation import (  # noqa: F401
    VAL_DOCS,
    batched,
    eval_cfg,
    make_eval_run,
    make_tokenizer,
    tiny_cfg,
    token_bytes_of,
    windows,
    write_metrics,
)

torch.set_num_threads(1)


# --- a run directory per the contracts: tokenizer, shards, checkpoint -----------------------------


def test_run_eval_writes_the_json_record_and_matches_evaluate(tmp_path, capsys):
    from codex.eval.run import run_eval

    T = 8
    run, tok, model = make_eval_run(tmp_path, T=T)
    ids = np.load(os.path.join(run, "shards", "val_00000.npy")).astype(np.int64).tolist()
    x, y = windows(ids, T)
    ref = evaluate(model, batched(x, y, 5), token_bytes_of(tok))

    rec = run_eval(eval_cfg(run, batch=3))
    out = json.loads(Path(run, "eval", "step_7.json").read_text())
    schema = {
        "step": int,
        "tokens": int,
        "bytes": int,
        "loss": float,
        "perplexity": float,
        "bits_per_byte": float,
        "split": str,
        "checkpoint": str,
        "world_size": int,
        "backend": str,
        "timestamp": str,
        "config_fingerprint": str,
        "seq_len": int,
        "device_batch": int,
    }
    for key, typ in schema.items():
        assert isinstance(out[key], typ), (key, out.get(key))
    assert out["step"] == 7 and out["split"] == "val" and out["data"] is None
    assert out["world_size"] == 1 and out["backend"] == "cpu" and out["seq_len"] == T
    assert out["checkpoint"].endswith("step_00000007")
    assert len(out["config_fingerprint"]) == 16
    assert out["tokens"] == len(x) * T == ref["tokens"]  # every window exactly once
    assert out["bytes"] == ref["bytes"]
    for k in ("loss", "perplexity", "bits_per_byte"):
        assert out[k] == pytest.approx(ref[k], rel=1e-6)
        assert rec[k] == out[k]
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]), rel=1e-9)
    table = capsys.readouterr().out
    assert "bits per byte" in table and f"{out['bits_per_byte']:.4f}" in table

    # --max-tokens: only the first max_tokens // T windows
    rec = run_eval(eval_cfg(run, batch=3, max_tokens=3 * T + 5))
    ref3 = evaluate(model, [(x[:3], y[:3])], token_bytes_of(tok))
    assert rec["tokens"] == 3 * T and rec["max_tokens"] == 3 * T + 5
    assert rec["loss"] == pytest.approx(ref3["loss"], rel=1e-6)


def test_run_eval_on_other_text_tokenizes_it_with_the_run_tokenizer(tmp_path):
    from codex.eval.run import run_eval
    from codex.pipeline.clean.filters import normalize

    T = 8
    run, tok, model = make_eval_run(tmp_path, T=T)
    docs = ["Café ✓ in Köln\r\nand the lazy dog.", "return a + b  # déjà vu"]
    data = tmp_path / "heldout"
    data.mkdir()
    for i, d in enumerate(docs):
        (data / f"doc{i}.txt").write_bytes(d.encode("utf-8"))
    (data / "empty.txt").write_text("")

    rec = run_eval(eval_cfg(run, data=[str(data)]))
    # by hand: each normalised document is <|bos|> + tokens, concatenated in file order
    ids = []
    for d in docs:
        ids += [0] + tok.encode(normalize(d)[0]).ids
    x, y = windows(ids, T)
    ref = evaluate(model, [(x, y)], token_bytes_of(tok))
    assert rec["documents"] == 2
    assert rec["tokens"] == ref["tokens"] == len(x) * T
    assert rec["bytes"] == ref["bytes"]
    assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert rec["split"] is None and rec["data"] == [str(data)]
    written = [p.name for p in Path(run, "eval").iterdir()]
    # the val result is not overwritten
    assert len(written) == 1 and written[0].startswith("step_7.data-")

    with pytest.raises(FileNotFoundError, match="no such file"):
        run_eval(eval_cfg(run, data=[str(tmp_path / "missing.txt")]))


def test_run_eval_names_a_missing_checkpoint(tmp_path):
    from codex.eval.run import run_eval

    run, _, _ = make_eval_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="step_00000099"):
        run_eval(eval_cfg(run, checkpoint="99"))


def test_fixed_shape_masked_batches_across_ranks_cover_every_window_once(tmp_path):
    """The XLA path: val_batches(with_mask=True) gives every rank the same number of full batches;
    the per-rank sums (what all_reduce_sum adds up) equal one process's numbers."""
    from codex.train.data.loader import val_batches

    T = 8
    run, tok, model = make_eval_run(tmp_path, T=T)
    tb = token_bytes_of(tok)
    shards = os.path.join(run, "shards")
    single = evaluate(model, val_batches(shards, T, 3), tb)
    nats = tokens = nbytes = 0
    counts = []
    for rank in range(2):
        batches = list(val_batches(shards, T, 3, rank=rank, world_size=2, with_mask=True))
        counts.append(len(batches))
        assert all(len(b) == 3 and b[0].shape == (3, T) for b in batches)
        r = evaluate(model, batches, tb)
        nats, tokens, nbytes = (
            nats + r["loss"] * r["tokens"],
            tokens + r["tokens"],
            nbytes + r["bytes"],
        )
    assert counts[0] == counts[1]
    combined = summarize(nats, tokens, nbytes)
    assert combined["tokens"] == single["tokens"] and combined["bytes"] == single["bytes"]
    for k in ("loss", "perplexity", "bits_per_byte"):
        assert combined[k] == pytest.approx(single[k], rel=1e-6)


# --- W=1 vs W=2 (gloo) ----------------------------------------------------------------------------

_RANK_SCRIPT = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from codex.core.config import Config
from codex.eval.run import run_eval

cfg = Config()
cfg.run = os.environ["EVAL_RUN"]
cfg.train.hardware = "cpu"
cfg.eval.device_batch = 3
r = run_eval(cfg)
assert r["world_size"] == int(os.environ.get("WORLD_SIZE", "1")), r["world_size"]
print("RESULT " + json.dumps(r))
"""


def _launch(world: int, port: int, run: str) -> list[dict]:
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
            EVAL_RUN=run,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT],
                env=env,
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank failed (rc={p.returncode}):\n{out}\n{err[-4000:]}"
        results.append(json.loads(next(s for s in out.splitlines() if s.startswith("RESULT "))[7:]))
    return results


@pytest.mark.slow
def test_world_size_1_and_2_give_the_same_numbers(tmp_path):
    from codex.eval.run import run_eval
    from tests.fixtures.procs import free_port

    T = 8
    run, _, _ = make_eval_run(tmp_path, T=T)
    n_windows = (len(np.load(os.path.join(run, "shards", "val_00000.npy"))) - 1) // T
    assert n_windows % 6, "want a last step that is not full across 2 ranks x batch 3"
    single = run_eval(eval_cfg(run, batch=3))
    both = _launch(2, free_port(), run)
    assert single["tokens"] == n_windows * T
    for r in both:  # every rank returns the global (all-reduced) numbers
        assert r["world_size"] == 2
        assert r["tokens"] == single["tokens"]
        assert r["bytes"] == single["bytes"]
        for k in ("loss", "perplexity", "bits_per_byte"):
            assert r[k] == pytest.approx(single[k], rel=1e-5, abs=1e-5)
    # rank 0 wrote it
    assert json.loads(Path(run, "eval", "step_7.json").read_text())["world_size"] == 2


# --- the commands ---------------------------------------------------------------------------------


def test_cli_eval_and_sample(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    run, tok, model = make_eval_run(tmp_path)
    write_metrics(
        Path(run),
        [
            '{"kind": "train", "step": 1, "tokens": 16, "loss": 5.7}',
            '{"kind": "val", "step": 1, "tokens": 16, "loss": 5.6}',
        ],
    )
    r = CliRunner().invoke(cli, ["eval", "--run", run, "--device-batch", "4", "--max-tokens", "40"])
    assert r.exit_code == 0, r.output
    out = json.loads(Path(run, "eval", "step_7.json").read_text())
    assert out["tokens"] == 40 and out["device_batch"] == 4
    assert "perplexity" in r.output and Path(run, "eval", "loss.png").exists()

    r = CliRunner().invoke(
        cli,
        [
            "sample",
            "--run",
            run,
            "--prompt",
            "The quick",
            "--temperature",
            "0",
            "--max-new-tokens",
            "5",
        ],
    )
    assert r.exit_code == 0, r.output
    from codex.eval.sample import sample

    assert r.output.rstrip("\n") == sample(model, tok, "The quick", max_new_tokens=5, temperature=0)

    r = CliRunner().invoke(cli, ["eval", "--run", run, "--checkpoint", "3"])
    assert r.exit_code == 2 and "step_00000003" in r.output


@pytest.mark.slow
def test_training_loop_validation_equals_codex_eval_of_its_checkpoint(tmp_path):
    """train/loop.py validates with the same evaluate(): its last val loss is what `codex eval`
    reports for the final checkpoint, and the trained model beats the untrained one."""
    import shutil

    from codex.core.config import Config
    from codex.eval.evaluate import evaluate
    from codex.eval.run import run_eval
    from codex.train.loop import train

    run, _, _ = make_eval_run(tmp_path, T=8)
    untrained = run_eval(eval_cfg(run, batch=3))
    shutil.rmtree(os.path.join(run, "checkpoints"))
    shutil.rmtree(os.path.join(run, "eval"))
    cfg = Config()
    cfg.run = run
    cfg.model = tiny_cfg(0)
    cfg.train.hardware, cfg.train.wandb = "cpu", "off"
    cfg.train.seq_len, cfg.train.device_batch, cfg.train.max_steps = 8, 4, 20
    cfg.train.eval_every, cfg.train.log_every, cfg.train.warmup_steps = 10, 5, 2
    result = train(cfg, evaluate)
    rec = run_eval(eval_cfg(run, batch=3))
    assert rec["step"] == 20
    for k in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes"):
        assert rec[k] == pytest.approx(result["val"][k], rel=1e-6)
    assert rec["loss"] < untrained["loss"] - 0.3
    assert Path(run, "eval", "loss.png").exists()


@pytest.mark.slow
@pytest.mark.gcs
def test_run_eval_and_plot_on_gcs(tmp_path, gcs_bucket):
    from codex.core import fsio
    from codex.eval.run import run_eval

    local, _, _ = make_eval_run(tmp_path, T=8)
    write_metrics(
        Path(local),
        [
            '{"kind": "train", "step": 1, "tokens": 16, "loss": 5.7}',
            '{"kind": "val", "step": 1, "tokens": 16, "loss": 5.6}',
        ],
    )
    want = run_eval(eval_cfg(local, batch=3))
    run = f"{gcs_bucket}/run"
    for path in Path(local).rglob("*"):
        if path.is_file() and "eval" not in path.parts:
            fsio.upload(str(path), fsio.join(run, str(path.relative_to(local))))
    got = run_eval(eval_cfg(run, batch=3))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-9) and got["tokens"] == want["tokens"]
    assert fsio.read_json(f"{run}/eval/step_7.json")["bits_per_byte"] == pytest.approx(
        want["bits_per_byte"]
    )
    assert fsio.read_bytes(f"{run}/eval/loss.png")[:4] == b"\x89PNG"


@pytest.mark.xla
@pytest.mark.slow
def test_spmd_4_devices_equals_eager(tmp_path):
    """run_eval on the XLA SPMD path (4 virtual CPU devices, masked fixed-shape batches, the sums
    reduced by the partitioner) gives the eager CPU numbers."""
    pytest.importorskip("torch_xla")
    from codex.eval.run import run_eval
    from tests.fixtures.procs import run_xla

    run, _, _ = make_eval_run(tmp_path, T=8, train_steps=5)
    eager = run_eval(eval_cfg(run, batch=1))
    out = run_xla(
        f"""
import json
from codex.core.config import Config
from codex.eval.run import run_eval
cfg = Config()
cfg.run = {run!r}
cfg.train.hardware, cfg.train.allow_cpu_xla, cfg.train.dtype = "v6e-4", True, "fp32"
cfg.train.xla_cache = {str(tmp_path / "xla_cache")!r}
cfg.eval.device_batch = 1
r = run_eval(cfg)
print("RESULT " + json.dumps(r))
""",
        devices=4,
    )
    xla = json.loads(next(s for s in out.stdout.splitlines() if s.startswith("RESULT "))[7:])
    assert xla["backend"] == "xla" and xla["world_size"] == 4
    assert xla["tokens"] == eager["tokens"] and xla["bytes"] == eager["bytes"]
    for k in ("loss", "perplexity", "bits_per_byte"):
        assert xla[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-5)
