"""omnia-server: the engine over HTTP, speaking the OpenAI, Anthropic and Gemini APIs.

Uses the engine's public API only (`mlx_omnia`), never its internals."""
