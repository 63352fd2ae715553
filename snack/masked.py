"""Dense+Mask: the baseline snack replaces, built from a sparse model for ``snack train --compare``.

A dense weight multiplied by a fixed 0/1 mask in every forward (dense storage, dense FLOPs, a
dense gradient the mask zeroes), with the sparse model's weights and topology, so that both
compute the same function and train the same connections.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

import snack

__all__ = ["MaskedConv2d", "MaskedLinear", "dense_plus_mask", "masked_attention", "masked_recurrent"]


class MaskedLinear(nn.Module):
    """The baseline snack replaces: a dense ``(out, in)`` weight times a fixed 0/1 mask in
    every forward. Dense storage, dense FLOPs, dense gradient; only the mask makes it sparse."""

    def __init__(self, weight: Tensor, mask: Tensor, bias: Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.register_buffer("mask", mask.to(weight.dtype))
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


class MaskedConv2d(nn.Conv2d):
    """:class:`MaskedLinear` for convolutions: an ``nn.Conv2d`` whose dense
    ``(out, in, kh, kw)`` weight is multiplied by a fixed 0/1 mask in every forward. Built from a
    :class:`snack.SparseConv2d`, with its geometry, weights (as the masked weight) and topology
    (as the mask)."""

    def __init__(self, sparse: snack.SparseConv2d):
        values = sparse.values
        super().__init__(
            sparse.in_channels, sparse.out_channels, sparse.kernel_size, sparse.stride, sparse.padding,
            sparse.dilation, sparse.groups, bias=sparse.bias is not None, padding_mode=sparse.padding_mode,
            device=values.device, dtype=values.dtype,
        )
        with torch.no_grad():
            self.weight.copy_(sparse.to_dense())
            if sparse.bias is not None:
                self.bias.copy_(sparse.bias)
        self.register_buffer("mask", _mask(sparse).view_as(self.weight).to(values.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.weight * self.mask, self.bias)


class _TimesMask(nn.Module):
    """A parametrization: the weight times a fixed 0/1 mask at every access (Dense+Mask for
    ``nn.MultiheadAttention`` and the recurrent layers, which read their weights themselves)."""

    def __init__(self, mask: Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: Tensor) -> Tensor:
        return weight * self.mask


def masked_attention(sparse: snack.SparseMultiheadAttention) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` with ``sparse``'s weights, each multiplied by its
    projection's fixed 0/1 mask in every forward (``torch.nn.utils.parametrize``)."""
    dense = sparse.to_dense_module()
    masks = {name: _mask(layer).to(layer.values.dtype) for name, layer in sparse.projections().items()}
    inputs = ("q_proj", "k_proj", "v_proj")
    weights = {"in_proj_weight": torch.cat([masks[n] for n in inputs])} if dense._qkv_same_embed_dim else {
        f"{n}_weight": masks[n] for n in inputs}  # fmt: skip
    for name, mask in weights.items():
        nn.utils.parametrize.register_parametrization(dense, name, _TimesMask(mask))
    nn.utils.parametrize.register_parametrization(dense.out_proj, "weight", _TimesMask(masks["out_proj"]))
    return dense


def masked_recurrent(sparse: snack.SparseLSTM | snack.SparseGRU | snack.SparseRNN) -> nn.RNNBase:
    """The ``nn.LSTM`` (``nn.GRU``, ``nn.RNN``) ``sparse`` replaces, with its weights, each weight
    matrix multiplied by its layer's fixed 0/1 mask in every forward (``torch.nn.utils.parametrize``).
    It keeps torch's fused recurrent kernel: ``nn.RNNBase`` re-reads its weights when they are new
    tensors, as each masked access makes."""
    dense = sparse.to_dense_module()
    for name, layer in sparse.sparse_layers().items():
        mask = _TimesMask(_mask(layer).to(layer.values.dtype))
        nn.utils.parametrize.register_parametrization(dense, f"weight_{name}", mask)
    return dense


def dense_plus_mask(sparse_model: nn.Module) -> nn.Module:
    """A copy of ``sparse_model`` whose SparseLinear (SparseConv2d, SparseMultiheadAttention,
    SparseLSTM/GRU/RNN) modules are MaskedLinear (MaskedConv2d, :func:`masked_attention`,
    :func:`masked_recurrent`) with the same topology (as the mask) and weights (builds dense
    matrices: it is the baseline)."""
    if any(isinstance(m, (snack.SparseConvTranspose2d, snack.SparseConvTranspose3d)) for m in sparse_model.modules()):
        raise TypeError("dense_plus_mask: transposed convolutions have no masked twin (snack train's models hold none)")
    masked = copy.deepcopy(sparse_model)
    replaced: list[str] = []  # modules inside these (an attention's projections, an LSTM's) went with them
    for name, module in list(masked.named_modules()):
        if any(name.startswith(f"{r}.") for r in replaced):
            continue
        if isinstance(module, snack.SparseMultiheadAttention):
            twin = masked_attention(module)
        elif isinstance(module, (snack.SparseLSTM, snack.SparseGRU, snack.SparseRNN)):
            twin = masked_recurrent(module)
        elif isinstance(module, snack.SparseConv2d):
            twin = MaskedConv2d(module)
        elif isinstance(module, snack.SparseLinear):
            twin = MaskedLinear(module.to_dense(), _mask(module), module.bias)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(masked.get_submodule(parent), child, twin)
        replaced.append(name)
    return masked


def _mask(layer: snack.SparseLinear) -> Tensor:
    """``(out_features, in_features)`` bool: where ``layer`` has a connection."""
    mask = torch.zeros(layer.out_features, layer.in_features, dtype=torch.bool, device=layer.values.device)
    mask[layer.row.long(), layer.col.long()] = True
    return mask
