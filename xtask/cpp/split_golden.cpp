// llama.cpp's own pre-tokenizer split and code point classes, for `cargo xtask goldens --split`.
// Built against a llama.cpp source tree (src/unicode.cpp, src/unicode-data.cpp):
//   c++ -O2 -std=c++17 -I$LLAMA/src split_golden.cpp $LLAMA/src/unicode.cpp $LLAMA/src/unicode-data.cpp
// Usage:
//   split_golden classes        one byte per code point 0..0x10FFFF on stdout:
//                               letter | number<<1 | mark<<2 | whitespace<<3
//   split_golden split <file>   <file> holds texts, each as a u32 little-endian byte length and
//                               the bytes; prints one line per text: the qwen35 pre-token byte
//                               lengths, " |", the qwen2 ones.
#include "unicode.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

static const char * QWEN35 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char * QWEN2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

int main(int argc, char ** argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "classes") {
        std::vector<unsigned char> out(0x110000);
        for (uint32_t c = 0; c < 0x110000; ++c) {
            const auto f = unicode_cpt_flags_from_cpt(c);
            out[c] = (f.is_letter ? 1 : 0) | (f.is_number ? 2 : 0) | (f.is_accent_mark ? 4 : 0) |
                     (f.is_whitespace ? 8 : 0);
        }
        fwrite(out.data(), 1, out.size(), stdout);
        return 0;
    }
    if (mode == "split" && argc > 2) {
        std::ifstream in(argv[2], std::ios::binary);
        std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        size_t at = 0;
        while (at + 4 <= all.size()) {
            uint32_t n = (uint8_t) all[at] | ((uint8_t) all[at + 1] << 8) | ((uint8_t) all[at + 2] << 16) |
                         ((uint32_t) (uint8_t) all[at + 3] << 24);
            at += 4;
            const std::string text = all.substr(at, n);
            at += n;
            for (const char * re : {QWEN35, QWEN2}) {
                for (const auto & w : unicode_regex_split(text, {re}, false)) {
                    std::cout << w.size() << ' ';
                }
                if (re == QWEN35) {
                    std::cout << '|';
                }
            }
            std::cout << '\n';
        }
        return 0;
    }
    std::cerr << "usage: split_golden classes | split <file>\n";
    return 2;
}
