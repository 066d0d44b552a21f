"""The model-agnostic generation loop: sampling, stop handling, token streaming."""
