"""A word-level tokenizer for tiny random models: token i is the word `w<i>`, so an answer's text names its
token ids (the disk-tier tests compare answers as token ids across restarts)."""

from __future__ import annotations

from pathlib import Path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """Write the tokenizer (with a one-line chat template) beside a model in `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}w2 {{ m['content'] }} {% endfor %}w3"
    fast.save_pretrained(path)
