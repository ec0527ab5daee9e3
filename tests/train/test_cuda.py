"""The CUDA paths of training, run by `pytest -m cuda` (`scripts/gpu-check.sh`); skipped without a GPU.

- placement: rank r of a multi-rank run trains on `cuda:LOCAL_RANK`; a `LOCAL_RANK` beyond the
  machine's GPUs is refused;
- the compiled flex-attention training forward (`attention="auto"` on CUDA) against SDPA (the
  `torch_compile -> eager` downgrade): the same losses within bf16 tolerance;
- CUDA against CPU: the first step's loss within bf16 tolerance;
- resume on CUDA: a run stopped at a checkpoint and resumed ends with the same parameters as an
  undisturbed one (bit for bit: a CUDA kernel that is not deterministic shows up here);
- two NCCL ranks against one on the same global batch (needs 2 GPUs): the same parameters within
  the bf16 reduction-order tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_distributed import ONE_RANK, TORCHRUN, _recipe, _run, _trainable

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _cuda_recipe(pipeline, run: str, **over):
    return _recipe(pipeline, run, device="cuda", **over)


def test_ranks_are_placed_on_their_local_gpu():
    from dflash_worker import dist
    from dflash_worker.errors import ConfigError

    assert dist.place(dist.Ranks(rank=0, world=2, local_rank=0), torch.device("cuda")) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"has `LOCAL_RANK` {n} but this machine has {n} CUDA devices"):
        dist.place(dist.Ranks(rank=n, world=n + 1, local_rank=n), torch.device("cuda"))


def test_compiled_flex_attention_trains_like_sdpa(pipeline):
    from dflash_worker.recipe import load_recipe
    from dflash_worker.train import train

    runs = {}
    for attention in ("auto", "sdpa"):
        run = pipeline.root / f"cuda-attn-{attention}"
        result = train(load_recipe(_cuda_recipe(pipeline, run.name, steps=3, val_every=3)), run_dir=run, attention=attention)
        assert result.status == "completed", result
        runs[attention] = _losses(run)
    torch.testing.assert_close(torch.tensor(runs["auto"]), torch.tensor(runs["sdpa"]), rtol=2e-2, atol=1e-3)


def test_the_first_cuda_step_matches_cpu(pipeline):
    gpu, cpu = pipeline.root / "cuda-vs-cpu-gpu", pipeline.root / "cuda-vs-cpu-cpu"
    _run(ONE_RANK, _cuda_recipe(pipeline, gpu.name, steps=1, val_every=1))
    _run(ONE_RANK, _recipe(pipeline, cpu.name, steps=1, val_every=1))
    torch.testing.assert_close(torch.tensor(_losses(gpu)), torch.tensor(_losses(cpu)), rtol=2e-2, atol=1e-3)


def test_a_resumed_cuda_run_ends_with_the_undisturbed_parameters(pipeline):
    from dflash_worker.recipe import load_recipe
    from dflash_worker.train import StopFlags, train

    whole, split = pipeline.root / "cuda-whole", pipeline.root / "cuda-split"
    _run(ONE_RANK, _cuda_recipe(pipeline, whole.name, steps=4, val_every=4))
    flags = StopFlags()
    flags.request_stop("test")  # stop (and commit) at the first step boundary, as a job runner's SIGTERM does
    recipe = _cuda_recipe(pipeline, split.name, steps=4, val_every=4)
    assert train(load_recipe(recipe), flags=flags).status == "stopped"
    _run(ONE_RANK, recipe, "--resume")
    a, b = _trainable(whole, 4), _trainable(split, 4)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_nccl_ranks_train_like_one(pipeline):
    one, two = pipeline.root / "cuda-nccl-1", pipeline.root / "cuda-nccl-2"
    _run(ONE_RANK, _cuda_recipe(pipeline, one.name, steps=2, val_every=2))
    _run(TORCHRUN, _cuda_recipe(pipeline, two.name, steps=2, val_every=2))
    a, b = _trainable(one, 2), _trainable(two, 2)
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=1e-2, atol=1e-4, msg=k)
    lines = [json.loads(raw) for raw in (two / "metrics.jsonl").read_text().splitlines()]
    assert {x["world_size"] for x in lines} == {2}
