"""snack: truly sparse neural networks for PyTorch.

Layers store and compute only their non-zero connections, train with sparse backpropagation,
and can rewire during training, without ever building a dense weight, mask or gradient
(RigL's growth scores are formed in blocks of at most 2**20 entries: only a layer that small
has its whole gradient formed at once).
"""

from snack import dst, ops
from snack.averaging import AveragedModel, align_topology
from snack.backends import available_backends, use_backend
from snack.nn import (
    SparseConv1d, SparseConv2d, SparseConv3d, SparseConvTranspose1d, SparseConvTranspose2d, SparseConvTranspose3d,
    SparseEmbedding, SparseEmbeddingBag, SparseGRU, SparseLinear, SparseLSTM, SparseMultiheadAttention, SparseRNN,
    SparseTiedHead, densify, sparsify,
)
from snack.topology import Topology

__version__ = "0.1.0"


def onnx_translations() -> dict:
    """The ``custom_translation_table`` that lets ``torch.onnx.export(model, args, dynamo=True,
    custom_translation_table=snack.onnx_translations())`` write sparse layers with standard ONNX
    operators (their connections only, never a dense weight): see :mod:`snack.onnx_export`.
    Needs ``onnxscript`` (the extra ``snack[onnx]``), imported here, not by ``import snack``."""
    from snack.onnx_export import translations

    return translations()


__all__ = [
    "AveragedModel",
    "SparseConv1d",
    "SparseConv2d",
    "SparseConv3d",
    "SparseConvTranspose1d",
    "SparseConvTranspose2d",
    "SparseConvTranspose3d",
    "SparseEmbedding",
    "SparseEmbeddingBag",
    "SparseGRU",
    "SparseLSTM",
    "SparseLinear",
    "SparseMultiheadAttention",
    "SparseRNN",
    "SparseTiedHead",
    "Topology",
    "align_topology",
    "available_backends",
    "densify",
    "dst",
    "onnx_translations",
    "ops",
    "sparsify",
    "use_backend",
]
