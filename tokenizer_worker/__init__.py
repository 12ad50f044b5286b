"""Tokenizer worker: chat templates, tokenization, detokenization and stop strings."""
