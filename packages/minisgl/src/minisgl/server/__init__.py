"""The online server: launcher, OpenAI-compatible API server, scheduler worker."""
