"""The replicated layout's gradient all-reduce (train.parallel=replicate on CPU/CUDA), overlapped
with the backward of the step's last micro-batch.

    reducer = GradReducer(module, bucket_bytes, reduce_dtype, world_size)   # hooks on its params
    for each micro-batch:
        reducer.arm(last)            # TorchBackend.set_grad_sync(model, last)
        loss.backward()              # last: each bucket's all-reduce starts when its grads are done
    reducer.finish()                 # TorchBackend.all_reduce_grads: wait, mean back into .grad

Each gradient element is reduced once a step. Buckets, hooks and bf16: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    numel: int
    ready: set[int] = field(default_factory=set)  # ids of its gradients final in this backward
    # issued and not yet finished: the collective's work and the flat buffer it reduces
    work: dist.Work | None = None
    flat: torch.Tensor | None = None


class GradReducer:
    """Bucketed SUM all-reduce of `module`'s gradients over the default process group, issued from
    the backward (docs/training.md)."""

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_bytes: int,
        reduce_dtype: torch.dtype | None,
        world_size: int,
    ) -> None:
        self.module = module
        self.reduce_dtype = reduce_dtype  # None: each gradient's own dtype
        self.world_size = world_size
        self.armed = False
        self.next = 0  # the next bucket to issue (buckets go out in order)
        self.buckets: list[Bucket] = []
        params = [p for p in module.parameters() if p.requires_grad]  # a tied weight once
        size = 0
        for p in reversed(params):
            last = self.buckets[-1] if self.buckets else None
            nbytes = p.numel() * p.element_size()
            if last is None or p.dtype != last.params[0].dtype or size + nbytes > bucket_bytes:
                last = Bucket([], 0)
                self.buckets.append(last)
                size = 0
            last.params.append(p)
            last.numel += p.numel()
            size += nbytes
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def arm(self, on: bool) -> None:
        """Before each micro-batch's backward: on = the step's last, whose gradients are final and
        are reduced as they become ready."""
        if on and any(b.work is not None for b in self.buckets):
            raise RuntimeError(
                "gradient buckets are still being reduced from an earlier backward: call "
                "all_reduce_grads once after the step's last micro-batch"
            )
        self.armed = on

    @torch.no_grad()
    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise RuntimeError(
                "a parameter's gradient was accumulated twice in the step's last backward, after "
                "its bucket's all-reduce may have started (a weight used in two backward passes?)"
            )
        bucket.ready.add(id(p))
        # in bucket order: a full bucket waits for the ones before it
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if len(b.ready) < len(b.params):
                break
            self._issue(b)

    def _issue(self, bucket: Bucket) -> None:
        first = bucket.params[0]
        dtype = self.reduce_dtype or first.dtype
        flat = torch.empty(bucket.numel, dtype=dtype, device=first.device)
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in bucket.params]
        torch.cat([g.reshape(-1) for g in pieces], out=flat)  # one copy, cast to the reduce dtype
        # SUM, then divide in finish: gloo has no AVG op, and the result is the same on NCCL.
        bucket.work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        bucket.flat = flat
        self.next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Issue the buckets the backward did not, wait for every one, and write the mean over the
        ranks into each .grad. Leaves the reducer disarmed and ready for the next step."""
        while self.next < len(self.buckets):
            self._issue(self.buckets[self.next])
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.flat is not None
            bucket.work.wait()
            flat, offset, grads = bucket.flat, 0, []
            for p in bucket.params:
                n = p.numel()
                mean = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    # no gradient on this rank, maybe one on another: every rank keeps the same
                    # gradient (as DDP does), or the replicas' optimizers would step differently
                    p.grad = mean.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(mean)  # back to its dtype
                grads.append(p.grad)
                offset += n
            if grads:
                torch._foreach_div_(grads, self.world_size)
            bucket.work = bucket.flat = None  # the buffer goes now, before the optimizer step
            bucket.ready.clear()
        self.next = 0
        self.armed = False

    def remove(self) -> None:
        """Take the hooks off the parameters (a reducer for another module replaces this one)."""
        for h in self._handles:
            h.remove()
        self._handles = []
