"""``SparseMultiheadAttention``: ``nn.MultiheadAttention`` whose four projections are
:class:`SparseLinear` layers.

The attention itself (scores, softmax, the weighted sum of values) is dense math on activations
and stays PyTorch's (``F.scaled_dot_product_attention``); the weights, which are what sparse
training prunes and regrows, live in the projections: ``q_proj``, ``k_proj``, ``v_proj`` and
``out_proj``, each a sparse layer that DST algorithms, ``snack.AveragedModel`` and the
distributions see as any other.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snack.nn import tracing
from snack.nn.layer import SparseLinear
from snack.topology import check_sparsity

__all__ = ["SparseMultiheadAttention"]

# the projections, in the order nn.MultiheadAttention packs them (in_proj_weight = [q; k; v])
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


class SparseMultiheadAttention(nn.Module):
    """Multi-head attention as ``nn.MultiheadAttention`` computes it, with sparse projections.

    The constructor takes ``nn.MultiheadAttention``'s arguments, and ``forward`` its arguments
    and returns what it returns (``attn_output, attn_weights``; shapes below with ``L`` the target
    and ``S`` the source length, ``N`` the batch, ``E`` ``embed_dim``, ``H`` ``num_heads``):

    - ``query`` ``(L, N, E)`` (``(N, L, E)`` when ``batch_first``, ``(L, E)`` unbatched), ``key``
      ``(S, N, kdim)``, ``value`` ``(S, N, vdim)`` in the same layout;
    - ``key_padding_mask`` ``(N, S)`` (``(S,)`` unbatched) and ``attn_mask`` ``(L, S)`` or
      ``(N·H, L, S)``: boolean (``True`` = not attended) or floating (added to the scores);
      ``is_causal`` is the same hint that ``attn_mask`` is causal;
    - ``attn_output`` in ``query``'s layout; ``attn_weights`` ``(N, L, S)`` averaged over heads,
      ``(N, H, L, S)`` with ``average_attn_weights=False``, or ``None`` with
      ``need_weights=False`` (then the product runs in ``F.scaled_dot_product_attention``).

    Unlike ``nn.MultiheadAttention``, which packs its three input projections into one dense
    ``in_proj_weight`` ``(3E, E)``, it holds four :class:`SparseLinear` layers: ``q_proj``
    ``(E, E)``, ``k_proj`` ``(E, kdim)``, ``v_proj`` ``(E, vdim)`` and ``out_proj`` ``(E, E)``,
    each with ``sparsity``, and optional ``bias_k``/``bias_v`` ``(1, 1, E)``. Values are drawn so
    that each projection's output variance is what ``nn.MultiheadAttention``'s dense init gives
    (Xavier-uniform, over the sparse fan-in); biases start at zero, as there.

    ``in_proj_weight`` and ``in_proj_bias`` are ``None`` and ``_qkv_same_embed_dim`` is
    ``False``, as for a dense module of separate projections: PyTorch's transformer layers then
    call :meth:`forward` instead of their fused fast path, which reads dense weights.

    Use :meth:`from_dense` (or :func:`snack.sparsify`) to convert an ``nn.MultiheadAttention``,
    and :func:`snack.densify` to convert back.
    """

    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        *,
        sparsity: float = 0.9,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        sparsity = check_sparsity(sparsity)
        self._configure(embed_dim, num_heads, dropout, add_zero_attn, kdim, vdim, batch_first)
        self._draw_parameters(bias, dict.fromkeys(PROJECTIONS, sparsity), add_bias_kv, device, dtype)

    def _configure(self, embed_dim, num_heads, dropout, add_zero_attn, kdim, vdim, batch_first) -> None:
        """Check and keep the attention's sizes and options (everything but the parameters)."""
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"SparseMultiheadAttention: {name} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(
                f"SparseMultiheadAttention: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"SparseMultiheadAttention: dropout must be a probability in [0, 1], got {dropout!r}")
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.add_zero_attn = bool(add_zero_attn)
        self.batch_first = bool(batch_first)

    def _draw_parameters(self, bias: bool, sparsities: Mapping[str, float], add_bias_kv: bool, device, dtype) -> None:
        """Make the projections, random topologies of ``sparsities`` (by projection name), and
        ``bias_k``/``bias_v`` if asked, then draw their values (:meth:`reset_parameters`)."""
        for name, (out_features, in_features) in self.projection_shapes().items():
            setattr(self, name, SparseLinear(in_features, out_features, bias, sparsity=sparsities[name], device=device,
                                             dtype=dtype))  # fmt: skip
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, self.embed_dim, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty(1, 1, self.embed_dim, device=device, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None
        self.reset_parameters()

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (out_features, in_features)}`` of the four projections."""
        e = self.embed_dim
        return {"q_proj": (e, e), "k_proj": (e, self.kdim), "v_proj": (e, self.vdim), "out_proj": (e, e)}

    @staticmethod
    def dense_weights(attention: nn.MultiheadAttention) -> dict[str, tuple[Tensor, Tensor | None]]:
        """``{projection name: (weight, bias or None)}`` of a dense attention (what ``sparsify``
        converts and weighs for its distributions: :func:`dense_projections`)."""
        return dense_projections(attention)

    def projections(self) -> dict[str, SparseLinear]:
        """``{name: layer}`` of the four projections."""
        return {name: getattr(self, name) for name in PROJECTIONS}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(
        cls, attention: nn.MultiheadAttention, *, sparsity: float | Mapping[str, float | None] | None = None
    ) -> SparseMultiheadAttention:
        """A sparse attention computing what ``attention`` computes, from its projections' weights.

        Args:
            attention: an ``nn.MultiheadAttention`` (packed or separate projections).
            sparsity: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps each projection's
                largest-magnitude weights; a mapping gives one per projection name (``q_proj``,
                ``k_proj``, ``v_proj``, ``out_proj``; each ``None`` or a float).

        Parameters are copies; training mode and frozen parameters are kept.
        """
        if not isinstance(attention, nn.MultiheadAttention):
            raise TypeError(f"attention must be an nn.MultiheadAttention, got {type(attention).__name__}")
        sparsities = _per_projection(sparsity)
        new = cls._configured_like(attention)
        for name, (weight, bias) in dense_projections(attention).items():
            layer = SparseLinear.from_dense(weight.detach(), sparsity=sparsities[name], bias=bias)
            layer.values.requires_grad_(weight.requires_grad)
            if layer.bias is not None:
                layer.bias.requires_grad_(bias.requires_grad)
            setattr(new, name, layer)
        for name in ("bias_k", "bias_v"):
            dense = getattr(attention, name)
            copy = None if dense is None else nn.Parameter(dense.detach().clone(), requires_grad=dense.requires_grad)
            setattr(new, name, copy)
        return new.train(attention.training)

    @classmethod
    def _configured_like(cls, attention: nn.MultiheadAttention) -> SparseMultiheadAttention:
        """A module of ``attention``'s sizes and options, without parameters yet."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._configure(attention.embed_dim, attention.num_heads, attention.dropout, attention.add_zero_attn,
                       attention.kdim, attention.vdim, attention.batch_first)  # fmt: skip
        return new

    @classmethod
    def _random_like(
        cls, attention: nn.MultiheadAttention, sparsities: Mapping[str, float]
    ) -> SparseMultiheadAttention:
        """A freshly initialised sparse attention of ``attention``'s configuration, device and dtype,
        with random topologies of the given per-projection sparsities (``sparsify(init="random")``)."""
        reference = attention.out_proj.weight
        new = cls._configured_like(attention)
        new._draw_parameters(attention.out_proj.bias is not None, sparsities, attention.bias_k is not None,
                             reference.device, reference.dtype)  # fmt: skip
        return new.train(attention.training)

    def reset_parameters(self) -> None:
        """Re-draw every parameter (a layer built on the meta device and materialised since first
        draws its topologies, as :meth:`SparseLinear.reset_parameters` does).

        ``nn.MultiheadAttention`` draws its input projections Xavier-uniform: the packed
        ``(3E, E)`` weight gives ``Var(q) = Var(x) / 2``, separate ``(E, d)`` ones ``2d / (E + d)``
        times it. Here each input projection draws ``U(-b, b)`` with ``b = √(3·gain / fan_in)``, its
        ``fan_in = nnz / E`` connections per output giving that same gain; ``out_proj`` keeps
        :class:`SparseLinear`'s rule (``nn.Linear``'s variance). Biases are zero and ``bias_k``/
        ``bias_v`` Xavier-normal, as there."""
        packed = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        for name, layer in self.projections().items():
            layer.reset_parameters()
            with torch.no_grad():
                if name != "out_proj":
                    gain = 0.5 if packed else 2 * layer.in_features / (self.embed_dim + layer.in_features)
                    bound = math.sqrt(3 * gain / max(1.0, layer.nnz / layer.out_features))
                    layer.values.uniform_(-bound, bound)
                if layer.bias is not None:
                    layer.bias.zero_()
        for parameter in (self.bias_k, self.bias_v):
            if parameter is not None:
                nn.init.xavier_normal_(parameter)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``(attn_output, attn_weights)``; arguments and shapes as for ``nn.MultiheadAttention``
        (class docstring)."""
        if tracing.fx_symbolic_tracing():
            return tracing.fx_module_call(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                                          average_attn_weights, is_causal)  # fmt: skip
        if torch._C._get_tracing_state() is None:
            batched = self._check_call(query, key, value, key_padding_mask, attn_mask, is_causal)
        else:  # torch.jit.trace records sizes as tensors, and warns that these checks (which only raise) are not
            with warnings.catch_warnings():  # in the trace; they need not be
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                batched = self._check_call(query, key, value, key_padding_mask, attn_mask, is_causal)
        if not batched:  # one sample: a batch of one, in whichever layout
            batch_dim = 0 if self.batch_first else 1
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        n = query.shape[0] if self.batch_first else query.shape[1]
        causal_flag = is_causal and key_padding_mask is None and not need_weights

        # (N, H, length, head_dim) per projection; projections run in the input's own layout
        q, k, v = (self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value)))
        extra_keys = []  # key/value columns appended after the source's: bias_k/bias_v, then a zero one
        if self.bias_k is not None:
            heads = (1, self.num_heads, 1, self.head_dim)
            extra_keys.append((self.bias_k.view(heads).expand(n, -1, -1, -1),
                               self.bias_v.view(heads).expand(n, -1, -1, -1)))  # fmt: skip
        if self.add_zero_attn:
            zeros = q.new_zeros(n, self.num_heads, 1, self.head_dim)
            extra_keys.append((zeros, zeros))
        if extra_keys:
            k = torch.cat([k, *(pair[0] for pair in extra_keys)], dim=2)
            v = torch.cat([v, *(pair[1] for pair in extra_keys)], dim=2)
        mask = self._merged_mask(attn_mask, key_padding_mask, n, len(extra_keys), q.dtype)

        dropout = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if dropout > 0:
                weights = F.dropout(weights, p=dropout)
            attended = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, None if causal_flag else mask, dropout, causal_flag)
            weights = None
        output = self.out_proj(self._merge_heads(attended))
        if not batched:
            output = output.squeeze(0 if self.batch_first else 1)
            weights = None if weights is None else weights.squeeze(0)
        return output, weights

    def _check_call(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> bool:
        """Raise where a call's arguments do not fit; whether its inputs are batched."""
        batched = self._check_inputs(query, key, value)
        n = (query.shape[0] if self.batch_first else query.shape[1]) if batched else 1
        lq, s = query.shape[int(batched and self.batch_first)], key.shape[int(batched and self.batch_first)]
        _check_mask(key_padding_mask, "key_padding_mask", [(n, s) if batched else (s,)])
        _check_mask(attn_mask, "attn_mask", [(lq, s), (n * self.num_heads, lq, s)])
        if is_causal and attn_mask is None:
            raise ValueError(
                "SparseMultiheadAttention: is_causal=True is a hint that attn_mask is causal, and needs that attn_mask "
                "(nn.Transformer.generate_square_subsequent_mask makes one)"
            )
        return batched

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> bool:
        """Raise where the inputs do not fit; whether they are batched."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, Tensor):
                raise TypeError(f"SparseMultiheadAttention: {name} must be a Tensor, got {type(tensor).__name__}")
            if tensor.is_nested:  # as nn.MultiheadAttention outside its fused fast path
                raise ValueError(
                    f"SparseMultiheadAttention: {name} is a nested tensor, which it does not take; pad the sequences "
                    "(nested.to_padded_tensor) and pass key_padding_mask"
                )
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "SparseMultiheadAttention: query, key and value must all be 3-D (batched) or all 2-D (one "
                f"sample), got shapes {tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
            )
        for name, tensor, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                    ("value", value, self.vdim)):  # fmt: skip
            if tensor.shape[-1] != width:
                raise ValueError(
                    f"SparseMultiheadAttention: {name} must have {width} features in its last dimension, got shape "
                    f"{tuple(tensor.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                "SparseMultiheadAttention: key and value must have the same sequence length and batch, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        batch_dim = 0 if self.batch_first else 1
        if query.dim() == 3 and query.shape[batch_dim] != key.shape[batch_dim]:
            raise ValueError(
                f"SparseMultiheadAttention (batch_first={self.batch_first}): query and key must have the same batch, "
                f"got shapes {tuple(query.shape)} and {tuple(key.shape)}"
            )
        return query.dim() == 3

    def _heads(self, x: Tensor) -> Tensor:
        """A projection's output, ``(N, length, E)`` (``(length, N, E)`` unless ``batch_first``),
        as ``(N, H, length, head_dim)``."""
        if not self.batch_first:
            x = x.transpose(0, 1)
        n, length, _ = x.shape
        return x.reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge_heads(self, x: Tensor) -> Tensor:
        """``(N, H, L, head_dim)`` → ``(N, L, E)`` (``(L, N, E)`` unless ``batch_first``)."""
        n, _, length, _ = x.shape
        if self.batch_first:
            return x.transpose(1, 2).reshape(n, length, self.embed_dim)
        return x.permute(2, 0, 1, 3).reshape(length, n, self.embed_dim)

    def _merged_mask(self, attn_mask, key_padding_mask, n: int, extra: int, dtype: torch.dtype) -> Tensor | None:
        """One additive mask of ``dtype`` (the projections', which autocast may lower) broadcasting
        to the scores ``(N, H, L, S + extra)``, or ``None``: the ``extra`` appended key columns
        (``bias_k``, the zero key) are never masked."""
        attn_mask, key_padding_mask = (_additive(mask, dtype) for mask in (attn_mask, key_padding_mask))
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (N·H, L, S), heads of one sample adjacent, as in torch
                attn_mask = attn_mask.view(n, self.num_heads, *attn_mask.shape[1:])
            attn_mask = F.pad(attn_mask, (0, extra))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, extra)).view(n, 1, 1, -1)
            return key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        return attn_mask

    def extra_repr(self) -> str:
        dims = "" if self.kdim == self.vdim == self.embed_dim else f", kdim={self.kdim}, vdim={self.vdim}"
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{dims}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}, add_zero_attn={self.add_zero_attn}"
        )

    def to_dense_module(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` computing the same (its weights dense: what
        :func:`snack.densify` puts in this module's place)."""
        values = self.q_proj.values
        dense = nn.utils.skip_init(  # uninitialised, then written: no init overwritten at once
            nn.MultiheadAttention, self.embed_dim, self.num_heads, dropout=self.dropout,
            bias=self.q_proj.bias is not None, add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn,
            kdim=self.kdim, vdim=self.vdim, batch_first=self.batch_first, device=values.device, dtype=values.dtype,
        )  # fmt: skip
        with torch.no_grad():
            for name, (weight, bias) in dense_projections(dense).items():
                layer = getattr(self, name)
                layer._write_dense_into(weight)
                if bias is not None:
                    bias.copy_(layer.bias)
            for name in ("bias_k", "bias_v"):
                if getattr(self, name) is not None:
                    getattr(dense, name).copy_(getattr(self, name))
        _keep_flags(dense, self)
        return dense.train(self.training)


def dense_projections(attention: nn.MultiheadAttention) -> dict[str, tuple[Tensor, Tensor | None]]:
    """``{projection name: (weight (E, d), bias (E,) or None)}`` of an ``nn.MultiheadAttention``:
    views of its packed ``in_proj_weight``/``in_proj_bias`` where it packs them."""
    if attention._qkv_same_embed_dim:
        weights = attention.in_proj_weight.chunk(3)
    else:
        weights = (attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight)
    biases = (None,) * 3 if attention.in_proj_bias is None else attention.in_proj_bias.chunk(3)
    pairs = dict(zip(PROJECTIONS[:3], zip(weights, biases)))
    pairs["out_proj"] = (attention.out_proj.weight, attention.out_proj.bias)
    return pairs


def _keep_flags(dense: nn.MultiheadAttention, sparse: SparseMultiheadAttention) -> None:
    """Freeze ``dense``'s parameters where ``sparse``'s are frozen (a packed in-projection is
    trainable where any of the three sparse ones is)."""
    layers, inputs = sparse.projections(), PROJECTIONS[:3]
    if dense._qkv_same_embed_dim:
        dense.in_proj_weight.requires_grad_(any(layers[name].values.requires_grad for name in inputs))
    else:
        for name in inputs:
            getattr(dense, f"{name}_weight").requires_grad_(layers[name].values.requires_grad)
    if dense.in_proj_bias is not None:
        dense.in_proj_bias.requires_grad_(any(layers[name].bias.requires_grad for name in inputs))
    dense.out_proj.weight.requires_grad_(layers["out_proj"].values.requires_grad)
    if dense.out_proj.bias is not None:
        dense.out_proj.bias.requires_grad_(layers["out_proj"].bias.requires_grad)
    for name in ("bias_k", "bias_v"):
        if getattr(sparse, name) is not None:
            getattr(dense, name).requires_grad_(getattr(sparse, name).requires_grad)


def _per_projection(sparsity) -> dict[str, float | None]:
    """``{projection name: sparsity or None}`` from one value or a mapping naming all four."""
    if isinstance(sparsity, Mapping):
        if set(sparsity) != set(PROJECTIONS):
            raise ValueError(f"sparsity: a mapping must name exactly {PROJECTIONS}, got keys {sorted(sparsity)}")
        return {name: None if s is None else check_sparsity(s) for name, s in sparsity.items()}
    return dict.fromkeys(PROJECTIONS, None if sparsity is None else check_sparsity(sparsity))


def _check_mask(mask: Tensor | None, name: str, shapes: list[tuple[int, ...]]) -> None:
    """Raise unless ``mask`` is ``None`` or a boolean or floating tensor of one of ``shapes``."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"SparseMultiheadAttention: {name} must be a Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) not in shapes:
        expected = " or ".join(str(shape) for shape in shapes)
        raise ValueError(f"SparseMultiheadAttention: {name} must have shape {expected}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"SparseMultiheadAttention: {name} must be boolean or floating, got {mask.dtype}")


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A checked mask as one added to the scores, of ``dtype`` (a boolean one: ``-inf`` where
    ``True``)."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
