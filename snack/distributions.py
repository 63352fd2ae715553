"""How a global sparsity is spread over the layers of a model (``sparsify(distribution=...)``).

* ``"uniform"``: every layer gets the same sparsity.
* ``"erk"``: Erdős–Rényi-Kernel (Evci et al., *Rigging the Lottery*, 2020; for linear layers it is
  the Erdős–Rényi rule of Mocanu et al., 2018). A layer of shape ``(out, in)`` gets density

      d_l = ε · (out_l + in_l) / (out_l · in_l)

  i.e. about ``ε · (out + in)`` connections, so narrow layers (a 10-wide classifier) stay denser
  and wide square layers get sparser. ``ε`` is chosen so the model keeps exactly the global
  number of connections:

      Σ_l d_l · n_l = (1 - s) · Σ_l n_l,   n_l = out_l · in_l
      ⇒ ε = ((1 - s) · Σ_l n_l) / Σ_l (out_l + in_l)

  A convolution's weight ``(out, in, kh, kw)`` gets the kernel-aware rule of Evci et al.,
  ``d_l = ε · (out + in + kh + kw) / (out · in · kh · kw)`` (a 1-D one's ``(out, in, k)``:
  ``(out + in + k) / (out · in · k)``; a 3-D one's ``(out, in, kd, kh, kw)`` likewise): every rule
  here is the sum of the weight's dimensions over their product, and the budget below holds for
  any of them.

  A density above 1 is impossible, so such layers are made fully dense (density 1), their
  connections are taken out of the budget, and ε is solved again over the remaining layers;
  repeat until no layer exceeds 1 (at most one round per layer, since each round makes at least
  one more layer dense and the budget of the rest only shrinks by what those layers hold).
"""

from __future__ import annotations

import math
import numbers

from snack.topology import check_shape, check_sparsity

DISTRIBUTIONS = ("uniform", "erk")

__all__ = ["DISTRIBUTIONS", "erk_densities", "layer_sparsities"]


def erk_densities(shapes: dict[str, tuple[int, ...]], density: float) -> dict[str, float]:
    """ERK density per layer (name → ``(out, in)``, or a convolution's ``(out, in, kh, kw)``,
    ``(out, in, k)`` or ``(out, in, kd, kh, kw)``) so the layers together keep ``density``.

    Returns name → density in ``(0, 1]``; ``Σ d_l · n_l = density · Σ n_l`` (up to float error).
    Raises ``ValueError`` for a density outside ``(0, 1]`` or a layer with a side of 0.
    """
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a float in (0, 1], got {type(density).__name__} {density!r}")
    if not 0.0 < density <= 1.0:  # NaN fails this too
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    for name, shape in shapes.items():
        try:
            if len(shape) not in (2, 3, 4, 5):
                raise ValueError(
                    f"a shape must be (out, in), (out, in, k), (out, in, kh, kw) or (out, in, kd, kh, kw), got "
                    f"{tuple(shape)}"
                )
            check_shape(shape[0], shape[1])
            for size in shape[2:]:  # the kernel's sizes
                check_shape(size, size)
        except (TypeError, ValueError) as error:
            raise type(error)(f"layer {name!r}: {error}") from None
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    raw = {name: sum(shape) / math.prod(shape) for name, shape in shapes.items()}
    budget = density * sum(sizes.values())
    dense: set[str] = set()
    while True:
        free = [name for name in shapes if name not in dense]
        if not free:
            return {name: 1.0 for name in shapes}
        remaining = budget - sum(sizes[name] for name in dense)
        # Σ_free ε · raw_l · n_l = remaining, and raw_l · n_l = out_l + in_l (+ kh_l + kw_l)
        epsilon = remaining / sum(raw[name] * sizes[name] for name in free)
        over = [name for name in free if epsilon * raw[name] > 1.0]
        if not over:
            result = {name: epsilon * raw[name] for name in free}
            result.update({name: 1.0 for name in dense})
            return {name: result[name] for name in shapes}
        dense.update(over)


def layer_sparsities(shapes: dict[str, tuple[int, ...]], sparsity: float, distribution: str) -> dict[str, float]:
    """Per-layer sparsity for layers of ``shapes`` (name → ``(out, in)``, ``(out, in, k)`` or
    ``(out, in, kh, kw)``) at overall ``sparsity``.

    See the module docstring for the distributions. The result is name → sparsity in ``[0, 1)``;
    a layer ERK makes fully dense gets ``0.0``.
    """
    sparsity = check_sparsity(sparsity)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if distribution == "uniform" or not shapes:
        return {name: sparsity for name in shapes}
    densities = erk_densities(shapes, 1.0 - sparsity)
    return {name: max(0.0, 1.0 - d) for name, d in densities.items()}
