"""A Qwen3-30B-A3B-shaped GGUF with random weights, for the CPU-experts speed comparison (issue 44):
hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768 with top-8 routing, vocab 151,936, the real
dimensions with 2-4 of the 48 layers. Written the way llama.cpp's converter lays out `qwen3moe` (all experts of
a layer in one 3-D `ffn_*_exps` tensor, `ffn_gate_inp` router, q/k norms), so both agentbox and llama.cpp's
own `llama-server` load the same file.

Types: `q8_0` (every matrix Q8_0, norms and router F32), `q4_k_m` (llama.cpp's Q4_K_M mix: Q4_K, with
ffn_down_exps and attn_v in Q6_K in the use_more_bits layers, the output table in Q6_K) or `q2_k` (llama.cpp's
Q2_K mix: Q2_K, with ffn_down_exps in Q3_K and attn_v in Q4_K; the tables as q4_k_m's). The weights are random
blocks with small valid scales (Q8_0: int8 codes and an fp16 scale per 32; the K-quants: random codes, 6-bit
scales and fp16 d / dmin per 256): what a random model is, without a quantiser, in seconds. Its vocabulary is
a synthetic SentencePiece one (byte tokens and made-up pieces): prompts are sent as token ids.

    python bench/qwen3_30b_a3b_gguf.py /tmp/q30b-q8_0.gguf --type q8_0 --layers 4

then `python bench/cpu_moe_vs_llamacpp.py /tmp/q30b-q8_0.gguf --llama-server PATH` compares the two engines.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, EXPERT_FFN, TOP_K, VOCAB = 128, 768, 8, 151936
CONTEXT = 40960


def _q8_0(rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """Q8_0 blocks [rows, cols / 32 * 34]: an fp16 scale, then 32 int8 codes (uniform codes of this std)."""
    blocks = cols // 32
    out = np.empty((rows, blocks, 34), dtype=np.uint8)
    d = np.float16(std * np.sqrt(3) / 127)  # uniform over [-127, 127] * d has this std
    out[..., 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    out[..., 2:] = rng.integers(-127, 128, size=(rows, blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def _k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Q4_K / Q6_K / Q2_K / Q3_K blocks with random codes and small valid scales (weights of about 0.01-0.05)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    if qtype in (Q.Q2_K, Q.Q3_K):  # fp16 d (Q2_K: then dmin) last; their codes x scales reach 45 d / 128 d
        low = 5e-4 if qtype is Q.Q2_K else 2e-4
        n = 2 if qtype is Q.Q2_K else 1
        d = rng.uniform(low, 2 * low, size=(*raw.shape[:2], n)).astype(np.float16).view(np.uint8)
        raw[..., ts - 2 * n:] = d.reshape(*raw.shape[:2], 2 * n)
        return raw.reshape(rows, -1)
    low = 1e-5 if qtype is Q.Q6_K else 1e-4  # Q6_K's int8 scales reach 127
    d = rng.uniform(low, 3 * low, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype is Q.Q6_K:
        raw[..., ts - 2:] = d  # ql, qh, int8 scales, then d
    else:
        raw[..., 0:2] = d  # d, dmin, 6-bit scales and mins, qs
        raw[..., 2:4] = d
    return raw.reshape(rows, -1)


def _blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of an [..., rows, cols] weight, bytes last (what gguf's writer takes with raw_dtype)."""
    rows = int(np.prod(shape[:-1]))
    raw = _q8_0(rows, shape[-1], rng, 0.02) if qtype is Q.Q8_0 else _k_quant(rows, shape[-1], qtype, rng)
    return raw.reshape(*shape[:-1], -1)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def types_of(file_type: str, layer: int, layers: int) -> dict[str, Q]:
    if file_type == "q8_0":
        return dict.fromkeys(("attn", "attn_v", "gate_up", "down"), Q.Q8_0)
    if file_type == "q2_k":  # llama_tensor_get_type: ffn_down Q3_K, attn_v Q4_K at 8 query heads a KV head
        return {"attn": Q.Q2_K, "attn_v": Q.Q4_K, "gate_up": Q.Q2_K, "down": Q.Q3_K}
    wide = Q.Q6_K if more_bits(layer, layers) else Q.Q4_K
    return {"attn": Q.Q4_K, "attn_v": wide, "gate_up": Q.Q4_K, "down": wide}


def _vocab(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece vocabulary llama.cpp loads: <unk>, <s>, </s>, the 256 byte tokens, made-up pieces."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]  # unknown, control, control, byte
    tokens += [f"\u2581t{i}" for i in range(VOCAB - len(tokens))]
    types += [1] * (VOCAB - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(VOCAB)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)


def write(path: Path, file_type: str = "q8_0", layers: int = 4, seed: int = 0) -> None:
    if file_type not in ("q8_0", "q4_k_m", "q2_k"):
        raise ValueError(f"--type must be q8_0, q4_k_m or q2_k (got {file_type})")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name(f"Qwen3-30B-A3B-shaped random {layers} layers {file_type.upper()}")
    writer.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                          "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K}[file_type])
    for key, value in (
        ("block_count", layers), ("context_length", CONTEXT), ("embedding_length", HIDDEN),
        ("feed_forward_length", 6144), ("head_count", HEADS), ("head_count_kv", KV_HEADS), ("key_length", HEAD_DIM),
        ("value_length", HEAD_DIM), ("vocab_size", VOCAB), ("expert_count", EXPERTS), ("expert_used_count", TOP_K),
        ("expert_feed_forward_length", EXPERT_FFN),
    ):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    _vocab(writer)

    def norm(name: str, n: int) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    def matrix(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        writer.add_tensor(name, _blocks(shape, qtype, rng), raw_dtype=qtype)

    head = Q.Q8_0 if file_type == "q8_0" else Q.Q4_K
    matrix("token_embd.weight", (VOCAB, HIDDEN), head)
    for layer in range(layers):
        t, blk = types_of(file_type, layer, layers), f"blk.{layer}"
        norm(f"{blk}.attn_norm.weight", HIDDEN)
        matrix(f"{blk}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), t["attn"])
        matrix(f"{blk}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), t["attn"])
        matrix(f"{blk}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), t["attn_v"])
        matrix(f"{blk}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), t["attn"])
        norm(f"{blk}.attn_q_norm.weight", HEAD_DIM)
        norm(f"{blk}.attn_k_norm.weight", HEAD_DIM)
        norm(f"{blk}.ffn_norm.weight", HIDDEN)
        writer.add_tensor(f"{blk}.ffn_gate_inp.weight", (0.05 * rng.standard_normal((EXPERTS, HIDDEN))).astype(np.float32))
        matrix(f"{blk}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), t["gate_up"])
        matrix(f"{blk}.ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), t["gate_up"])
        matrix(f"{blk}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), t["down"])
    norm("output_norm.weight", HIDDEN)
    matrix("output.weight", (VOCAB, HIDDEN), Q.Q8_0 if file_type == "q8_0" else Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    ap.add_argument("--type", default="q8_0", choices=("q8_0", "q4_k_m", "q2_k"))
    ap.add_argument("--layers", type=int, default=4, help="2-4 of Qwen3-30B-A3B's 48 (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write(args.out, args.type, args.layers, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
