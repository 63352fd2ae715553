"""How a global sparsity is spread over the layers of a model (``sparsify(distribution=...)``)."""

from __future__ import annotations

from snack.topology import check_sparsity

DISTRIBUTIONS = ("uniform", "erk")


def layer_sparsities(shapes: dict[str, tuple[int, int]], sparsity: float, distribution: str) -> dict[str, float]:
    """Per-layer sparsity for layers of ``shapes`` (name → ``(out, in)``) at overall ``sparsity``.

    * ``"uniform"``: every layer gets ``sparsity``.
    """
    sparsity = check_sparsity(sparsity)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if distribution == "erk":
        raise NotImplementedError("distribution='erk' is not available yet; use distribution='uniform'")
    return {name: sparsity for name in shapes}
