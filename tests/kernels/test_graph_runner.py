"""The decode-graph runner's padding, on CPU (the triton backend under the interpreter, graphs not captured):
a decode of 3 sequences run through the padded static buffers (to the captured size 4) gives the eager
step's logits and writes the cache only at the real rows' slots. The captured replay is tests/test_gpu.py's."""

from __future__ import annotations

import torch
from model_harness import PagedRunner
from paged_case import PROMPT

from agentbox.engine.exec.graph_runner import DecodeGraphs, capture_sizes, padded_size
from agentbox.layers.backends import TritonAttention
from agentbox.models.loader import LoadedModel


def test_capture_sizes() -> None:
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert padded_size(5, capture_sizes(32)) == 8 and padded_size(33, capture_sizes(32)) is None


def test_padded_decode_equals_eager_and_writes_only_real_slots(tiny_qwen3: LoadedModel) -> None:
    device = next(tiny_qwen3.model.parameters()).device
    eager, padded = (
        PagedRunner(tiny_qwen3, num_pages=32, page_size=4, backend_cls=TritonAttention, device=str(device))
        for _ in range(2)
    )
    prompts = {0: PROMPT[:7], 1: PROMPT[3:8], 2: PROMPT[:12]}  # 7 and 12: the decode starts a new page
    for r in (eager, padded):
        r.step(prompts)
    nxt = {0: [11], 1: [12], 2: [13]}
    expected = eager.step(nxt)

    graphs = DecodeGraphs(tiny_qwen3.model, padded.backend, 4, max_batch=4, max_pages=8, device=device, capture=False)
    ps, ids, pos, slots, kv_lens, table = 4, [], [], [], [], torch.zeros(3, 8, dtype=torch.int32)
    for i, (seq, tok) in enumerate(nxt.items()):
        p = padded.lens[seq]
        pages = padded.pages[seq]
        if p // ps >= len(pages):
            pages.append(padded.free_pages.pop())
        ids += tok
        pos.append(p)
        slots.append(pages[p // ps] * ps + p % ps)
        kv_lens.append(p + 1)
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    before_k = [k.clone() for k in padded.cache.k]
    logits = graphs.run(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), kv_lens, table.to(device))
    assert logits.shape == (3, tiny_qwen3.vocab_size)
    for i, seq in enumerate(nxt):
        torch.testing.assert_close(logits[i], expected[seq][0], atol=1e-4, rtol=1e-4)
    for layer, k in enumerate(padded.cache.k):
        changed = (k != before_k[layer]).any(dim=-1).any(dim=-1).nonzero().flatten().tolist()
        assert changed == sorted(slots)  # the padded 4th row (slot -1) wrote nothing
    assert graphs.kv_lens.tolist()[3] == 0 and graphs.slot_mapping.tolist()[3] == -1
