from transformers import CLIPTokenizer

from sdnpu.convert.tokenizer import (
    VOCAB_SIZE,
    clip_vocab_and_merges,
    qwen_tokenizer_files,
    qwen_vocab_and_merges,
    tokenizer_files,
)


def test_vocabulary_is_clips():
    vocab, merges = clip_vocab_and_merges()
    assert len(vocab) == VOCAB_SIZE == 49408
    assert len(merges) == 48894
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert vocab["!"] == 0 and vocab["a</w>"] == 320


def test_tokenizer_files_load_in_transformers(tmp_path):
    for name, pad, pad_id in [("tokenizer", "<|endoftext|>", 49407), ("tokenizer_2", "!", 0)]:
        folder = tmp_path / name
        folder.mkdir()
        for fname, data in tokenizer_files(pad).items():
            (folder / fname).write_bytes(data)
        tok = CLIPTokenizer.from_pretrained(folder)
        # Known CLIP ids: a=320, photo=1125, of=539, cat=2368.
        assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
        ids = tok("A photo", padding="max_length", max_length=77).input_ids
        assert len(ids) == 77 and ids[-1] == pad_id
        assert tok.model_max_length == 77


def test_the_qwen2_stand_in_loads_slow_and_fast_alike(tmp_path):
    """The stand-in Qwen2 tokenizer (byte-level BPE built from CLIP's merges, a word a token, Qwen2's special
    tokens after them): diffusers' slow Qwen2Tokenizer and transformers' fast one (converted from the same
    files) cut the chat template alike, keep its special tokens whole, cut the template's system prompt into
    Qwen2's 34 tokens (the ones QwenImagePipeline drops), and pad with <|endoftext|>; its ids fit
    tiny-qwen-image's text encoder."""
    import json

    from transformers import AutoTokenizer, Qwen2Tokenizer

    from sdnpu.convert.sources import PRESETS_DIR
    from sdnpu.runtime.qwenimage import PROMPT_TEMPLATE
    from sdnpu.signatures import QWEN_TEMPLATE_TOKENS

    for fname, data in qwen_tokenizer_files().items():
        (tmp_path / fname).write_bytes(data)
    slow, fast = Qwen2Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(fast).__name__ == "Qwen2TokenizerFast"
    vocab, merges = qwen_vocab_and_merges()
    assert not any("</w>" in m for m in merges) and len(vocab) == 150_900  # Qwen2's: 151,643 and its specials
    prefix = slow(PROMPT_TEMPLATE.split("{}")[0]).input_ids
    assert len(prefix) == QWEN_TEMPLATE_TOKENS == 34
    assert slow.convert_ids_to_tokens(prefix)[3:8] == ["Describe", "Ġthe", "Ġimage", "Ġby", "Ġdetailing"]
    assert fast.tokenize(" a red bicycle, leaning") == ["Ġa", "Ġred", "Ġbicycle", ",", "Ġleaning"]
    for prompt in ("a photo of a cat", "Ein Fahrrad, 2 Räder! 自行车"):
        text = PROMPT_TEMPLATE.format(prompt)
        ids = slow(text).input_ids
        assert fast(text).input_ids == ids and slow.decode(ids) == text
        assert ids[0] == vocab["<|im_start|>"] and ids.count(vocab["<|im_end|>"]) == 2
    assert slow.pad_token_id == fast.pad_token_id == vocab["<|endoftext|>"]
    config = json.loads((PRESETS_DIR / "tiny-qwen-image" / "text_encoder" / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == len(vocab)
