"""A word-level tokenizer built locally (no network), saved beside each checkpoint.

Token i is the word ``w<i>``, except the first few, which are the special tokens; text
is split on whitespace. Every id below ``VOCAB`` decodes, so whatever a random model
generates goes through the detokenizer.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
SPECIALS = ("<s>", "</s>", "<pad>", "<|MASK|>")
BOS, EOS, PAD, MASK = range(len(SPECIALS))


def word(i: int) -> str:
    return SPECIALS[i] if i < len(SPECIALS) else f"w{i}"


def text(ids: list[int]) -> str:
    """The prompt text whose tokens are ``ids`` (no BOS is added by this tokenizer)."""
    return " ".join(word(i) for i in ids)


def save(path: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (a fast tokenizer) to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|MASK|>"],
    )
    fast.save_pretrained(str(path))
