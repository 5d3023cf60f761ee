"""The data path: shard sources, the index, streaming reads and decoding, the tokenizer, and the
synthetic image generator (synthetic/)."""
