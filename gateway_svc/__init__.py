"""The HTTP gateway: OpenAI-compatible API, tokenization, streaming, detokenization."""
