"""``SparseLSTM``, ``SparseGRU`` and ``SparseRNN``: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` whose
weights are :class:`SparseLinear` layers.

Sparse recurrent networks are a classic dynamic-sparse-training workload (Selfish-RNN: sparse
LSTMs on Penn Treebank and WikiText-2). Each layer and direction holds an input-to-hidden layer
``ih`` ``(G·H, in)`` and a hidden-to-hidden layer ``hh`` ``(G·H, H)`` (``G`` gates: 4 for an LSTM,
3 for a GRU, 1 for a plain RNN), and an LSTM with ``proj_size`` a projection ``hr`` ``(P, H)``: the
matrices ``nn.LSTM`` calls ``weight_ih_l{k}``, ``weight_hh_l{k}`` and ``weight_hr_l{k}``. DST
algorithms, ``snack.AveragedModel`` and the distributions see each as any other sparse layer.

How it computes: the input product of a layer runs once over the whole sequence (one sparse
product of ``T·N`` rows); the recurrence then runs one step at a time, the hidden product through
``hh``'s forward (so a RigL update step records every step's ``h`` and gradient: their sum is the
weight's gradient), the gates elementwise (:mod:`snack.nn.recurrent_cells`: one native kernel on
the CPU). Autograd's backward runs each step's sparse backward. A packed sequence
(``nn.utils.rnn.PackedSequence``) runs each step on the sequences still going, as ``nn.LSTM``
does: nothing is computed for the padding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from snack.nn import tracing
from snack.nn.layer import SparseLinear
from snack.nn.recurrent_cells import gru_cell, lstm_cell
from snack.topology import check_sparsity

__all__ = ["SparseGRU", "SparseLSTM", "SparseRNN"]

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


class _SparseRNNBase(nn.Module):
    """What the three recurrent layers share: sizes, the sparse weights, the sequence loop.

    Subclasses set ``mode`` (a key of :data:`GATES`) and ``_dense_class``, and compute one step
    in :meth:`_cell`.
    """

    mode: str
    _dense_class: type[nn.RNNBase]

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True, batch_first: bool = False,
        dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0, *, sparsity: float = 0.9,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ):  # fmt: skip
        super().__init__()
        sparsity = check_sparsity(sparsity)
        self._configure(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size)
        self._draw_parameters(dict.fromkeys(self.weight_shapes(), sparsity), device, dtype)

    def _configure(self, input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                   proj_size) -> None:  # fmt: skip
        """Check and keep the sizes and options (everything but the parameters)."""
        name = type(self).__name__
        for option, value, least in (("input_size", input_size, 1), ("hidden_size", hidden_size, 1),
                                     ("num_layers", num_layers, 1), ("proj_size", proj_size, 0)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive int" if least else "a non-negative int"
                raise ValueError(f"{name}: {option} must be {kind}, got {value!r}")
        if proj_size >= hidden_size:
            raise ValueError(f"{name}: proj_size must be smaller than hidden_size ({hidden_size}), got {proj_size}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"{name}: dropout must be a probability in [0, 1], got {dropout!r}")
        if dropout > 0 and num_layers == 1:  # as nn.RNNBase warns
            warnings.warn(
                f"{name}: dropout is applied between recurrent layers, after all but the last, so dropout={dropout} "
                "with num_layers=1 does nothing",
                stacklevel=3,
            )
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bool(bias), bool(batch_first), bool(bidirectional)
        self.dropout, self.proj_size = float(dropout), proj_size

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _output_size(self) -> int:
        """The width of ``h``: ``proj_size`` when an LSTM projects it, else ``hidden_size``."""
        return self.proj_size or self.hidden_size

    def _suffixes(self) -> list[str]:
        """``["l0", "l0_reverse", "l1", ...]``: one per layer and direction, ``nn.LSTM``'s order."""
        return [f"l{k}{'_reverse' if d else ''}" for k in range(self.num_layers) for d in range(self._directions)]

    def weight_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (out_features, in_features)}`` of the sparse layers: ``ih_l0``, ``hh_l0``, (an
        LSTM with ``proj_size``: ``hr_l0``), ``ih_l0_reverse``, ... in ``nn.LSTM``'s order, each
        the matrix ``nn.LSTM`` names ``weight_{name}``."""
        gates = GATES[self.mode] * self.hidden_size
        shapes = {}
        for suffix in self._suffixes():
            first = suffix.startswith("l0")
            shapes[f"ih_{suffix}"] = (gates, self.input_size if first else self._output_size * self._directions)
            shapes[f"hh_{suffix}"] = (gates, self._output_size)
            if self.proj_size:
                shapes[f"hr_{suffix}"] = (self.proj_size, self.hidden_size)
        return shapes

    def sparse_layers(self) -> dict[str, SparseLinear]:
        """``{name: layer}`` of the sparse layers, in :meth:`weight_shapes`' order."""
        return {name: getattr(self, name) for name in self.weight_shapes()}

    def _draw_parameters(self, sparsities: Mapping[str, float], device, dtype) -> None:
        """Make the sparse layers, random topologies of ``sparsities`` (by layer name), and draw
        their values (:meth:`reset_parameters`)."""
        for name, (out_features, in_features) in self.weight_shapes().items():
            bias = self.bias and not name.startswith("hr_")  # (nn.LSTM's projection has no bias)
            setattr(self, name, SparseLinear(in_features, out_features, bias, sparsity=sparsities[name],
                                             device=device, dtype=dtype))  # fmt: skip
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every parameter (a layer built on the meta device and materialised since first
        draws its topologies, as :meth:`SparseLinear.reset_parameters` does).

        ``nn.LSTM`` draws every weight and bias from ``U(-1/√H, 1/√H)`` (``H`` = ``hidden_size``),
        so a gate's input product has variance ``in · Var(x) / (3H)``. A sparse layer's row has on
        average ``fan_in = nnz / out`` inputs; drawing ``U(-b, b)`` with ``b = √(in / (H · fan_in))``
        keeps that variance at any sparsity (``b = 1/√H`` when dense). Biases as ``nn.LSTM``'s."""
        bound = 1 / math.sqrt(self.hidden_size)
        for layer in self.sparse_layers().values():
            layer.reset_parameters()
            fan_in = max(1.0, layer.nnz / layer.out_features)
            with torch.no_grad():
                scale = math.sqrt(layer.in_features / (self.hidden_size * fan_in))
                layer.values.uniform_(-scale, scale)
                if layer.bias is not None:
                    layer.bias.uniform_(-bound, bound)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def dense_weights(cls, dense: nn.RNNBase) -> dict[str, tuple[Tensor, Tensor | None]]:
        """``{sparse layer name: (weight, bias or None)}`` of a dense ``nn.LSTM``/``nn.GRU``/
        ``nn.RNN``: its ``weight_{name}`` and ``bias_{name}``."""
        return {name: (getattr(dense, f"weight_{name}"), getattr(dense, f"bias_{name}", None))
                for name in cls._configured_like(dense).weight_shapes()}  # fmt: skip

    @classmethod
    def from_dense(
        cls, rnn: nn.RNNBase, *, sparsity: float | Mapping[str, float | None] | None = None
    ) -> _SparseRNNBase:
        """A sparse layer computing what ``rnn`` computes, from its weights.

        Args:
            rnn: an ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` (the one this class replaces).
            sparsity: ``None`` keeps every non-zero; a float in ``[0, 1)`` keeps each matrix's
                largest-magnitude weights; a mapping gives one per sparse layer name
                (:meth:`weight_shapes`; each ``None`` or a float).

        Parameters are copies; training mode and frozen parameters are kept.
        """
        if type(rnn) is not cls._dense_class:
            raise TypeError(f"rnn must be an {cls._dense_class.__name__}, got {type(rnn).__name__}")
        new = cls._configured_like(rnn)
        sparsities = _per_layer(sparsity, list(new.weight_shapes()))
        for name, (weight, bias) in cls.dense_weights(rnn).items():
            layer = SparseLinear.from_dense(weight.detach(), sparsity=sparsities[name], bias=bias)
            layer.values.requires_grad_(weight.requires_grad)
            if layer.bias is not None:
                layer.bias.requires_grad_(bias.requires_grad)
            setattr(new, name, layer)
        return new.train(rnn.training)

    @classmethod
    def _configured_like(cls, rnn: nn.RNNBase) -> _SparseRNNBase:
        """A module of ``rnn``'s sizes and options, without parameters yet."""
        if type(rnn) is not cls._dense_class:
            raise TypeError(f"rnn must be an {cls._dense_class.__name__}, got {type(rnn).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        if rnn.mode.startswith("RNN"):
            new.mode = rnn.mode  # (SparseRNN's nonlinearity)
        with warnings.catch_warnings():  # (rnn warned of a dropout of one layer when it was built)
            warnings.simplefilter("ignore", UserWarning)
            new._configure(rnn.input_size, rnn.hidden_size, rnn.num_layers, rnn.bias, rnn.batch_first, rnn.dropout,
                           rnn.bidirectional, rnn.proj_size)  # fmt: skip
        return new

    @classmethod
    def _random_like(cls, rnn: nn.RNNBase, sparsities: Mapping[str, float]) -> _SparseRNNBase:
        """A freshly initialised sparse layer of ``rnn``'s configuration, device and dtype, with
        random topologies of the given per-layer sparsities (``sparsify(init="random")``)."""
        reference = rnn.weight_ih_l0
        new = cls._configured_like(rnn)
        new._draw_parameters(sparsities, reference.device, reference.dtype)
        return new.train(rnn.training)

    def to_dense_module(self) -> nn.RNNBase:
        """The ``nn.LSTM``/``nn.GRU``/``nn.RNN`` computing the same (its weights dense: what
        :func:`snack.densify` puts in this module's place)."""
        values = self.ih_l0.values
        options = dict(num_layers=self.num_layers, bias=self.bias, batch_first=self.batch_first,
                       dropout=self.dropout, bidirectional=self.bidirectional, dtype=values.dtype)  # fmt: skip
        if self.proj_size:
            options["proj_size"] = self.proj_size
        if self.mode.startswith("RNN"):
            options["nonlinearity"] = self.mode[4:].lower()
        # built on the meta device, then given memory and written: no init drawn and overwritten at once
        # (nn.utils.skip_init cannot: nn.RNNBase's subclasses take *args)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore", UserWarning)  # (a one-layer dropout: warned when this was built)
            dense = self._dense_class(self.input_size, self.hidden_size, **options)
        dense = dense.to_empty(device=values.device)
        with torch.no_grad():
            for name, (weight, bias) in self.dense_weights(dense).items():
                layer = getattr(self, name)
                layer._write_dense_into(weight)
                weight.requires_grad_(layer.values.requires_grad)
                if bias is not None:
                    bias.copy_(layer.bias)
                    bias.requires_grad_(layer.bias.requires_grad)
        return dense.train(self.training)

    # ------------------------------------------------------------------ forward

    def forward(self, input: Tensor | PackedSequence, hx=None):
        """``(output, h_n)`` (an LSTM: ``(output, (h_n, c_n))``), as ``nn.LSTM`` computes them.

        Shapes (``T`` steps, ``N`` sequences, ``D`` directions, ``L`` layers, ``H_out`` =
        ``proj_size`` or ``hidden_size``): ``input`` ``(T, N, input_size)`` (``(N, T, ...)`` when
        ``batch_first``, ``(T, input_size)`` for one sequence) or a ``PackedSequence``; ``hx``
        ``(D·L, N, H_out)`` (an LSTM: a tuple of that and ``c_0`` ``(D·L, N, hidden_size)``;
        ``(D·L, ...)`` without ``N`` for one sequence), zeros if ``None``; ``output`` ``(T, N,
        D·H_out)`` in the input's layout, or a ``PackedSequence``; ``h_n`` as ``hx``.

        Inside ``torch.autocast`` the sparse products run in the region's dtype, as
        :class:`SparseLinear`'s do; the state (``h``, ``c``) is carried in the input's dtype (a
        float32 input gives float32 outputs, as ``nn.GRU`` does there).
        """
        if tracing.fx_symbolic_tracing():
            return tracing.fx_module_call(self, input, hx)
        packed = isinstance(input, PackedSequence)
        if torch._C._get_tracing_state() is None:
            data, steps, hx, batched = self._sequence_layout(input, hx)
        else:  # torch.jit.trace records sizes as tensors, and warns that these checks (which only raise) are not
            with warnings.catch_warnings():  # in the trace; they need not be
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                data, steps, hx, batched = self._sequence_layout(input, hx)
        n = steps[0]
        h_n, c_n = [], []
        for k in range(self.num_layers):
            outputs = []
            for d in range(self._directions):
                index = k * self._directions + d
                state = self._initial_state(hx, index, n, data)
                output, state = self._run(data, steps, state, f"l{k}{'_reverse' if d else ''}", d == 1, packed)
                outputs.append(output)
                h_n.append(state[0])
                c_n.append(state[1])
            data = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
            if self.dropout and self.training and k < self.num_layers - 1:
                data = F.dropout(data, self.dropout)
        h = torch.stack(h_n)
        state = (h, torch.stack(c_n)) if self.mode == "LSTM" else h
        if packed:
            state = self._permuted(state, input.unsorted_indices)
            return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), state
        output = data.view(len(steps), n, data.shape[-1])
        if not batched:
            output = output.squeeze(1)
            state = tuple(s.squeeze(1) for s in state) if self.mode == "LSTM" else state.squeeze(1)
        elif self.batch_first:
            output = output.transpose(0, 1)
        return output, state

    def _sequence_layout(self, input: Tensor | PackedSequence, hx) -> tuple[Tensor, list[int], object, bool]:
        """``(data (Σ steps, input_size), steps, hx, batched)`` of a checked call: the input in the
        packed layout (step ``t``'s ``steps[t]`` rows after step ``t - 1``'s, sequences longest
        first), the state with a batch dimension, in that order of sequences (or ``None``)."""
        if isinstance(input, PackedSequence):
            data = input.data
            self._check_input(data, 2)
            steps = [int(b) for b in input.batch_sizes]
            if hx is not None:  # given in the caller's order of sequences; the packed data are sorted by length
                hx = self._permuted(self._checked_state(hx, steps[0], True, data), input.sorted_indices)
            return data, steps, hx, True
        batched = self._check_input(input, 3) == 3
        data = input.unsqueeze(1) if not batched else input.transpose(0, 1) if self.batch_first else input
        length, n = int(data.shape[0]), data.shape[1]  # (the steps unroll in traced and exported programs)
        if length == 0:
            raise ValueError(f"{type(self).__name__}: the input's sequence length must be at least 1, got 0")
        if hx is not None:
            hx = self._checked_state(hx, n, batched, data)
        # step after step: the packed layout of equal lengths
        return data.reshape(length * n, self.input_size), [n] * length, hx, batched

    def _run(self, data: Tensor, steps: list[int], state: tuple[Tensor, Tensor | None], suffix: str, reverse: bool,
             packed: bool) -> tuple[Tensor, tuple[Tensor, Tensor | None]]:  # fmt: skip
        """One layer and direction over the sequence: ``data`` ``(Σ steps, in)`` in the packed
        layout (step ``t``'s ``steps[t]`` rows after step ``t - 1``'s, sequences longest first),
        ``state`` ``(h (N, H_out), c (N, H) or None)`` → its outputs in that layout and the final
        state, each sequence's after its own last step. ``packed``: sequences of several lengths (else
        every step has all of them, and ``steps`` may hold a traced program's symbolic batch)."""
        # every step's input product at once, then split into steps: one backward node for all of them
        # (a slice per step would each backpropagate a zero-filled gradient of the whole sequence)
        gates_x = getattr(self, f"ih_{suffix}")(data).split(steps)
        hh = getattr(self, f"hh_{suffix}")
        hr = getattr(self, f"hr_{suffix}") if self.proj_size else None
        order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
        h, c = state  # of all steps[0] sequences
        outputs = [None] * len(steps)
        for t in order:
            b = steps[t]  # the sequences still going (the first b: packed sequences are sorted by length)
            ragged = packed and b < steps[0]  # (else no slice: each would backpropagate a zero-filled copy)
            h_b, c_b = self._cell(gates_x[t], h[:b] if ragged else h, c[:b] if ragged and c is not None else c, hh, hr)
            outputs[t] = h_b
            # the rows past b finished (or, walking backwards, have not started): their state stays
            h = torch.cat([h_b, h[b:]]) if ragged else h_b
            if c is not None:
                c = torch.cat([c_b, c[b:]]) if ragged else c_b
        return torch.cat(outputs), (h, c)

    def _cell(self, gates_x: Tensor, h: Tensor, c: Tensor | None, hh: SparseLinear,
              hr: SparseLinear | None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """One step: ``gates_x`` ``(b, G·H)`` (the input product, with ``ih``'s bias), ``h``
        ``(b, H_out)``, ``c`` ``(b, H)`` (an LSTM's) → the new ``(h, c)``."""
        raise NotImplementedError

    def _initial_state(self, hx, index: int, n: int, like: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(h_0 (N, H_out), c_0 (N, H) or None)`` of layer-direction ``index``: ``hx``'s, or zeros."""
        lstm = self.mode == "LSTM"
        if hx is None:
            zeros = like.new_zeros
            return zeros(n, self._output_size), zeros(n, self.hidden_size) if lstm else None
        return (hx[0][index], hx[1][index]) if lstm else (hx[index], None)

    def _check_input(self, data: Tensor, most: int) -> int:
        """Raise unless ``data`` is a tensor of 2..``most`` dimensions (a packed one's: 2) and
        ``input_size`` features; its number of dimensions."""
        name = type(self).__name__
        if not isinstance(data, Tensor):
            raise TypeError(f"{name}: input must be a Tensor or a PackedSequence, got {type(data).__name__}")
        dims = (2,) if most == 2 else (2, 3)
        if data.dim() not in dims or data.shape[-1] != self.input_size:
            expected = "(T, N, input_size) or (T, input_size)" if most == 3 else "(Σ lengths, input_size)"
            if most == 3 and self.batch_first:
                expected = "(N, T, input_size) or (T, input_size)"
            raise ValueError(
                f"{name}(input_size={self.input_size}): input must have shape {expected}, got {tuple(data.shape)}"
            )
        return data.dim()

    def _checked_state(self, hx, n: int, batched: bool, like: Tensor):
        """``hx`` with a batch dimension, after checking it: a tensor (an LSTM: a pair of
        tensors) of the shapes ``forward`` documents, on ``like``'s device and of its dtype."""
        name = type(self).__name__
        lstm = self.mode == "LSTM"
        parts = hx if lstm else (hx,)
        if lstm and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(f"{name}: hx must be a tuple (h_0, c_0) or None, got {type(hx).__name__}")
        widths = (self._output_size, self.hidden_size)
        checked = []
        for part_name, part, width in zip(("h_0", "c_0"), parts, widths):
            if not isinstance(part, Tensor):
                raise TypeError(f"{name}: {part_name} must be a Tensor, got {type(part).__name__}")
            layers = self.num_layers * self._directions
            shape = (layers, n, width) if batched else (layers, width)
            if tuple(part.shape) != shape:
                raise ValueError(f"{name}: {part_name} must have shape {shape}, got {tuple(part.shape)}")
            if part.dtype != like.dtype or part.device != like.device:
                raise ValueError(
                    f"{name}: {part_name} must be {like.dtype} on {like.device} as the input is, got {part.dtype} on "
                    f"{part.device}"
                )
            checked.append(part if batched else part.unsqueeze(1))
        return tuple(checked) if lstm else checked[0]

    def _permuted(self, state, indices: Tensor | None):
        """``state`` (``h``, or an LSTM's ``(h, c)``) with its sequences in the order ``indices``
        gives (``None``: as it is)."""
        if indices is None:
            return state
        if self.mode == "LSTM":
            return tuple(s.index_select(1, indices) for s in state)
        return state.index_select(1, indices)

    def flatten_parameters(self) -> None:
        """Nothing to do: ``nn.LSTM`` packs its weights into one buffer for cuDNN here; a sparse
        layer's connections are its own (kept so that code calling it runs unchanged)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            kind, _, suffix = name.partition("_")
            configured = "hidden_size" in self.__dict__  # (weight_shapes reads the sizes: none yet in __init__)
            if kind in ("weight", "bias") and configured and suffix in self.weight_shapes():
                dense = f"nn.{self._dense_class.__name__}"
                raise AttributeError(
                    f"{type(self).__name__} has no dense {name}: its weights are sparse layers, and {dense}'s {name} "
                    f"is held by {suffix} here: {suffix}.values its connections, {suffix}.to_dense() the dense "
                    f"matrix (bias_{suffix}: {suffix}.bias); snack.densify(module) gives back an {dense}"
                ) from None
            raise

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            text += f", num_layers={self.num_layers}"
        for option, default in (("bias", True), ("batch_first", False), ("dropout", 0.0), ("bidirectional", False)):
            if getattr(self, option) != default:
                text += f", {option}={getattr(self, option)}"
        return text


class SparseLSTM(_SparseRNNBase):
    """``nn.LSTM`` with sparse weights: the same arguments (and ``sparsity``), attributes and
    ``forward`` (see :meth:`_SparseRNNBase.forward` for shapes), ``proj_size`` included.

    ``ih_l{k}`` ``(4H, in)``, ``hh_l{k}`` ``(4H, H_out)`` and, with ``proj_size``, ``hr_l{k}``
    ``(proj_size, H)`` (``_reverse`` for the second direction) are :class:`SparseLinear` layers
    holding what ``nn.LSTM`` calls ``weight_ih_l{k}`` and ``bias_ih_l{k}``, ...; gates in
    ``nn.LSTM``'s order (input, forget, cell, output). :meth:`from_dense` (or
    :func:`snack.sparsify`) converts an ``nn.LSTM``, :func:`snack.densify` converts back.
    """

    mode = "LSTM"
    _dense_class = nn.LSTM

    def _cell(self, gates_x, h, c, hh, hr):
        h, c = lstm_cell(gates_x + hh(h), c)
        return (h if hr is None else hr(h)), c


class SparseGRU(_SparseRNNBase):
    """``nn.GRU`` with sparse weights: the same arguments (and ``sparsity``), attributes and
    ``forward`` (see :meth:`_SparseRNNBase.forward`).

    ``ih_l{k}`` ``(3H, in)`` and ``hh_l{k}`` ``(3H, H)`` are :class:`SparseLinear` layers holding
    ``nn.GRU``'s ``weight_ih_l{k}``/``bias_ih_l{k}`` and ``weight_hh_l{k}``/``bias_hh_l{k}``, gates
    in its order (reset, update, new): ``n = tanh(x_n + r ⊙ (W_hn h + b_hn))``.
    """

    mode = "GRU"
    _dense_class = nn.GRU

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, *,
                 sparsity: float = 0.9, device=None, dtype=None):  # fmt: skip
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    def _cell(self, gates_x, h, c, hh, hr):
        return gru_cell(gates_x, hh(h), h), None


class SparseRNN(_SparseRNNBase):
    """``nn.RNN`` (Elman) with sparse weights: the same arguments (``nonlinearity`` ``"tanh"`` or
    ``"relu"``, and ``sparsity``), attributes and ``forward`` (see
    :meth:`_SparseRNNBase.forward`); ``ih_l{k}`` ``(H, in)`` and ``hh_l{k}`` ``(H, H)`` are
    :class:`SparseLinear` layers."""

    _dense_class = nn.RNN

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, *,
                 sparsity: float = 0.9, device=None, dtype=None):  # fmt: skip
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"SparseRNN: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.mode = f"RNN_{nonlinearity.upper()}"
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         sparsity=sparsity, device=device, dtype=dtype)  # fmt: skip

    @property
    def nonlinearity(self) -> str:
        return self.mode[4:].lower()

    def _cell(self, gates_x, h, c, hh, hr):
        pre = gates_x + hh(h)
        return (torch.tanh(pre) if self.mode == "RNN_TANH" else torch.relu(pre)), None

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.mode == "RNN_TANH" else f"{text}, nonlinearity='relu'"


def _per_layer(sparsity, names: list[str]) -> dict[str, float | None]:
    """``{layer name: sparsity or None}`` from one value or a mapping naming every layer."""
    if isinstance(sparsity, Mapping):
        if set(sparsity) != set(names):
            raise ValueError(f"sparsity: a mapping must name exactly {names}, got keys {sorted(sparsity)}")
        return {name: None if s is None else check_sparsity(s) for name, s in sparsity.items()}
    return dict.fromkeys(names, None if sparsity is None else check_sparsity(sparsity))
