//! GGUF vocabulary to a tokenizers BPE (being written).
