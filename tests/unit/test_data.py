"""fmoe.data: text and jsonl sources, a Hugging Face tokenizer, memmap shards, batches."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from fmoe.data import (ByteTokenizer, TokenStream, documents, load_tokenizer, open_data, open_shards, prepare,
                       write_shards)


def test_documents_read_txt_and_jsonl_text_fields_in_sorted_order(corpus):
    _, d, _ = corpus
    docs = list(documents(d))
    files = [os.path.relpath(f, d) for f, _ in docs]
    assert files[:3] == ["more/rows.jsonl"] * 3 and files[-3:] == ["part0.txt", "part1.txt", "part2.txt"]
    assert len(docs) == 23 and all(isinstance(t, str) and t for _, t in docs)
    with open(os.path.join(d, "more", "rows.jsonl")) as f:
        assert docs[0][1] == json.loads(f.readline())["text"]


def test_hf_tokenizer_is_loaded_with_its_eos_and_round_trips(corpus):
    _, d, tok_dir = corpus
    tok = load_tokenizer(tok_dir)                    # a directory holding tokenizer.json
    assert tok.vocab_size == 300 and tok.eos_id == 0   # <|endoftext|> is the first special token
    ids = tok.encode("the router sends every token")
    assert 0 < len(ids) < len("the router sends every token")          # BPE merged bytes
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).decode(ids) == "the router sends every token"
    assert load_tokenizer(os.path.join(tok_dir, "tokenizer.json")).encode("x y") == tok.encode("x y")
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer) and isinstance(load_tokenizer(None), ByteTokenizer)


def test_shards_hold_exactly_the_on_the_fly_stream_and_give_the_same_batches(corpus, tmp_path):
    _, d, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    header = prepare([d], tok, tmp_path / "shards", shard_tokens=1000, progress=False)
    assert header["dtype"] == "uint16" and header["vocab_size"] == 300 and len(header["shards"]) > 2
    live, shards = open_data(d, tok), open_data(str(tmp_path / "shards"), tok)
    assert isinstance(shards.parts[0], np.memmap) and len(shards.parts) == len(header["shards"])
    assert np.array_equal(live.tokens(), shards.tokens()) and len(live) == header["tokens"]
    assert (live.tokens() == tok.eos_id).sum() == 23                     # one separator per document
    for (a, b) in ((live, shards), live.split(0.1)[1:] + shards.split(0.1)[1:]):
        for step in (1, 7):
            for bi in range(3):
                x1, y1 = a.batch(step, bi, 4, 32, seed=3, num_batches=3)
                x2, y2 = b.batch(step, bi, 4, 32, seed=3, num_batches=3)
                assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.dtype == torch.int64


def test_each_data_parallel_batch_reads_a_disjoint_slice():
    n, nb, seq = 10_000, 4, 16
    s = TokenStream([np.arange(n // 3, dtype=np.uint32), np.arange(n // 3, n, dtype=np.uint32)])
    for step in range(1, 30):
        rows = [s.batch(step, b, 8, seq, seed=0, num_batches=nb) for b in range(nb)]
        for b, (x, y) in enumerate(rows):
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert (x >= n * b // nb).all() and (y < n * (b + 1) // nb).all()     # inside its own slice
            assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, seq - 1, dtype=torch.long))   # contiguous
    again = s.batch(5, 2, 8, seq, seed=0, num_batches=nb)
    assert all(torch.equal(a, b) for a, b in zip(again, s.batch(5, 2, 8, seq, seed=0, num_batches=nb)))
    assert not torch.equal(again[0], s.batch(6, 2, 8, seq, seed=0, num_batches=nb)[0])
    assert not torch.equal(again[0], s.batch(5, 2, 8, seq, seed=1, num_batches=nb)[0])


def test_split_and_bad_inputs(tmp_path):
    train, held = TokenStream([np.arange(1000, dtype=np.uint16)]).split(0.05)
    assert len(train) == 950 and held.tokens()[0] == 950
    with pytest.raises(ValueError, match="seq=64 needs at least 66"):
        held.batch(1, 0, 2, 64, seed=0, num_batches=1)
    with pytest.raises(ValueError, match=r"batch_index=2 must be in \[0, 2\)"):
        train.batch(1, 2, 2, 8, seed=0, num_batches=2)
    with pytest.raises(ValueError, match="no such file"):
        open_data(str(tmp_path / "missing.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="must end in .txt or .jsonl"):
        open_data(str(tmp_path / "x.csv"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n')
    with pytest.raises(ValueError, match="line 2: expected an object with a string field 'text'"):
        open_data(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="not 'bytes', a tokenizer.json file"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="token ids must be in"):
        write_shards(str(tmp_path / "s"), [np.array([1, 300])], vocab_size=256)
    write_shards(str(tmp_path / "t"), [np.arange(10, dtype=np.uint8)], vocab_size=256)
    with open(tmp_path / "t" / "shard-00000.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="11 bytes on disk, header says 10 uint8 tokens"):
        open_shards(str(tmp_path / "t"))
    with pytest.raises(ValueError, match="the built-in corpus is byte tokens"):
        open_data(None, _NotBytes())


class _NotBytes:
    name, vocab_size, eos_id = "other", 300, None


def test_prepare_command_writes_shards_with_a_progress_bar(corpus, tmp_path, capfd):
    from fmoe.cli.data import main       # fmoe data in this process (test_docs_training.py runs it as a process)
    _, d, tok_dir = corpus
    out = tmp_path / "sh"
    capfd.readouterr()
    code = main(["prepare", "--tokenizer", tok_dir, "--out", str(out), "--shard-tokens", "2000", d])
    r = capfd.readouterr()
    assert code == 0, r.err
    summary = json.loads(r.out.strip().splitlines()[-1])
    assert "tokenizing" in r.err and "file" in r.err                         # tqdm's bar
    assert summary["tokens"] == len(open_data(d, load_tokenizer(tok_dir))) and summary["shards"] >= 2
    code = main(["prepare", "--out", str(out), d])
    assert code == 2 and "is not an empty directory" in capfd.readouterr().err


def test_prepare_is_all_or_nothing_and_headers_are_checked_field_by_field(corpus, tmp_path):
    """A prepare that fails half-way leaves no directory (a rerun just works); every header
    field read back is checked (types, ranges, file names inside the directory)."""
    _, d, tok_dir = corpus
    out = str(tmp_path / "sh")

    def chunks():
        yield np.arange(100, dtype=np.uint16)
        raise OSError(28, "No space left on device")      # fault injection: the disk fills mid-way

    with pytest.raises(OSError, match="No space left"):
        write_shards(out, chunks(), vocab_size=256, shard_tokens=30)
    assert not os.path.exists(out) and os.listdir(tmp_path) == []                 # nothing partial
    write_shards(out, [np.arange(100, dtype=np.uint16)], vocab_size=256, shard_tokens=30)   # the rerun
    assert open_shards(out).tokens().tolist() == list(range(100))
    header = json.loads(open(os.path.join(out, "header.json")).read())
    for change, match in (({"vocab_size": True}, "'vocab_size' must be an integer in"),
                          ({"vocab_size": 70000}, r"'vocab_size' must be an integer in \[1, 256\]"),
                          ({"eos_id": 999}, r"'eos_id' must be null or an integer in \[0, 256\)"),
                          ({"tokenizer": 3}, "'tokenizer' must be a string"),
                          ({"shards": [{"file": "../x.bin", "tokens": 1}]}, "must name a file inside"),
                          ({"shards": [{"file": "shard-00000.bin", "tokens": "30"}]}, "integer 'tokens' >= 0")):
        bad = str(tmp_path / f"bad{len(os.listdir(tmp_path))}")
        shutil.copytree(out, bad)
        with open(os.path.join(bad, "header.json"), "w") as f:
            json.dump({**header, **change}, f)
        with pytest.raises(ValueError, match=match):
            open_shards(bad)


# ---------------------------------------------------------------- errors that name the file; streaming
def test_text_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello\n" * 3 + b"caf\xe9 au lait\n")
    with pytest.raises(ValueError, match=rf"data '{bad}': not UTF-8 text \(invalid continuation byte at byte 21\)"):
        open_data(str(bad))
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"data '{rows}': not UTF-8 text \(invalid start byte at byte 25\)"):
        open_data(str(rows))


def test_a_shard_header_that_is_not_utf8_names_the_file(tmp_path):
    write_shards(str(tmp_path / "s"), [np.arange(50, dtype=np.uint8)], vocab_size=256, eos_id=0)
    (tmp_path / "s" / "header.json").write_bytes(b'{"format": "fmoe-tokens", "x": "\xff"}')
    with pytest.raises(ValueError, match=r"s/header.json \(.*can't decode byte 0xff"):
        open_shards(str(tmp_path / "s"))


def test_a_tokenizer_config_that_is_not_an_object_is_named_as_such(corpus, tmp_path):
    _, _, tok_dir = corpus
    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer config '.*tokenizer_config.json': must be a JSON object .* got a list"):
        load_tokenizer(str(d))
    (d / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"tokenizer config '.*tokenizer_config.json': not a JSON file"):
        load_tokenizer(str(d))


def test_a_long_one_line_text_file_is_tokenized_in_pieces_with_little_memory(tmp_path):
    """A one-line 6 MB file: the ids equal the whole text's bytes, and the peak Python/numpy memory
    while reading is a few bytes per input byte (a list of ints held 26)."""
    import tracemalloc

    words = np.random.default_rng(0).integers(97, 123, size=6_000_000, dtype=np.uint8)
    words[::7] = 32                                              # spaces: words of 6 letters
    text = words.tobytes()
    path = tmp_path / "one_line.txt"
    path.write_bytes(text)
    tracemalloc.start()
    try:
        stream = open_data(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ids = stream.tokens(0, len(text) + 1)
    assert np.array_equal(ids, np.append(words, 0))                     # NUL ends the document
    assert peak < 3 * len(text), f"peak {peak / len(text):.1f} bytes per input byte"
