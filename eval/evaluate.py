"""Loss, perplexity and bits per byte of a model on a stream of (x, y) batches.

    result = evaluate(model, batches, token_bytes, backend)
    # {"loss": 3.1, "perplexity": 22.2, "bits_per_byte": 1.05, "tokens": 1048576, "bytes": 4300000}

`evaluate` is the one function behind both `codex eval` and the training loop's periodic
validation, so the two can never disagree on what "val loss" means. The sums stay on the device
and are all-reduced once at the end; a batch may carry a per-row mask (x, y, mask) for XLA's
fixed-shape final batches. docs/eval.md, "Validation loss, perplexity, bits per byte", has the
details.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

log = logging.getLogger("codex.eval")

LN2 = math.log(2.0)


def evaluate(model, batches, token_bytes: torch.Tensor, backend=None, progress=None) -> dict:
    """Mean loss, perplexity and bits per byte of `model` over every batch in `batches`.

    model:       forward(x, targets=y, reduction="none") -> per-token losses [B, T] (fp32)
    batches:     iterable of (x, y) or (x, y, row_mask) int64 [B, T] tensors (host or device)
    token_bytes: [vocab_size] UTF-8 byte length of every token id, 0 for special tokens
    backend:     train.distributed.backend object; when given, batches are moved with
                 backend.to_device, the forward runs under backend.autocast(), and the sums are
                 all-reduced with backend.all_reduce_sum (so every rank returns the global numbers)
    progress:    optional codex.core.progress.Progress, advanced by one per batch (tokens counted)
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
                    raise ValueError(
                        f"model returned per-token losses of shape {tuple(losses.shape)} "
                        f"for targets of shape {tuple(y.shape)}; "
                        "expected reduction='none' to give [B, T]"
                    )
                target_bytes = token_bytes[y]
                if mask is None:
                    nats += losses.to(acc_dtype).sum()
                    tokens += y.numel()
                    nbytes += target_bytes.sum()
                else:
                    keep = mask.to(torch.bool)[:, None]
                    # where(), not multiply: a padded row must count 0 even if its loss were
                    # inf/nan.
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
    raise ValueError(
        f"evaluate: a batch must be (x, y) or (x, y, row_mask), got {len(batch)} items"
    )
