"""Shared pieces of the data tests: a tiny corpus and a BPE tokenizer trained offline."""

import json
import os


def write_corpus(root) -> str:
    """A few .txt and .jsonl files of English-like text; returns the directory."""
    d = os.path.join(root, "corpus")
    os.makedirs(os.path.join(d, "more"), exist_ok=True)
    words = ("the expert router sends every token to the experts it picks and the experts send back "
             "their outputs weighted by the router so the layer learns which expert knows what ").split()
    for i in range(3):
        text = " ".join(words[(i * 7 + j) % len(words)] for j in range(1500))
        with open(os.path.join(d, f"part{i}.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(d, "more", "rows.jsonl"), "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(60)), "id": i}) + "\n")
    return d


def train_tokenizer(root, corpus_dir, vocab_size: int = 300) -> str:
    """A byte-level BPE ``tokenizer.json`` trained on ``corpus_dir`` (plus tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fmoe.data import documents
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for _, text in documents(corpus_dir)), trainer)
    out = os.path.join(root, "tok")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return out
