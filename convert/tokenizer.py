"""CLIP's tokenizer files, built offline from CLIP's BPE merges, which ship with sdnpu (``convert/data/``: the
file OpenAI's CLIP and OpenCLIP distribute, MIT licence, its provenance in ``convert/data/README.md``).

SDXL's two text encoders share CLIP's 49,408-token vocabulary: 256 byte symbols, the same 256 with the
end-of-word marker ``</w>``, 48,894 merges, then ``<|startoftext|>`` and ``<|endoftext|>``.
``bpe_simple_vocab_16e6.txt.gz`` holds the merges after one header line.
"""

from __future__ import annotations

import gzip
import json
import math
from functools import lru_cache
from pathlib import Path

from sdnpu.errors import SdnpuError

N_MERGES = 48_894
VOCAB_SIZE = 49_408
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable-character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


MERGES_FILE = "bpe_simple_vocab_16e6.txt.gz"


def bpe_merges_path() -> Path:
    """The merges file shipped in the package (``sdnpu.convert``'s ``data/``)."""
    path = Path(__file__).resolve().parent / "data" / MERGES_FILE
    if not path.is_file():
        raise SdnpuError(f"CLIP's BPE merges are missing from this install of sdnpu: {path}",
                         hint="reinstall sdnpu (the wheel ships convert/data/" + MERGES_FILE + ")")
    return path


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """CLIP's vocabulary (token → id) and merges (``"a b"`` lines), in CLIP's order."""
    lines = gzip.decompress(bpe_merges_path().read_bytes()).decode("utf-8").split("\n")
    merges = lines[1 : 1 + N_MERGES]
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m.split(" ")) for m in merges]
    tokens += [BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != VOCAB_SIZE:
        raise SdnpuError(f"built a CLIP vocabulary of {len(vocab)} tokens, expected {VOCAB_SIZE}")
    return vocab, merges


def tokenizer_files(pad_token: str, model_max_length: int = 77) -> dict[str, bytes]:
    """The files of a Hugging Face ``CLIPTokenizer`` folder: SDXL's ``tokenizer/`` pads with
    ``<|endoftext|>``, its ``tokenizer_2/`` with ``!``."""
    vocab, merges = clip_vocab_and_merges()
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": pad_token}
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": model_max_length,
        "do_lower_case": True,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": True,
        **special,
    }

    def dump(obj: object) -> bytes:
        return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode("utf-8"),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8"),
        "special_tokens_map.json": dump(special),
        "tokenizer_config.json": dump(config),
    }


T5_VOCAB_SIZE = 32_100  # T5's: 32,000 SentencePiece pieces, then <extra_id_0..99>
T5_SPECIAL = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5


def t5_tokenizer_files(model_max_length: int = 77) -> dict[str, bytes]:
    """A ``T5TokenizerFast`` folder (``tokenizer.json`` and its config) for the presets' T5 encoder.

    T5's SentencePiece model ships in no package this project can install, so this is a **stand-in in T5's
    format**, not T5's vocabulary: a Unigram model (SentencePiece's algorithm, ``▁`` marking a word's start,
    ``</s>`` appended, ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, then 100 ``<extra_id_N>``) whose pieces are
    CLIP's BPE tokens in CLIP's merge order (a word-final CLIP token ``xyz</w>`` becomes the word-initial
    piece ``▁xyz``), scored by that order. It tokenizes real text into plausible pieces, which is what seeded
    weights need; a local folder brings its own ``tokenizer_3``."""
    # tokenizers for a T5 tokenizer only: the CLI starts without it (4 ms)
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab, _ = clip_vocab_and_merges()
    byte_chars = set(_bytes_to_unicode().values())
    pieces: list[str] = []
    seen: set[str] = set(T5_SPECIAL)
    for token in vocab:  # CLIP's order: single symbols first, then merges by frequency
        if token in (BOS, EOS):
            continue
        text = "▁" + token[: -len("</w>")] if token.endswith("</w>") else token
        if any(c not in byte_chars for c in text.lstrip("▁")) or text in seen or text == "▁":
            continue
        # byte symbols outside printable ASCII stand for raw bytes in CLIP; only ASCII is the same character
        if any(ord(c) > 126 for c in text.lstrip("▁")):
            continue
        seen.add(text)
        pieces.append(text)
        if len(pieces) == T5_VOCAB_SIZE - 100 - len(T5_SPECIAL) - 1:
            break
    pieces.insert(0, "▁")
    # Zipf's law as the log-probability, a bare character or "▁" far less likely: a word's own piece (``▁a``
    # included) beats spelling it out
    scored = [(p, 0.0) for p in T5_SPECIAL] + [(p, -math.log(i + 2) - (8.0 if len(p.lstrip("▁")) < 1 + (p[0] != "▁")
                                                                       else 0.0)) for i, p in enumerate(pieces)]
    scored += [(f"<extra_id_{i}>", 0.0) for i in range(99, -1, -1)]
    tok = Tokenizer(models.Unigram(scored, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" {2,}", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(list(T5_SPECIAL) + [f"<extra_id_{i}>" for i in range(100)])
    if tok.get_vocab_size() != T5_VOCAB_SIZE:
        raise SdnpuError(f"built a T5-format vocabulary of {tok.get_vocab_size()} pieces, expected {T5_VOCAB_SIZE}")
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": model_max_length, "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "extra_ids": 100, "clean_up_tokenization_spaces": True,
              "additional_special_tokens": [f"<extra_id_{i}>" for i in range(100)]}
    special = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    return {
        "tokenizer.json": tok.to_str().encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        "special_tokens_map.json": (json.dumps(special, indent=2) + "\n").encode("utf-8"),
    }


QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's first special tokens, in its order


@lru_cache(maxsize=1)
def qwen_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """The stand-in Qwen2 vocabulary (token -> id) and merges, byte-level BPE as Qwen2's is (GPT-2's byte
    table; ``Ġ`` a space): the 256 byte symbols; CLIP's merges that join pieces inside a word (those without
    ``</w>``, a set closed under what they build); then, for each of CLIP's whole words (its word-final tokens of
    ASCII letters, in CLIP's order), the merges that join its pieces left to right into one token, in four
    forms: after a space and not, lower-case and capitalized (``Ġthe``, ``the``, ``ĠThe``, ``The``), as Qwen2
    has a token for a common word in each; then Qwen2's special tokens (``QWEN_SPECIAL``). Every merge added
    for a word ranks after every merge its pieces are made by, so each word comes out one token."""
    _, clip_merges = clip_vocab_and_merges()
    tokens = list(_bytes_to_unicode().values())
    seen = set(tokens)
    merges: list[str] = []
    ranks: dict[tuple[str, str], int] = {}

    def add(a: str, b: str) -> None:
        if (a, b) not in ranks:
            ranks[(a, b)] = len(merges)
            merges.append(f"{a} {b}")
            if a + b not in seen:
                seen.add(a + b)
                tokens.append(a + b)

    for m in clip_merges:
        a, b = m.split(" ")
        if "</w>" not in m and a + b not in seen:
            add(a, b)

    def pieces(word: str) -> list[str]:  # BPE: the lowest-ranked merge first, until none applies
        parts = list(word)
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, len(merges)), i) for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == len(merges):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    words = [t[: -len("</w>")] for t in clip_vocab_and_merges()[0] if t.endswith("</w>")]
    for word in (w for w in words if len(w) > 1 and w.isascii() and w.isalpha()):
        for form in ("Ġ" + word, word, "Ġ" + word.capitalize(), word.capitalize()):
            parts = pieces(form)
            joined = parts[0]
            for part in parts[1:]:
                add(joined, part)
                joined += part
    tokens += list(QWEN_SPECIAL)
    return {tok: i for i, tok in enumerate(tokens)}, merges


def qwen_tokenizer_files(model_max_length: int = 32768) -> dict[str, bytes]:
    """A ``Qwen2Tokenizer`` folder (``vocab.json``, ``merges.txt`` and its config) for the presets' Qwen2.5-VL
    text encoder, which both the slow tokenizer (diffusers' ``QwenImagePipeline`` loads it) and the fast one
    (``AutoTokenizer``: converted from the same files) read.

    Qwen2's vocabulary (151,643 byte-level BPE tokens) ships in no package this project installs, so this is a
    **stand-in in Qwen2's format**, not Qwen2's vocabulary: byte-level BPE over GPT-2's byte table (Qwen2's),
    with Qwen2's pre-tokenizer (the slow tokenizer's, its fast conversion's), whose merges are built from CLIP's
    (``qwen_vocab_and_merges``: CLIP's pieces inside words, then CLIP's whole words as one token each, after a
    space and not, lower-case and capitalized), and Qwen2's special tokens ``<|endoftext|>`` (the padding),
    ``<|im_start|>``, ``<|im_end|>`` after them. It cuts English as Qwen2 does, a word a token: the template's
    system prompt, which ``QwenImagePipeline`` drops by count (``prompt_template_encode_start_idx``), is 34
    tokens in both. Real text gets plausible pieces, which is what seeded weights need. A local folder brings
    its own ``tokenizer``."""
    vocab, merges = qwen_vocab_and_merges()
    added = {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True} for t in QWEN_SPECIAL}
    config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": model_max_length, "errors": "replace",
              "bos_token": None, "unk_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "added_tokens_decoder": added, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode("utf-8"),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        "special_tokens_map.json": (json.dumps(special, indent=2) + "\n").encode("utf-8"),
    }
