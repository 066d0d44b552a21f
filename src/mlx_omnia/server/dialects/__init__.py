"""One module (OpenAI: a package, one module an API) per API dialect: request → (model, Chat | str,
GenerationOptions), pieces → response. `generation` is what they share to generate."""
