"""One module per API dialect: request → (model, Chat | str, GenerationOptions), pieces → response."""
