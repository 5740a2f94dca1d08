"""Byte-level BPE tokenizers on the `tokenizers` library: train on code, load `tokenizer.json`, or
rebuild the one a GGUF file carries (the embedded default model's), identically to `transformers`.

Special tokens: the chat roles (`<|im_start|>`, `<|im_end|>`) and end-of-text are special
(never split, never produced from plain text). Tool calls and results are marked with
`<tool_call>`/`<tool_response>` tags, which are special tokens in tokenizers we train and plain
text in the SmolLM2 vocabulary (which has no such tokens); the chat renderer works with both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from opencomposer.core.errors import UserError

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>")


class TokenizerError(ValueError, UserError):
    pass


@dataclass
class Tokenizer:
    """A thin wrapper that owns a `tokenizers.Tokenizer` and its special tokens."""

    backend: object
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_plain(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and offsets of `text` as plain text: a special token's literal (`<|im_end|>`) in it
        becomes ordinary bytes, never the control id. For text that comes from tools, files and
        users (the chat renderer)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            from tokenizers import Tokenizer as Backend

            # A copy, not a flag flipped on the shared backend: other threads encode with it.
            plain = Backend.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self.__dict__["_plain"] = plain
        enc = plain.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def added_tokens(self) -> dict[str, int]:
        """Added tokens (specials and other atomic tokens) by their text."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(p))
        return p

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"tokenizer file not found: {p}")
        try:
            backend = Backend.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad JSON
            raise TokenizerError(f"{p}: not a tokenizer.json ({e})") from None
        return cls(backend, backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>"))

    @classmethod
    def from_gguf(cls, gguf) -> "Tokenizer":
        """The tokenizer a GGUF file describes (`tokenizer.ggml.*`), as `transformers` builds it for
        GPT-2-style BPE: byte-level pre-tokenisation without a prefix space, control tokens special."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        md = gguf.metadata
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"{gguf.path}: tokenizer model {model!r} is not supported (only gpt2-style BPE)")
        tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == 3]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(backend, bos, eos)


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, specials: Sequence[str] = CHAT_SPECIALS,
              min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (the 256 byte symbols are always in the vocabulary, so any input
    encodes) with the chat special tokens at the start of the vocabulary."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials):
        raise TokenizerError(f"vocab_size {vocab_size} is smaller than the byte alphabet plus specials")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>"))
