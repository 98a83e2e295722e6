"""The CPU tensor-parallel group (parallel/shm_group.py) across real spawned processes: sums and gathers
equal torch's, through several chunks of a small slot, bit-identical on every rank, and the group is
quiet between collectives (a waiting rank sleeps at the barrier)."""

from __future__ import annotations

import multiprocessing as mp

import torch

from agentbox.parallel.shm_group import ShmGroup


def _values(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(3, 1000, generator=g)  # 12 kB: three chunks of a 4 kB slot


def _rank_main(group: ShmGroup, rank: int, out: mp.Queue) -> None:
    g = group.for_rank(rank)
    x = _values(rank)
    summed = g.all_reduce(x.clone())
    gathered = g.all_gather(x[:, :7].contiguous())
    ints = g.all_gather(torch.tensor([rank * 10], dtype=torch.int64))
    # plain lists: a tensor in a queue is a shared-memory handle that dies with this process
    out.put((rank, summed.tolist(), [t.tolist() for t in gathered], [int(t.item()) for t in ints]))


def test_shm_group_sums_and_gathers_like_torch_in_chunks() -> None:
    ctx = mp.get_context("spawn")
    size = 3
    group = ShmGroup.create(size, ctx, slot_bytes=4096)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(group, r, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    expected = _values(0) + _values(1) + _values(2)  # rank order, as the group sums
    for _, summed, gathered, ints in results:
        assert summed == results[0][1]  # every rank bit-identical
        torch.testing.assert_close(torch.tensor(summed), expected, atol=1e-6, rtol=1e-6)
        for r in range(size):
            assert torch.equal(torch.tensor(gathered[r]), _values(r)[:, :7])
        assert ints == [0, 10, 20]
