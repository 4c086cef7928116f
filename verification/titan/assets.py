"""Tokenizer and text data set for TorchTitan's llama3 debug model, made here.

The ``torchtitan`` wheel ships neither the tokenizer its debug configs point at
(``./tests/assets/tokenizer``) nor the ``c4_test`` data set (both live in the source
repository only).  Instead of copying them, this module writes a small stand-in pair
into a directory of your choice, deterministically, from nothing but a seed:

- ``tokenizer/``: a word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)
  with 2000 made-up words plus ``<|begin_of_text|>`` / ``<|end_of_text|>``, which fits the
  debug model's 2048-entry embedding;
- ``c4_test/data.json``: JSON lines with a ``text`` field, the shape of C4 samples.

TorchTitan is then pointed at them with its own options ``--hf_assets_path DIR/tokenizer``
and ``--dataloader.dataset_path DIR/c4_test``.  Both the fake-CUDA run and its CPU
reference read the same files, so their losses are comparable; the loss values are not
those of TorchTitan's own CI.
"""
from __future__ import annotations

import json
import os
import random
import sys

WORDS = 2000
DOCUMENTS = 400
SEED = 1234


def _words(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < WORDS:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables)))
    return sorted(words)


def write_assets(directory: str) -> tuple[str, str]:
    """Write the tokenizer and the data set under ``directory``; returns their two paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(SEED)
    words = _words(rng)
    tokenizer_dir = os.path.join(directory, "tokenizer")
    data_dir = os.path.join(directory, "c4_test")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)

    vocab = {"<unk>": 0}
    for word in words + [".", ","]:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "add_bos_token": True, "add_eos_token": True,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)

    # Zipf-like word frequencies and short "sentences", so the model has something to learn.
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(DOCUMENTS):
            sentences = []
            for _ in range(rng.randint(5, 40)):
                sentence = rng.choices(words, weights, k=rng.randint(4, 16))
                sentences.append(" ".join(sentence) + " .")
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return tokenizer_dir, data_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python verification/titan/assets.py DIRECTORY")
    for path in write_assets(sys.argv[1]):
        print(path)
