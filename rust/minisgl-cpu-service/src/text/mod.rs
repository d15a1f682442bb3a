//! Tokenization, chat templates and incremental detokenization (no Python).
