"""What a model's parameters and optimizer state weigh: parameter counts by part (model/gpt.py's
shapes, without torch), the optimizer's state, and what Muon's step allocates. Summed per device by
train/plan/memory.py."""

from __future__ import annotations

from codex.core.config.model import (
    ModelConfig,
    has_value_embed,
    matmul_params,
    mlp_hidden,
    padded_vocab,
)
from codex.train.plan.owners import balanced_owners, wide


def param_count(m: ModelConfig) -> int:
    """Parameters of model.gpt.GPT for ModelConfig `m`: the matmul weights (output head over the
    padded vocab included), the embedding table when it is not tied to the head, and the value
    embeddings (model.value_embed: a padded vocab x K/V width table on every other layer)."""
    kv_width = m.n_kv_head * (m.n_embd // m.n_head)
    value_tables = sum(has_value_embed(m, i) for i in range(m.n_layer))
    embeddings = (0 if m.tie_embeddings else m.n_embd) + value_tables * kv_width
    return matmul_params(m) + padded_vocab(m.vocab_size) * embeddings


def largest_param(m: ModelConfig) -> int:
    """The entries of the model's largest parameter: the output head (padded vocab x d), or an
    MLP matrix when it is larger."""
    return max(padded_vocab(m.vocab_size) * m.n_embd, mlp_hidden(m) * m.n_embd)


def block_params(m: ModelConfig) -> int:
    """One transformer block's parameters (model.gpt.Block)."""
    return (matmul_params(m) - m.n_embd - m.n_embd * padded_vocab(m.vocab_size)) // m.n_layer


def hidden_matrices(m: ModelConfig) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix Muon updates (train.optim.muon.is_hidden_matrix: the blocks'
    2-D weights, everything in a block but its norms), in the optimizer's order: model/gpt.py's
    c_q, c_k, c_v, c_proj, w_gate (swiglu), w_up, w_down, block after block."""
    d, hd, h = m.n_embd, m.n_embd // m.n_head, mlp_hidden(m)
    q, kv = m.n_head * hd, m.n_kv_head * hd
    block = [(q, d), (kv, d), (kv, d), (d, q)]
    block += [(h, d)] * (2 if m.mlp == "swiglu" else 1) + [(d, h)]
    return block * m.n_layer


def _muon_params(m: ModelConfig) -> int:
    """M: the entries of Muon's matrices."""
    return sum(r * c for r, c in hidden_matrices(m))


def optimizer_bytes(m: ModelConfig, optimizer: str) -> int:
    """Optimizer state for the whole model: AdamW keeps two fp32 moments per parameter; Muon one
    fp32 momentum per hidden matrix entry, and AdamW's two for everything else."""
    if optimizer == "muon":
        return 4 * _muon_params(m) + 8 * (param_count(m) - _muon_params(m))
    return 8 * param_count(m)


def muon_step_bytes(m: ModelConfig, kind: str, layout: str, F: int, W: int, c: int) -> int:
    """What Muon's step allocates on top of the state, per device, in bytes (train/optim/muon.py;
    counted on the CPU by bench/count_step_memory.py). c is the compute dtype's bytes, F the ranks
    sharing the state, W the world; `kind` and `layout` pick the case. AdamW's step is not counted.
    docs/hardware.md, "The arithmetic, term by term", has each case's arithmetic."""
    shapes = [wide(shape) for shape in hidden_matrices(m)]
    sizes = [r * cols for r, cols in shapes]
    if not sizes:
        return 0
    if kind == "tpu" and layout == "fsdp" and W > 1:
        groups: dict[tuple[int, int], int] = {}
        for shape in shapes:
            groups[shape] = groups.get(shape, 0) + 1
        share = [shape for shape, n in groups.items() for _ in range(-(-n // W))]
        return c * -(-sum(sizes) // F) + _stack_work(share, [0] * len(share), c)[0]
    if kind == "tpu" or W == 1:
        return c * sum(sizes) + _stack_work(shapes, [0] * len(shapes), c)[0]
    if layout == "fsdp":
        s = -(-sum(sizes) // F)
        owner = balanced_owners(sizes, F)
        o = [sum(n for n, q in zip(sizes, owner, strict=True) if q == rank) for rank in range(F)]
        work = _stack_work(shapes, owner, c)
        iterate = max(c * o[rank] + work[rank] for rank in range(F))
        return max(c * (s + max(o)), iterate, (c + (4 if c != 4 else 0)) * s)
    owner = balanced_owners(sizes, W)
    width = max(sum(n for n, q in zip(sizes, owner, strict=True) if q == r) for r in range(W))
    return c * (2 * W + 3) * width


def _stack_work(shapes: list[tuple[int, int]], owner: list[int], c: int) -> list[int]:
    """Per rank, the most one shape group's Newton-Schulz holds at once: its k (rows, cols)
    matrices stacked, the stack and one more taking turns with each step's result, and the two
    (rows, rows) products, c bytes an entry: c k rows (2 cols + 2 rows)."""
    work = [0] * (max(owner) + 1)
    for rank in range(len(work)):
        k: dict[tuple[int, int], int] = {}
        for shape, q in zip(shapes, owner, strict=True):
            if q == rank:
                k[shape] = k.get(shape, 0) + 1
        work[rank] = max((c * n * r * (2 * cols + 2 * r) for (r, cols), n in k.items()), default=0)
    return work
