"""Loss, perplexity and bits per byte of a model on a stream of (x, y) batches.

    result = evaluate(model, batches, token_bytes, backend)
    # {"loss": 3.1, "perplexity": 22.2, "bits_per_byte": 1.05, "tokens": 1048576, "bytes": 4300000}

`evaluate` is the one function behind both `codex eval` and the training loop's periodic
validation, so the two can never disagree on what "val loss" means.

What is summed, per rank, on the device (no host transfer inside the loop, which on XLA would
cut the graph and stall every batch):
    nats   = sum of per-token cross-entropy losses (fp32 from the model, accumulated in fp64
             where the device has it; XLA/TPU has no fast fp64, so fp32 there)
    tokens = number of target tokens
    bytes  = UTF-8 bytes of the target tokens, token_bytes[y] (special tokens count 0)
The three sums are all-reduced across ranks once at the end (backend.all_reduce_sum), then
    loss = nats / tokens,  perplexity = exp(loss),  bits_per_byte = nats / (ln 2 * bytes)
Perplexity depends on the tokenizer, bits per byte does not (NOTES.md section 5): report both.

A batch is (x, y) or (x, y, mask): `mask` is a per-row bool [B] for fixed-shape final batches
(XLA compiles one graph per shape, so the last partial batch is padded with rows that count 0).

`run_eval` is the `codex eval` command: checkpoint -> model -> validation split (or any text
via --data) -> RUN/eval/step_N.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import tempfile
import time

import numpy as np
import torch

from codex import fsio, rundir
from pipeline.encode import Encoder, token_dtype
from pipeline.filters import normalize
from pipeline.inputs import list_inputs
from pipeline.readers import FileReport, read_records
from pipeline.shard import write_npy
from pipeline.shard_manifest import FORMAT_VERSION, MANIFEST, shard_entry, shard_name
from pipeline.tokenizer import load_tokenizer
from codex.progress import Progress, setup_logging
from pipeline.tokenizer import load_meta, load_token_bytes
from train.backend import loader_layout, make_backend, unwrap
from train.loader import val_batches
from train.token_shards import load_split

log = logging.getLogger("codex.eval")

LN2 = math.log(2.0)


def evaluate(model, batches, token_bytes: torch.Tensor, backend=None, progress=None) -> dict:
    """Mean loss, perplexity and bits per byte of `model` over every batch in `batches`.

    model:       forward(x, targets=y, reduction="none") -> per-token losses [B, T] (fp32)
    batches:     iterable of (x, y) or (x, y, row_mask) int64 [B, T] tensors (host or device)
    token_bytes: [vocab_size] UTF-8 byte length of every token id, 0 for special tokens
    backend:     train.backend object; when given, batches are moved with backend.to_device,
                 the forward runs under backend.autocast(), and the sums are all-reduced with
                 backend.all_reduce_sum (so every rank returns the global numbers)
    progress:    optional codex.progress.Progress, advanced by one per batch (tokens counted)
    """
    device = _model_device(model)
    # fp64 accumulation keeps the sum exact enough over billions of tokens; TPUs have no fp64.
    acc_dtype = torch.float32 if device.type == "xla" else torch.float64
    # Plain .to(device), not backend.to_device: under XLA SPMD to_device shards dim 0 as the batch.
    token_bytes = token_bytes.to(device=device, dtype=torch.int64)
    nats = torch.zeros((), dtype=acc_dtype, device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                x, y, mask = _unpack(batch)
                x, y, mask = _to_device(x, y, mask, device, backend)
                with _autocast(backend):
                    losses = model(x, targets=y, reduction="none")
                losses = losses.float()
                if losses.shape != y.shape:
                    raise ValueError(f"model returned per-token losses of shape {tuple(losses.shape)} "
                                     f"for targets of shape {tuple(y.shape)}; expected reduction='none' to give [B, T]")
                target_bytes = token_bytes[y]
                if mask is None:
                    nats += losses.to(acc_dtype).sum()
                    tokens += y.numel()
                    nbytes += target_bytes.sum()
                else:
                    keep = mask.to(torch.bool)[:, None]
                    # where(), not multiply: a padded row must count 0 even if its loss were inf/nan.
                    nats += torch.where(keep, losses, torch.zeros_like(losses)).to(acc_dtype).sum()
                    tokens += keep.sum() * y.shape[1]
                    nbytes += torch.where(keep, target_bytes, torch.zeros_like(target_bytes)).sum()
                if backend is not None:
                    backend.step_boundary()  # XLA: one graph cut per batch; eager: nothing
                if progress is not None:
                    progress.update(1, tokens=y.numel())
    finally:
        model.train(was_training)

    if backend is not None:
        nats = backend.all_reduce_sum(nats)
        tokens = backend.all_reduce_sum(tokens)
        nbytes = backend.all_reduce_sum(nbytes)
    # The only host transfers: three scalars, once.
    nats_v, tokens_v, bytes_v = float(nats.cpu()), int(tokens.cpu()), int(nbytes.cpu())
    if tokens_v == 0:
        raise ValueError("evaluate: no tokens to evaluate (empty batches or every row masked out)")
    return summarize(nats_v, tokens_v, bytes_v)


def summarize(nats: float, tokens: int, nbytes: int) -> dict:
    """The reported numbers from the three global sums."""
    loss = nats / tokens
    return {
        "loss": loss,
        # written so that a NaN loss stays NaN (a diverged model must not read as merely "inf")
        "perplexity": math.inf if loss > 709 else math.exp(loss),
        # bytes is 0 only when every target is a special token: bits per byte is undefined then.
        "bits_per_byte": nats / (LN2 * nbytes) if nbytes > 0 else math.nan,
        "tokens": tokens,
        "bytes": nbytes,
    }


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _to_device(x, y, mask, device: torch.device, backend):
    if backend is None:
        return x.to(device), y.to(device), (None if mask is None else mask.to(device))
    if mask is None:
        x, y = backend.to_device((x, y))
        return x, y, None
    return backend.to_device((x, y, mask))


def _autocast(backend):
    if backend is None:
        return contextlib.nullcontext()
    return backend.autocast()


def _unpack(batch):
    if isinstance(batch, dict):
        return batch["x"], batch["y"], batch.get("mask")
    if len(batch) == 2:
        x, y = batch
        return x, y, None
    if len(batch) == 3:
        return batch
    raise ValueError(f"evaluate: a batch must be (x, y) or (x, y, row_mask), got {len(batch)} items")


# --- codex eval -----------------------------------------------------------------------------------

def trained_seq_len(run_cfg) -> int:
    """The sequence length the checkpoint was trained with: evaluate at the same context length,
    or the numbers are not comparable with the training curve."""
    from train.hardware import device_defaults, get_preset

    if run_cfg.train.seq_len > 0:
        return int(run_cfg.train.seq_len)
    return device_defaults(get_preset(run_cfg.train.hardware), run_cfg.model)[1]


def eval_batch_size(cfg, run_cfg) -> int:
    """eval.device_batch, else this hardware preset's training device batch for the model."""
    from train.hardware import device_defaults, get_preset

    if cfg.eval.device_batch > 0:
        return int(cfg.eval.device_batch)
    return device_defaults(get_preset(cfg.train.hardware), run_cfg.model)[0]


def _check_tokenizer(run: str, state: dict) -> None:
    """Refuse a checkpoint whose tokenizer is not the run's current one (retrained after training):
    its ids would decode to the wrong text and bits per byte would count the wrong bytes."""
    from codex import fsio, rundir
    from pipeline.tokenizer import load_meta
    from train import checkpoint as ckpt

    trained_with = state.get("tokenizer_sha256")
    tok_dir = rundir.tokenizer_dir(run)
    if not trained_with or not fsio.exists(fsio.join(tok_dir, "tokenizer_meta.json")):
        return   # checkpoints from before this record, or a run without its tokenizer (later steps say so)
    current = str(load_meta(tok_dir).get("sha256", ""))
    if current != trained_with:
        raise ValueError(f"{fsio.join(tok_dir, 'tokenizer.json')} (sha256 {current[:12]}) is not the tokenizer "
                         f"{ckpt.step_dir(run, int(state['step']))} was trained with ({trained_with[:12]}): it was "
                         "retrained after training; restore the original tokenizer or retrain the model")


def load_model(cfg, checkpoint: str | int = "latest"):
    """(model on the CPU in eval mode, the checkpoint's Config, checkpoint info) for cfg.run."""
    from codex.config import from_dict
    from model.gpt import build_model
    from train import checkpoint as ckpt

    state = ckpt.load(cfg.run, checkpoint)
    run_cfg = from_dict(state["config"])
    if run_cfg.model.vocab_size <= 0:
        raise ValueError(f"{ckpt.step_dir(cfg.run, int(state['step']))}: the checkpoint's config has no model.vocab_size")
    _check_tokenizer(cfg.run, state)
    model = build_model(run_cfg.model, seed=run_cfg.train.seed)
    model.load_state_dict(state["model"])
    model.eval()
    info = {
        "step": int(state["step"]),
        "train_tokens": int(state.get("tokens", 0)),
        "path": ckpt.step_dir(cfg.run, int(state["step"])),
        # Which exact run configuration produced these weights (model + data + training settings).
        "config_fingerprint": hashlib.sha256(json.dumps(state["config"], sort_keys=True, default=str)
                                             .encode()).hexdigest()[:16],
    }
    return model, run_cfg, info


def run_eval(cfg) -> dict:
    """`codex eval`: loss / perplexity / bits per byte of checkpoint cfg.eval.checkpoint on the
    pinned val split, or on other text (cfg.eval.data, cleaned and tokenized on the fly with the
    run's tokenizer), at most cfg.eval.max_tokens tokens (0 = all).

    Runs on cfg.train.hardware (CPU, CUDA under torchrun, XLA); every rank returns the same
    global numbers. Rank 0 writes RUN/eval/step_N.json (or step_N.data-<hash>.json for --data)
    and prints a small table. Returns the record written.
    """
    setup_logging()
    backend = make_backend(cfg)
    ok = False
    try:
        out = _run_eval(cfg, backend)
        ok = True
        return out
    finally:
        backend.close(ok)   # no clean-exit barrier after a failure: peers would wait in a collective


def _run_eval(cfg, backend) -> dict:
    data_paths, max_tokens = list(cfg.eval.data), cfg.eval.max_tokens
    model, run_cfg, info = load_model(cfg, cfg.eval.checkpoint)
    tok_dir = rundir.tokenizer_dir(cfg.run)
    token_bytes = torch.from_numpy(load_token_bytes(tok_dir).astype("int64"))
    if len(token_bytes) != run_cfg.model.vocab_size:
        raise ValueError(f"{fsio.join(tok_dir, 'token_bytes.npy')}: {len(token_bytes)} tokens, but the checkpoint "
                         f"{info['path']} was trained with model.vocab_size={run_cfg.model.vocab_size}")
    T, B = trained_seq_len(run_cfg), eval_batch_size(cfg, run_cfg)
    # The same layout as training's validation (train/loop.py): one loader per data-loading
    # process (under XLA SPMD one per host, feeding all its chips), and on XLA full batches with a
    # row mask, since XLA compiles one graph per shape.
    rank, world, rows = loader_layout(backend, B)
    with_mask = backend.fixed_shapes
    model = unwrap(backend.prepare_model(model))

    if data_paths:
        shards_dir, tmp, documents = _tokenize_to_shard(cfg, run_cfg, tok_dir, data_paths, max_tokens, T, backend)
    else:
        shards_dir, tmp, documents = _val_shards(cfg.run, tok_dir), None, None
    try:
        windows = load_split(shards_dir, "val", T).windows
        if max_tokens > 0:
            windows = min(windows, max(1, max_tokens // T))
        steps = -(-windows // (rows * world))
        batches = val_batches(shards_dir, seq_len=T, batch_size=rows, rank=rank, world_size=world,
                              max_tokens=max_tokens, with_mask=with_mask)
        with Progress("eval", total=steps, unit="batches", enabled=backend.is_main) as progress:
            result = evaluate(model, batches, token_bytes, backend=backend, progress=progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    record = _eval_record(cfg, backend, info, result, T=T, B=B, documents=documents)
    if backend.is_main:
        _write_record(cfg, record, info["step"])
    return record


def _val_shards(run: str, tok_dir: str) -> str:
    """RUN/shards, checked to be made with the run's tokenizer (when its manifest says which)."""
    shards_dir = rundir.shards_dir(run)
    manifest_path = fsio.join(shards_dir, "manifest.json")
    manifest = fsio.read_json(manifest_path) if fsio.exists(manifest_path) else None
    meta = load_meta(tok_dir)
    if manifest and manifest.get("tokenizer", {}).get("sha256") not in (None, meta.get("sha256")):
        raise ValueError(f"{manifest_path}: the shards were made with another tokenizer "
                         f"({manifest['tokenizer']['sha256'][:12]}) than {tok_dir} ({meta.get('sha256', '')[:12]})")
    return shards_dir


def _eval_record(cfg, backend, info: dict, result: dict, *, T: int, B: int, documents) -> dict:
    data_paths = list(cfg.eval.data)
    return {
        "step": info["step"],
        "tokens": result["tokens"],
        "bytes": result["bytes"],
        "loss": result["loss"],
        "perplexity": result["perplexity"],
        "bits_per_byte": result["bits_per_byte"],
        "split": None if data_paths else "val",
        "data": data_paths or None,
        "documents": documents,
        "max_tokens": int(cfg.eval.max_tokens),
        "seq_len": T,
        "device_batch": B,
        "checkpoint": info["path"],
        "train_tokens": info["train_tokens"],
        "world_size": backend.world_size,
        "backend": backend.device.type,   # cpu, cuda or xla
        "hardware": cfg.train.hardware,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config_fingerprint": info["config_fingerprint"],
    }


def _write_record(cfg, record: dict, step: int) -> None:
    """Rank 0: RUN/eval/step_N.json (a --data result never overwrites the val split's), the table,
    and the loss plot; adds their paths to `record`."""
    name = f"step_{step}.json"
    if cfg.eval.data:
        key = hashlib.sha256(json.dumps(sorted(cfg.eval.data)).encode()).hexdigest()[:8]
        name = f"step_{step}.data-{key}.json"
    out = fsio.join(rundir.eval_dir(cfg.run), name)
    fsio.makedirs(rundir.eval_dir(cfg.run))
    fsio.write_json(out, _json_safe(record))
    record["path"] = out
    print(format_table(record))
    record["plot"] = _plot_if_possible(cfg.run)


def _plot_if_possible(run: str) -> str | None:
    """RUN/eval/loss.png from the training metrics, when the run has them."""
    from codex import fsio, rundir

    if not fsio.exists(rundir.metrics_path(run)):
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("loss plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    from eval.plot import plot_loss

    path = plot_loss(run)
    print(f"loss plot: {path}")
    return path


def _json_safe(record: dict) -> dict:
    # json.dumps writes NaN/Infinity, which is not JSON; strings keep the file parseable everywhere.
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def format_table(r: dict) -> str:
    what = "val split" if r.get("split") else ", ".join(r["data"])
    rows = [
        ("checkpoint", f"step {r['step']} ({r['checkpoint']})"),
        ("data", what + (f" ({r['documents']} documents)" if r.get("documents") is not None else "")),
        ("tokens", f"{r['tokens']:,}"),
        ("bytes", f"{r['bytes']:,}"),
        ("loss (nats/token)", f"{r['loss']:.4f}"),
        ("perplexity", f"{r['perplexity']:.3f}"),
        ("bits per byte", f"{r['bits_per_byte']:.4f}"),
        ("backend", f"{r['backend']} x{r['world_size']} ({r['hardware']}), batch {r['device_batch']} x {r['seq_len']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _tokenize_to_shard(cfg, run_cfg, tok_dir: str, data_paths: list[str], max_tokens: int, seq_len: int, backend):
    """Read, normalise and tokenize `data_paths` with the run's tokenizer into one temporary npy shard
    + manifest, so the exact windowing and rank split of train/loader.val_batches apply unchanged.

    "Cleaning" here is the clean stage's text normalisation (NFC, newlines, control characters) and
    dropping empty documents, not its quality filters: the user chose this held-out text, and a
    number on a filtered subset of it would not be the number they asked for. Documents are encoded
    by `codex data shard`'s Encoder (<|bos|> + tokens (+ <|eos|> when the run's shards have it)) and
    written by its shard writer and manifest code. Every rank tokenizes the same text
    (deterministic) and keeps its own copy. Returns (shards_dir, TemporaryDirectory, documents).
    """
    tok = load_tokenizer(tok_dir)
    manifest_path = fsio.join(rundir.shards_dir(cfg.run), "manifest.json")
    append_eos = (fsio.read_json(manifest_path).get("append_eos", False) if fsio.exists(manifest_path)
                  else run_cfg.data.shard.append_eos)
    dtype = token_dtype(run_cfg.model.vocab_size)
    encoder = Encoder(tok.to_str(), tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>"), append_eos, dtype,
                      run_cfg.data.shard.chunk_chars)
    files, skipped = list_inputs(data_paths, cfg.data.clean.text_extensions)
    if not files:
        raise FileNotFoundError(f"--data {' '.join(data_paths)}: no readable text files"
                                + (f" (skipped {len(skipped)} of another type, e.g. {skipped[0]})" if skipped else ""))
    if skipped and backend.is_main:
        log.warning("--data: skipped %d files of an unsupported type (e.g. %s)", len(skipped), skipped[0])
    budget = max_tokens + 1 if max_tokens > 0 else None
    parts, documents = _encode_data_files(files, cfg.data.clean, encoder, tok, budget, backend.is_main)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    if budget is not None:
        tokens = tokens[:budget]
    if len(tokens) < seq_len + 1:
        raise ValueError(f"--data {' '.join(data_paths)}: {len(tokens)} tokens in {documents} documents, fewer than "
                         f"one window of seq_len + 1 = {seq_len + 1} tokens")
    tmp = tempfile.TemporaryDirectory(prefix="codex-eval-data-")
    name = shard_name("val", 0, "npy")
    sha, _ = write_npy(fsio.join(tmp.name, name), tokens)
    entry = shard_entry("val", name, "npy", len(tokens), int(np.count_nonzero(tokens == encoder.bos)), sha)
    fsio.write_json(fsio.join(tmp.name, MANIFEST), {
        "format_version": FORMAT_VERSION, "dtype": dtype, "append_eos": append_eos, "shards": [entry]})
    return tmp.name, tmp, documents


def _encode_data_files(files, clean_cfg, encoder, tok, budget: int | None, is_main: bool) -> tuple[list, int]:
    """(encoded batches, documents) of normalised non-empty documents, until `budget` tokens."""
    parts, pending = [], []
    total, documents, empty, oversized = 0, 0, 0, 0

    def flush():
        nonlocal total
        flat, _ = encoder.encode(tok, pending)
        parts.append(flat)
        total += len(flat)
        pending.clear()

    for f in files:
        report = FileReport(f.path)
        for rec in read_records(f, clean_cfg, report):
            if rec.text is None:
                oversized += 1
                continue
            text, _ = normalize(rec.text)
            if not text:
                empty += 1
                continue
            pending.append(text)
            documents += 1
            if len(pending) >= 256:
                flush()
            if budget is not None and total >= budget:
                break
        if report.bad() and is_main:
            log.warning("--data %s: %s", f.path, report.error or report.describe())
        if budget is not None and total >= budget:
            break
    if pending:
        flush()
    if (oversized or empty) and is_main:
        log.warning("--data: %d documents used, %d empty after normalisation and %d over "
                    "data.clean.max_record_bytes skipped", documents, empty, oversized)
    return parts, documents
