"""A tiny real checkpoint whose greedy output is a fixed text: a recorded model output, replayed by the real
engine behind the real server, so every API can be tested on what gpt-oss writes.

How: a one-layer Llama whose attention and MLP write nothing (their output projections are zero), so the
logits depend on the current token only; the embedding is one-hot and the head maps each token to its
successor. The output text is cut into pieces that never repeat (a repeated marker is split differently
each time, `<|chan` + `nel|>` ...), so "next piece given this piece" is a function; the tokenizer's Fuse
decoder joins pieces without spaces. The prompt's last token (`assistant`, from the template's
`<|start|>assistant`) leads to the first piece; the last piece leads to an end-of-turn special token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HIDDEN = 256


def unique_pieces(text: str, special: list[str], avoid: set[str]) -> list[str]:
    """text cut into pieces none of which repeats. A special token's first occurrence is that special token
    itself (so stop-token handling is exercised); later ones are split into plain pieces."""
    firsts = {text.find(t): t for t in special if t in text}

    def cut(i: int, seen: frozenset[str]) -> list[str] | None:
        if i == len(text):
            return []
        if i in firsts:
            rest = cut(i + len(firsts[i]), seen)
            return None if rest is None else [firsts[i], *rest]
        limit = min([k for k in firsts if k > i] + [len(text)])  # stop short of the next special token
        for n in (4, 3, 5, 2, 6, 7, 8, 1, 9, 10, 11, 12):
            piece = text[i : min(i + n, limit)]
            if piece and piece not in seen and piece not in special:
                rest = cut(i + len(piece), seen | {piece})
                if rest is not None:
                    return [piece, *rest]
        return None

    pieces = cut(0, frozenset(avoid))
    if pieces is None:
        raise ValueError(f"cannot cut {text!r} into unique pieces")
    return pieces


def write_scripted_model(
    path: Path, output: str, stop_token: str, special: list[str], template: str, after: str = "assistant"
) -> None:
    """A checkpoint + tokenizer in `path` whose greedy continuation of any prompt ending in `after` is
    `output` followed by `stop_token` (a special token and the model's eos)."""
    pieces = unique_pieces(output, special, {after, "[UNK]"})
    words = ["[UNK]", after, *(p for p in pieces if p not in special)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": special})
    fast.chat_template = template
    vocab_size = len(fast)
    if vocab_size > HIDDEN:
        raise ValueError(f"script too long for a one-hot embedding ({vocab_size} tokens > {HIDDEN})")
    ids = [vocab[after]] + [fast.convert_tokens_to_ids(p) if p in special else vocab[p] for p in pieces]
    ids.append(fast.convert_tokens_to_ids(stop_token))
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=ids[-1],
    )
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        head = model.lm_head.weight
        for prev, nxt in zip(ids, ids[1:], strict=False):
            head[nxt, prev] = 1.0
        head[ids[-1], 0] = 1.0  # any unknown token: end the turn
    model.save_pretrained(path)
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[-1]]}))


@contextmanager
def serving_scripted(model: Path, home: Path) -> Iterator[str]:
    """`agentbox serve` (background, as a user runs it) of the scripted checkpoint at `model` on a free
    loopback port with its own state dir `home`; yields the base URL, stops it on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", "128", "--max-model-len", "2048"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        log = home / "server.log"
        raise RuntimeError(f"agentbox serve failed: {r.stderr}\n{log.read_text() if log.exists() else ''}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)
