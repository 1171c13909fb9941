"""Oracle for the BPE tests: Hugging Face `tokenizers` and `tiktoken` from PyPI.

Texts travel as base64 of their bytes (JSON lists). Bytes that are not valid UTF-8 are
decoded with errors="replace", which is the behaviour moe's tokenizer documents.

  train   --pattern P --vocab N --texts T --out tokenizer.json [--nfc] [--ignore-merges]
  encode  --tokenizer tokenizer.json --texts T --out ids.json [--special]
  tiktoken --ranks FILE --pattern P --texts T --out ids.json
"""
import argparse
import base64
import json

PATTERNS = {
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}


def read_texts(path):
    with open(path) as f:
        return [base64.b64decode(t).decode("utf-8", errors="replace") for t in json.load(f)]


def train(args):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if args.pattern == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[args.pattern]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if args.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(read_texts(args.texts), trainer)
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = bool(args.ignore_merges)
    with open(args.out, "w") as f:
        json.dump(spec, f)


def encode(args):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    tok.encode_special_tokens = not args.special
    texts = read_texts(args.texts)
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    decoded = [base64.b64encode(tok.decode(i).encode("utf-8")).decode() for i in ids]
    with open(args.out, "w") as f:
        json.dump({"ids": ids, "decoded": decoded, "vocab_size": tok.get_vocab_size()}, f)


def tiktoken_encode(args):
    import os

    # An empty cache directory turns off tiktoken's cache, which would otherwise keep a copy
    # of every rank file it loads in $TMPDIR/data-gym-cache (one per test run).
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    enc = tiktoken.Encoding(name="moe-test", pat_str=PATTERNS[args.pattern],
                            mergeable_ranks=load_tiktoken_bpe(args.ranks), special_tokens={})
    ids = [enc.encode_ordinary(t) for t in read_texts(args.texts)]
    with open(args.out, "w") as f:
        json.dump({"ids": ids}, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "encode", "tiktoken"])
    p.add_argument("--pattern", default="gpt2")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--texts")
    p.add_argument("--out")
    p.add_argument("--tokenizer")
    p.add_argument("--ranks")
    p.add_argument("--nfc", action="store_true")
    p.add_argument("--ignore-merges", action="store_true")
    p.add_argument("--special", action="store_true")
    args = p.parse_args()
    {"train": train, "encode": encode, "tiktoken": tiktoken_encode}[args.mode](args)


if __name__ == "__main__":
    main()
