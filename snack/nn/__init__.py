"""Sparse layers: :class:`SparseLinear`, a truly sparse drop-in for ``nn.Linear``,
:class:`SparseConv2d` for ``nn.Conv2d``, :class:`SparseConv1d` for ``nn.Conv1d``,
:class:`SparseConv3d` for ``nn.Conv3d``,
:class:`SparseConvTranspose2d`, :class:`SparseConvTranspose1d` and :class:`SparseConvTranspose3d`
for ``nn.ConvTranspose2d``, ``nn.ConvTranspose1d`` and ``nn.ConvTranspose3d``,
:class:`SparseMultiheadAttention` for ``nn.MultiheadAttention`` (its projections sparse),
:class:`SparseLSTM`, :class:`SparseGRU` and :class:`SparseRNN` for ``nn.LSTM``, ``nn.GRU`` and
``nn.RNN`` (their weight matrices sparse),
:class:`SparseEmbedding` for ``nn.Embedding`` (:class:`SparseTiedHead` for an output layer tied to
it), :class:`SparseEmbeddingBag` for ``nn.EmbeddingBag``, and
:func:`sparsify` / :func:`densify`, which convert a model's layers to them and back.

``layer`` holds the linear layer, ``attention`` the attention, ``recurrent`` the recurrent layers (``recurrent_cells`` their steps' elementwise cells), ``conv`` the convolution
(``conv_base`` what it shares with ``conv_transpose``, the transposed one; ``conv_rows`` its im2col
training node, ``conv1d`` and ``conv_transpose1d`` the 1-D ones built on them, ``conv3d`` and
``conv_transpose3d`` the 3-D ones, ``plane`` how those compute with the 2-D kernels), ``embedding``
the embedding, ``embedding_bag`` the bag layer (``bags`` its reductions), ``tied_head`` the output
layer that shares its table, ``convert`` the model conversion, ``tracing`` what programs made by
``torch.fx``, ``torch.jit.trace`` and ``torch.export`` call for a layer, ``locking`` the lock that
keeps rewires atomic for forwards in other threads.
"""

from snack.nn import tracing
from snack.nn.attention import SparseMultiheadAttention
from snack.nn.conv import SparseConv2d
from snack.nn.conv1d import SparseConv1d
from snack.nn.conv3d import SparseConv3d
from snack.nn.conv_transpose import SparseConvTranspose2d
from snack.nn.conv_transpose1d import SparseConvTranspose1d
from snack.nn.conv_transpose3d import SparseConvTranspose3d
from snack.nn.convert import densify, sparsify
from snack.nn.embedding import SparseEmbedding
from snack.nn.embedding_bag import SparseEmbeddingBag
from snack.nn.layer import SparseLinear
from snack.nn.recurrent import SparseGRU, SparseLSTM, SparseRNN
from snack.nn.tied_head import SparseTiedHead

__all__ = [
    "SparseConv1d", "SparseConv2d", "SparseConv3d", "SparseConvTranspose1d", "SparseConvTranspose2d",
    "SparseConvTranspose3d", "SparseEmbedding", "SparseEmbeddingBag", "SparseGRU", "SparseLSTM", "SparseLinear",
    "SparseMultiheadAttention", "SparseRNN", "SparseTiedHead", "densify", "sparsify",
]

# Pickles name the class by module: snack.nn.SparseLinear, as before nn.py became a package
# (loadable by either version, and by any later move within the package).
SparseLinear.__module__ = __name__
SparseConv2d.__module__ = __name__
SparseConv1d.__module__ = __name__
SparseConv3d.__module__ = __name__
SparseConvTranspose2d.__module__ = __name__
SparseConvTranspose1d.__module__ = __name__
SparseConvTranspose3d.__module__ = __name__
SparseMultiheadAttention.__module__ = __name__
SparseEmbedding.__module__ = __name__
SparseEmbeddingBag.__module__ = __name__
SparseTiedHead.__module__ = __name__
SparseLSTM.__module__ = __name__
SparseGRU.__module__ = __name__
SparseRNN.__module__ = __name__

# Where nn.py kept them: a pickled torch.fx GraphModule imports the functions its graph calls
# by their module and name (the old ones from here).
_fx_layer_forward = tracing.fx_layer_forward
_fx_sparse_linear = tracing.fx_sparse_linear
