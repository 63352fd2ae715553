"""Sparse layers: :class:`SparseLinear`, a truly sparse drop-in for ``nn.Linear``, and
:func:`sparsify` / :func:`densify`, which convert a model's linear layers to it and back.

``layer`` holds the layer, ``convert`` the model conversion, ``tracing`` what programs made by
``torch.fx``, ``torch.jit.trace`` and ``torch.export`` call for a layer, ``locking`` the lock that
keeps rewires atomic for forwards in other threads.
"""

from snack.nn.convert import densify, sparsify
from snack.nn.layer import SparseLinear

__all__ = ["SparseLinear", "densify", "sparsify"]
