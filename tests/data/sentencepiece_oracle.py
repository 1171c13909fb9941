"""Oracle for the SentencePiece-style tokenizer tests, from PyPI: byte-fallback BPE
tokenizer.json files (Llama-2 / Mistral kind) trained with Hugging Face `tokenizers`, and
SentencePiece .model files trained and run with the `sentencepiece` package. Encoding a
tokenizer.json is bpe_oracle.py's `encode`.

Texts travel as base64 of their bytes (JSON lists). tokenizers gets them decoded with
errors="replace" (moe's documented behaviour); sentencepiece gets the raw bytes, as the
C++ library does.

  train-hf  --style legacy|legacy-spanning|metaspace-first|metaspace-split|unk --vocab N --texts T --out tokenizer.json
  train-spm --model-type bpe|unigram --vocab N --texts T --out x.model [--no-byte-fallback] [--no-eos]
            [--normalization nmt_nfkc|identity|nfkc_cf]
  encode-spm --model x.model --texts T --out ids.json
"""
import argparse
import base64
import io
import json

SPECIALS = ["<unk>", "<s>", "</s>"]
METASPACE = "\u2581"
# The decoder Llama-2 and Mistral files carry.
DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": METASPACE}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
]}
LEGACY_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": METASPACE},
    {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE},
]}


def raw_texts(path):
    with open(path) as f:
        return [base64.b64decode(t) for t in json.load(f)]


def train_hf(args):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_fallback = args.style != "unk"
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=byte_fallback, fuse_unk=True))
    # Words split at spaces keep training fast; the pipeline of the file is set below.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    # Few characters: the rest (CJK, emoji, most symbols) fall back to bytes or unk.
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=SPECIALS, limit_alphabet=80,
                                  show_progress=False)
    tok.train_from_iterator([t.decode("utf-8", errors="replace") for t in raw_texts(args.texts)], trainer)
    spec = json.loads(tok.to_str())
    if byte_fallback:  # Llama-2's layout: specials, then <0x00>..<0xFF>, then the rest
        vocab = spec["model"]["vocab"]
        shifted = {t: (i if i < len(SPECIALS) else i + 256) for t, i in vocab.items()}
        for b in range(256):
            shifted["<0x%02X>" % b] = len(SPECIALS) + b
        spec["model"]["vocab"] = shifted
    if args.style == "legacy-spanning":  # a token across a space: encoding must not cut there
        vocab = spec["model"]["vocab"]
        for pair in (["e", METASPACE], ["s", METASPACE]):
            if "".join(pair) not in vocab:
                vocab["".join(pair)] = len(vocab)
                spec["model"]["merges"].insert(0, pair)
    decoder = json.loads(json.dumps(DECODER))
    if not byte_fallback:
        del decoder["decoders"][1]
    spec["decoder"] = decoder
    if args.style in ("legacy", "legacy-spanning", "unk"):
        spec["normalizer"], spec["pre_tokenizer"] = LEGACY_NORMALIZER, None
    elif args.style == "metaspace-first":
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": METASPACE, "prepend_scheme": "first", "split": False}
    else:
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": METASPACE, "prepend_scheme": "always", "split": True}
    text = json.dumps(spec)
    Tokenizer.from_str(text)  # the file must load in tokenizers
    with open(args.out, "w") as f:
        f.write(text)


def train_spm(args):
    import sentencepiece as spm

    lines = [l for t in raw_texts(args.texts) for l in t.decode("utf-8", errors="replace").split("\n") if l.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=args.vocab, model_type=args.model_type,
        byte_fallback=not args.no_byte_fallback, character_coverage=0.995, eos_id=-1 if args.no_eos else 2,
        normalization_rule_name=args.normalization, hard_vocab_limit=False, num_threads=2, minloglevel=2)
    with open(args.out, "wb") as f:
        f.write(model.getvalue())


def encode_spm(args):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=args.model)
    ids = [sp.EncodeAsIds(t) for t in raw_texts(args.texts)]
    decoded = [base64.b64encode(sp.DecodeIds(i).encode("utf-8")).decode() for i in ids]
    with open(args.out, "w") as f:
        json.dump({"ids": ids, "decoded": decoded, "vocab_size": sp.GetPieceSize(), "eos": sp.eos_id(),
                   "bos": sp.bos_id()}, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train-hf", "train-spm", "encode-spm"])
    p.add_argument("--style", default="legacy", choices=["legacy", "legacy-spanning", "metaspace-first", "metaspace-split", "unk"])
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--texts")
    p.add_argument("--out")
    p.add_argument("--model")
    p.add_argument("--no-byte-fallback", action="store_true")
    p.add_argument("--no-eos", action="store_true")
    p.add_argument("--normalization", default="nmt_nfkc", choices=["nmt_nfkc", "identity", "nfkc_cf"])
    args = p.parse_args()
    {"train-hf": train_hf, "train-spm": train_spm, "encode-spm": encode_spm}[args.mode](args)


if __name__ == "__main__":
    main()
