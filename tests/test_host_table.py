"""The host table (layers/host_table.py): rows of a table split over safetensors files read through a memory map,
and a Qwen3.8-Flash-Next checkpoint whose n-gram tables are 1 GiB (written sparse: the test writes no gigabyte)
loads with the process's resident memory grown by a few MiB, and a step grows it by the pages its tokens' rows
sit in, not by the table."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import psutil
import pytest
import torch
from model_harness import PagedRunner
from qwen4_exp_models import save_qwen4_exp, tiny_config
from safetensors.torch import load_file, save_file

from agentbox.layers.host_table import HostTable, tensor_locations
from agentbox.layers.ngram_embedding import NGramIds
from agentbox.models.loader import load_model

MIB = 2**20


def resident_bytes_of(path: Path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps: the table's pages only,
    not the step's activations nor the libraries a first step pages in)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_rows_across_shards_and_files_equal_the_concatenated_table(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        parts = [torch.randn(n, 6, generator=g).to(dtype) for n in (5, 7, 3)]
        save_file({"t.shard_0.weight": parts[0], "other": torch.ones(2)}, str(tmp_path / "a.safetensors"))
        save_file({"t.shard_1.weight": parts[1], "t.shard_2.weight": parts[2]}, str(tmp_path / "b.safetensors"))
        loc = tensor_locations([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
        table = HostTable([loc[f"t.shard_{i}.weight"] for i in range(3)])
        full = torch.cat(parts)
        ids = torch.tensor([[0, 4, 5], [11, 12, 14]])
        got = table.gather(ids, "cpu", dtype)
        assert table.rows == 15 and table.dtype == dtype and got.shape == (2, 3, 6)
        assert torch.equal(got, full[ids])
        with pytest.raises(IndexError):
            table.gather(torch.tensor([15]), "cpu", dtype)


def _big_checkpoint(src: Path, dst: Path, base: int) -> int:
    """The tiny checkpoint of `src` with n-gram tables sized for `ngram_vocab_size_base` = base, every row zero:
    the header and the small tensors are written, the tables are a hole at the file's end. Returns their bytes."""
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["ngram_vocab_size_base"] = base
    config["text_config"]["split_ngram_parts"] = 2
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    # without the tables and the hash constants (those of the small tables; the load checks them where present)
    small = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if ".ple_embedding." not in k}
    text = tiny_config(ngram_vocab_size_base=base).text_config
    header: dict[str, dict] = {}
    offset = 0
    for name, t in small.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    table_bytes = 0
    for ple_index, layer in enumerate(i - 1 for i in text.ple_layer_ids):
        rows = NGramIds(text, ple_index).rows
        dim = text.ple_embed_dim // ((text.ngram_size - 1) * text.heads_per_ngram)
        for part, n in enumerate((rows - rows // 2, rows // 2)):
            name = f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{part}.weight"
            header[name] = {"dtype": "F32", "shape": [n, dim], "data_offsets": [offset, offset + n * dim * 4]}
            offset += n * dim * 4
            table_bytes += n * dim * 4
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in small.values():
            f.write(t.contiguous().numpy().tobytes())
        f.truncate(8 + len(raw) + offset)  # the tables: a hole, no bytes written
    return table_bytes


def test_a_1_gib_ngram_table_is_mapped_not_read(tmp_path: Path) -> None:
    save_qwen4_exp(tmp_path / "tiny")
    table_bytes = _big_checkpoint(tmp_path / "tiny", tmp_path / "big", base=8_400_000)
    assert table_bytes >= 2**30
    assert os.stat(tmp_path / "big" / "model.safetensors").st_blocks * 512 < 64 * MIB  # sparse on disk
    proc = psutil.Process()
    before = proc.memory_info().rss
    loaded = load_model(str(tmp_path / "big"), torch.float32, "cpu")
    after_load = proc.memory_info().rss
    big = (tmp_path / "big" / "model.safetensors").resolve()
    tables = loaded.model.host_tables()
    assert sum(t.nbytes for t in tables) == table_bytes
    assert after_load - before < 64 * MIB, (after_load - before) / MIB  # the table is not read
    assert resident_bytes_of(big) < MIB
    runner = PagedRunner(loaded, num_pages=160, page_size=8)
    grown = []
    for seq, n in enumerate((100, 400)):
        # n tokens touch at most n x 8 rows (4 heads x 2 PLE layers), each in a 4 KiB page of its own
        tokens = [(37 * i + 11 * n) % 250 + 3 for i in range(n)]
        logits = runner.step({seq: tokens})[seq]
        assert torch.isfinite(logits).all()
        grown.append(resident_bytes_of(big))
        assert grown[-1] <= n * 8 * 4096 + 4 * MIB, (n, grown[-1] / MIB)
    assert 0 < grown[0] < grown[1]  # more rows touched, more of the table resident
    print(f"\n{table_bytes / MIB:.0f} MiB of n-gram tables: process RSS +{(after_load - before) / MIB:.1f} MiB at load; "
          f"table pages resident after 100 and 500 tokens: {grown[0] / MIB:.2f}, {grown[1] / MIB:.2f} MiB")
