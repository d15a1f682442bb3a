"""Tokenizer / detokenizer worker of the server."""
