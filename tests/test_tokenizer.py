from transformers import CLIPTokenizer

from sdnpu.convert.tokenizer import VOCAB_SIZE, clip_vocab_and_merges, tokenizer_files


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
