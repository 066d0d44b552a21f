"""`omnia-bench`: same-process, same-checkpoint, same-token-stream benchmarks of the engine
against mlx-lm and against earlier revisions of itself (see docs/benchmarks.md)."""

import mlx_omnia

# The engine loads the system BLAS into the global symbol scope, which works only before
# mlx.core is imported: import it (through the public API) before any bench module imports MLX.
_ENGINE_FIRST = mlx_omnia.runtime_info
