"""CLIP's tokenizer files, built offline from the BPE merges that ship in the open-clip-torch wheel.

SDXL's two text encoders share CLIP's 49,408-token vocabulary: 256 byte symbols, the same 256 with the
end-of-word marker ``</w>``, 48,894 merges, then ``<|startoftext|>`` and ``<|endoftext|>``. The wheel's
``open_clip/bpe_simple_vocab_16e6.txt.gz`` holds the merges after one header line. We locate it with
``importlib.util.find_spec`` and never import ``open_clip`` (that would pull torchvision).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
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


def bpe_merges_path() -> Path:
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise SdnpuError(
            "the open-clip-torch package is not installed, so CLIP's BPE merges cannot be found",
            hint="run `make venv` (it installs open-clip-torch with --no-deps)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise SdnpuError(f"CLIP's BPE merges are missing from the open-clip-torch install: {path}")
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
