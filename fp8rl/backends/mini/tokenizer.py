"""A character-level tokenizer for the synthetic arithmetic task.

One token per character of a fixed alphabet, plus three specials: ``<pad>`` (0), ``<bos>`` (1)
and ``<eos>`` (2). The alphabet covers everything the task writes (digits, ``+ - = :``, the
newline, ``Q`` and ``A``). Encoding a character outside the alphabet raises; decoding stops at
the first ``<eos>`` and drops ``<pad>``/``<bos>``.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ALPHABET = "0123456789+-*=:\nQA "


class CharTokenizer:
    """Character tokenizer: ``encode(str) -> list[int]``, ``decode(ids) -> str``.

    Attributes:
        pad_id, bos_id, eos_id: ids of the specials (0, 1, 2).
        vocab_size: number of ids (3 specials + the alphabet).
    """

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has duplicate characters: {alphabet!r}")
        self.specials = [PAD, BOS, EOS]
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.alphabet = alphabet
        self._stoi = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
        self._itos = {i: c for c, i in self._stoi.items()}
        self.vocab_size = len(self.specials) + len(alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``'s characters, optionally wrapped in ``<bos>``/``<eos>``."""
        try:
            ids = [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first ``<eos>``; ``<pad>``/``<bos>`` are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if i not in self._itos:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self._itos[i])
        return "".join(out)
