"""Prompt encoding (in the API server) and the detokenizer worker of the server."""
