"""llama.cpp's token ids for `cargo xtask tokcheck ids`.

    python tokcheck.py VOCAB.gguf IN.bin OUT.bin SPECIAL

IN.bin holds texts, each a u32 little-endian byte length and the UTF-8 bytes; OUT.bin gets,
per text, a u32 count and the u32 ids (no BOS; parse_special = SPECIAL == "1").
"""
import struct
import sys

from llama_cpp import Llama


def main() -> int:
    vocab, inp, outp, special = sys.argv[1:5]
    llm = Llama(model_path=vocab, vocab_only=True, verbose=False)
    data = open(inp, "rb").read()
    at = 0
    out = bytearray()
    while at + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        text = data[at:at + n]
        at += n
        ids = llm.tokenize(text, add_bos=False, special=special == "1")
        out += struct.pack("<I", len(ids))
        out += struct.pack(f"<{len(ids)}I", *ids)
    open(outp, "wb").write(bytes(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
