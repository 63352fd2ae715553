"""Record a layer's input ``X`` and output gradient ``dY`` during one training step.

RigL grows where ``|dYᵀ·X|`` is largest, which needs the batch of the update step. Hooks are
registered only while armed (the algorithm arms them right before an update step), so other
steps pay nothing. A forward hook stores ``X`` and puts a tensor hook on the output that
stores ``dY`` when backward reaches it. A layer run several times in one step (weight sharing,
micro-batches) records every call: ``Σ_calls dY_iᵀ·X_i`` is the gradient of the whole step, and
it equals the product of the calls concatenated along the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snack.nn import SparseLinear

__all__ = ["GradientCapture"]


class GradientCapture:
    """Armable recorder of ``(X (B, in), dY (B, out))`` for a list of layers."""

    def __init__(self, layers: list[SparseLinear]):
        self.layers = layers
        self._handles: list = []
        self._records: list[list[list[Tensor | None]]] = [[] for _ in layers]

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if not self.armed:
            self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def clear(self) -> None:
        self._records = [[] for _ in self.layers]

    def batch(self, index: int) -> tuple[Tensor, Tensor] | None:
        """``(X (N, in), dY (N, out))`` of every recorded call that reached backward, else ``None``."""
        done = [(x, dy) for x, dy in self._records[index] if dy is not None]
        if not done:
            return None
        return torch.cat([x for x, _ in done]), torch.cat([dy for _, dy in done])

    def _hook(self, index: int):
        layer = self.layers[index]

        def forward_hook(module, inputs, output):
            # eval passes (no_grad or frozen) never get a gradient: nothing to record
            if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
                return
            record = [inputs[0].detach().reshape(-1, layer.in_features), None]
            self._records[index].append(record)

            def grad_hook(grad: Tensor) -> None:
                record[1] = grad.detach().reshape(-1, layer.out_features)

            output.register_hook(grad_hook)

        return forward_hook
