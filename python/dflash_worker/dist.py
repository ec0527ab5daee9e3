"""Data-parallel ranks on one provider, with `torch.distributed` (training; capture below).

A run with `WORLD_SIZE > 1` in its environment (`torchrun --nproc-per-node N`
sets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) trains
as N ranks: NCCL on CUDA (rank r on `cuda:LOCAL_RANK`), gloo on CPU.

What a step is does not depend on the world size. Step s is the micro-batches
of global sample indices ``g = s * grad_accum + j`` for j in [0, grad_accum)
(sequence ``order(g)``, anchors seeded by ``(seed, g)``; `train.data`), so a
run continues the same sample sequence at any world size and a checkpoint
holds nothing per rank. Rank r computes the micro-batches with ``j % N == r``;
the loss normaliser (sum of position weights over the whole step) and then
the gradients are summed over ranks with `all_reduce`, which is the
collective DDP runs, done once per step after the local micro-batches so
that a rank may hold fewer micro-batches than another (DDP's per-backward
hooks need the same count on every rank). Every rank then clips and steps
the optimizer on identical gradients, so the replicas stay identical. Against
one rank only the order of the fp32 additions differs (tested to 1e-6
relative, and bit-equal with two micro-batches on two ranks, where each sum
has one addition).

Rank 0 alone validates, writes metrics, checkpoints, exports and reports
events; a stop signal on any rank stops every rank at the same step (the
flags are combined with `all_reduce(MAX)` each step). CPU ranks are a
test and development mode (two CPU processes share the cores one process
could use), allowed with ``DFLASH_CPU_RANKS=1``; MPS trains on one rank.

Capture under the same launcher (`capture.run`): shard k (examples
[k * shard_examples, (k + 1) * shard_examples)) is captured by rank
``k % N``, each rank loading the teacher once; rank 0 verifies what an
earlier run left before anyone starts and writes the manifest after every
rank is done, so the shards and the manifest's payload are the bytes one
rank writes.

A coordinator job (`dflash_worker.job`) leased N local ranks runs as N processes the
run-manager starts with this same environment (``run-manager/src/worker/ranks.rs``). The job
joins the group once for all its stages (`hold`), so capture and training share it;
the stages only rank 0 runs (prepare, check) end with `publish`, which the other
ranks `await_published` before they go on.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError

CPU_RANKS_ENV = "DFLASH_CPU_RANKS"
# Rank 0 validates, checkpoints and exports while the others wait in the next step's all_reduce.
TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training ranks (one rank: `world == 1`)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """The micro-batch slots j in [0, n) this rank computes."""
        return [j for j in range(n) if j % self.world == self.rank]


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"`WORLD_SIZE` is set but `{name}` is not\nhint: start the ranks with `torchrun`")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable `{name}` is `{raw}`, not an integer") from None
    if value < 0:
        raise ConfigError(f"environment variable `{name}` is `{raw}`, must be >= 0")
    return value


def ranks_from_env() -> Ranks:
    """The ranks `torchrun` (or any launcher of the standard environment) describes; one rank without it."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Ranks()
    rank, local = _env_int("RANK"), _env_int("LOCAL_RANK", None if "LOCAL_RANK" in os.environ else 0)
    if not 0 <= rank < world:
        raise ConfigError(f"`RANK` `{rank}` is outside `[0, WORLD_SIZE={world})`")
    return Ranks(rank=rank, world=world, local_rank=local)


def place(ranks: Ranks, device: torch.device) -> torch.device:
    """The device this rank trains on; refuses the multi-rank modes that are not supported."""
    if not ranks.active:
        return device
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {ranks.rank} has `LOCAL_RANK` {ranks.local_rank} but this machine has "
                f"{torch.cuda.device_count()} CUDA devices\nhint: start at most one rank per GPU"
            )
        torch.cuda.set_device(ranks.local_rank)
        return torch.device("cuda", ranks.local_rank)
    if device.type == "mps":
        raise ConfigError(f"{ranks.world} ranks on MPS: a Mac runs one rank\nhint: start one process, without torchrun")
    if os.environ.get(CPU_RANKS_ENV) != "1":
        raise ConfigError(
            f"{ranks.world} ranks on CPU: a test and development mode, since CPU ranks share the cores "
            f"one process uses\nhint: set `{CPU_RANKS_ENV}=1` to run it anyway, or run on CUDA"
        )
    return device


def init(ranks: Ranks, device: torch.device) -> None:
    """Join the process group (env:// rendezvous): NCCL for CUDA, gloo otherwise."""
    import torch.distributed as dist

    if not ranks.active or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world, timeout=TIMEOUT, **kw)


_held = False
_barriers = 0  # barriers this process has passed (every rank passes the same ones)


def hold(ranks: Ranks, device: torch.device) -> None:
    """Join the process group for the whole job: `shutdown` leaves it alone until `release`."""
    global _held
    init(ranks, device)
    _held = ranks.active


def release(ranks: Ranks) -> None:
    """Leave the group `hold` joined."""
    global _held
    _held = False
    shutdown(ranks)


def shutdown(ranks: Ranks) -> None:
    """Leave the process group (not while the job `hold`s it)."""
    import torch.distributed as dist

    if ranks.active and dist.is_initialized() and not _held:
        dist.destroy_process_group()


def barrier(ranks: Ranks) -> None:
    """Every rank waits for the others: called after a stage's last collective, so that no rank
    leaves the group (and tears down its gloo pairs) while another still receives from it (a rank
    that left too early made its peer abort with `terminate called without an active exception`)."""
    import time

    import torch.distributed as dist

    global _barriers
    if ranks.active and dist.is_initialized():
        dist.barrier()
        # A gloo barrier returns on one rank before its last message has reached another, so a rank
        # could still tear its pairs down under a peer's feet (seen once more after the gloo barrier
        # alone). Each rank also counts itself out on the rendezvous store, which no rank's teardown
        # touches, and waits until all have: by then no gloo operation is in flight anywhere.
        _barriers += 1
        store = _store(ranks, TIMEOUT)
        key = f"dflash/left/{_barriers}"
        store.add(key, 1)
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while store.add(key, 0) < ranks.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {ranks.rank}: the other ranks did not reach barrier {_barriers} in {TIMEOUT}")
            time.sleep(0.005)


def _store(ranks: Ranks, timeout: datetime.timedelta):
    """A client of rank 0's rendezvous store (the `MASTER_ADDR:MASTER_PORT` every rank joined)."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT")
    return dist.TCPStore(host, port, ranks.world, is_master=False, timeout=timeout)


_PUBLISHED = "dflash/job/"


def publish(ranks: Ranks, key: str) -> None:
    """Rank 0 marks `key` (a finished stage) for the ranks waiting in `await_published`."""
    if ranks.active and ranks.main:
        _store(ranks, TIMEOUT).set(_PUBLISHED + key, "done")


def await_published(ranks: Ranks, key: str, stop=lambda: False, poll: float = 0.1) -> bool:
    """Wait (without a time limit) until rank 0 `publish`es `key`; False when `stop()` turned true first.

    No limit: rank 0's stage may take hours, and a rank 0 that dies is the run-manager's to
    notice (it stops every rank)."""
    import time

    store = _store(ranks, TIMEOUT)
    while not store.check([_PUBLISHED + key]):
        if stop():
            return False
        time.sleep(poll)
    return True


def sum_floats(ranks: Ranks, values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    if not ranks.active:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def any_true(ranks: Ranks, flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Element-wise OR over ranks."""
    if not ranks.active:
        return list(flags)
    import torch.distributed as dist

    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def sum_gradients(ranks: Ranks, params: Sequence[torch.nn.Parameter]) -> None:
    """`p.grad` <- sum over ranks of `p.grad` (a rank that computed nothing contributes zeros), in one buffer."""
    if not ranks.active or not params:
        return
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    at = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[at : at + n].view_as(g).clone()
        at += n


def broadcast(ranks: Ranks, obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a small Python object)."""
    if not ranks.active:
        return obj
    import torch.distributed as dist

    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(ranks: Ranks, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (small Python objects: counts, sample ids)."""
    if not ranks.active:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out
