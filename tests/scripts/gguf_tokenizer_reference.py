#!/usr/bin/env python3
"""Token counts and FNV-1a hashes of texts tokenized by Hugging Face `transformers`'
GGUF tokenizer builder, for tests/tests/model_gemma.rs (recorded there by hand).

    python3 -m pip install transformers==5.24.0   # no torch needed
    python3 gguf_tokenizer_reference.py MODEL.gguf TEXT...

`transformers.integrations.gguf` reads GGUF metadata through torch; this script reads the
metadata itself (`reference_forward.read_header`: the header only, so the first chunk of
a split file is enough) and
hands it to the same builder (`convert_gguf_tokenizer`). For Gemma it
then also adds the file's all-space user-defined pieces (token type 4, stored with real
spaces) as whole-match tokens, longest first: SentencePiece matches user-defined pieces
that way and so does llama.cpp, while transformers' builder respells them to `▁` runs
and leaves them to the BPE merges (54 spaces become 16 + 16 + 22 instead of 31 + 23).
With that one rule its ids equal rotkv's on alice29.txt and lcet10.txt. Texts are read
with universal newlines; ids are hashed as little-endian u32 bytes.
"""
import sys

from reference_forward import read_header  # the same directory: the GGUF header reader
from tokenizers import AddedToken
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def fnv(ids):
    h = 0xCBF29CE484222325
    for t in ids:
        for b in int(t).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main():
    meta, _, _ = read_header(open(sys.argv[1], "rb").read(256 << 20))
    d = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    arch = meta["general.architecture"]
    tok, _ = convert_gguf_tokenizer(arch, d)
    if arch.startswith("gemma"):
        runs = [t for t, ty in zip(d["tokens"], d["token_type"]) if ty == 4 and " " in t and not t.strip()]
        tok.add_tokens([AddedToken("\u2581" * len(t), normalized=True, special=False) for t in runs])
    for path in sys.argv[2:]:
        ids = tok.encode(open(path, newline=None).read(), add_special_tokens=False).ids
        print(f"{path.split('/')[-1]}: {len(ids)} tokens, FNV-1a 0x{fnv(ids):016x}")


if __name__ == "__main__":
    main()
