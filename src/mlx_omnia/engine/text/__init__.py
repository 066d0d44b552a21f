"""Tokenizers, incremental detokenization and chat templates."""
