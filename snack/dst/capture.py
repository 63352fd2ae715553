"""Record a layer's input ``X`` and output gradient ``dY`` during one training step.

RigL grows where ``|dYᵀ·X|`` is largest, which needs the batch of the update step. Hooks are
registered only while armed (the algorithm arms them right before an update step), so other
steps pay nothing. A forward hook stores ``X`` and puts a tensor hook on the output that
stores ``dY`` when backward reaches it. A layer run several times in one step (weight sharing,
micro-batches) records every call: ``Σ_calls dY_iᵀ·X_i`` is the gradient of the whole step, and
it equals the product of the calls concatenated along the batch. Several backward passes through
one call (``retain_graph=True``) add up, as ``.grad`` does; so does ``torch.autograd.grad``
through the layer (e.g. a gradient penalty's first pass), which ``.grad`` does not see.

``X`` is recorded as a copy: an input changed in place once its backward is done (micro-batches
copied into one reused buffer, an adversarial step ``x.data.add_``) would otherwise be scored as
it is at the update, not as the forward saw it. Layers whose ``values`` do not require a gradient
(frozen) record nothing: the algorithms leave them alone.

A :class:`snack.SparseEmbedding` records its lookups (ids and output gradients) and, apart, its
uses as an output layer (:meth:`~snack.SparseEmbedding.attend`, a tied head: the hidden rows
``(N, embedding_dim)`` and the logits' gradient ``(N, num_embeddings)``), whose gradients add up.
A :class:`snack.SparseEmbeddingBag` records its lookups before the bags are reduced (the ids and
the gradient of their rows, not of the bags): it registers the hook there
(``_register_recording_hook``), and runs the rows' lookup instead of its fused sum on those steps.

Memory: the records hold ``X`` and ``dY`` of every call until the update, ``N · (in + out)``
elements for ``N`` recorded rows, whatever the sparsity (the update itself then works in blocks,
see :func:`snack.dst.prune_grow.gradient_grow`). A convolution keeps its padded input, not the
im2col rows (``kh·kw`` times as many elements), and ``dY`` as rows ``(N · H_out · W_out, out)``; a
transposed convolution keeps its input and its padded output gradient.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import Tensor

from snack.nn import SparseEmbedding, SparseLinear

__all__ = ["GradientCapture"]


class GradientCapture:
    """Armable recorder of ``(X, dY (B, out))`` for a list of layers: ``X`` as each layer keeps it
    (``_record_of_input``: rows ``(B, in)``, a convolution's padded input ``(N, C, Hp, Wp)``)."""

    def __init__(self, layers: list[SparseLinear]):
        self.layers = layers
        self._handles: list = []  # changed in place only: the finalizer holds this list
        # per layer, per call: [X, dY (None until backward reaches it), whether the call was a head's]
        self._records: list[list[list]] = [[] for _ in layers]
        self._remove_hooks_when_collected()

    def _remove_hooks_when_collected(self) -> None:
        # The hooks hold this capture weakly: a DST object dropped while armed (a notebook cell
        # run again) must not leave hooks on the layers recording every later step. The finalizer
        # holds the handle list, not the capture.
        weakref.finalize(self, _remove_all, self._handles)

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        if not self.armed:
            self._register()

    def _register(self) -> None:
        self._handles[:] = [
            layer._register_recording_hook(_outside_graphs(_RecordingHook(self, i)))
            for i, layer in enumerate(self.layers)
        ] + [
            layer._register_attend_hook(_outside_graphs(_RecordingHook(self, i, head=True)))
            for i, layer in enumerate(self.layers)
            if isinstance(layer, SparseEmbedding)
        ]

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) of an armed capture, made with its layers: the layers'
        # copied hooks are inert (_RecordingHook.__reduce__), and the copied handles point at them.
        # Replace them with live hooks of this copy, or it would think itself armed and record
        # nothing. The records made so far are kept: the copy then updates as the original does.
        self.__dict__.update(state)
        self._remove_hooks_when_collected()
        if self._handles:
            _remove_all(self._handles)
            self._register()

    def disarm(self) -> None:
        _remove_all(self._handles)
        self._handles.clear()
        self.clear()

    def clear(self) -> None:
        self._records = [[] for _ in self.layers]

    def batch(self, index: int) -> tuple[Tensor, ...] | None:
        """``(X, dY (N, out))`` of every recorded call that reached backward, else ``None``; ``X``
        as the layer keeps it, or its rows ``(N, in)`` where calls' records differ in shape (a
        convolution run on two image sizes). An embedding's are ``(ids (N,), dY (N,
        embedding_dim), hidden (M, embedding_dim), dlogits (M, num_embeddings))``, its lookups' and
        its uses as a head's, either of no rows if it served only the other way."""
        layer = self.layers[index]
        records = self._records[index]
        if not isinstance(layer, SparseEmbedding):
            return self._joined(layer, records)
        lookups = self._joined(layer, [r for r in records if not r[2]])
        heads = self._joined(layer, [r for r in records if r[2]])
        if lookups is None and heads is None:
            return None
        empty = layer._empty_records(layer.values)
        return (*(lookups or empty[:2]), *(heads or empty[2:]))

    @staticmethod
    def _joined(layer: SparseLinear, records: list[list]) -> tuple[Tensor, Tensor] | None:
        """``(X, dY)`` of the ``records`` of ``layer``'s calls that reached backward, else ``None``."""
        done = [layer._operands_of_records(x, dy) for x, dy, _ in records if dy is not None]
        if not done:
            return None
        if len(done) == 1:  # the usual case: no copy
            return done[0]
        xs = [x for x, _ in done]
        if any(x.shape[1:] != xs[0].shape[1:] for x in xs):
            xs = [layer._rows_of_record(x) for x in xs]
        return torch.cat(xs), torch.cat([dy for _, dy in done])

    def record(self, index: int, x: Tensor, output: Tensor, head: bool = False) -> None:
        """Keep ``x`` as the layer keeps it (``_record_of_input``) and, when backward reaches
        ``output``, its gradient as the layer keeps it (``_record_of_output_gradient``: rows ``(N,
        out)``, for a convolution row for row with the im2col rows of ``x``, so that ``dYᵀ·rows`` is
        its weight gradient; a transposed convolution keeps it padded, and :meth:`batch` swaps the
        roles, ``_operands_of_records``). ``head``: the call was an embedding's
        :meth:`~snack.SparseEmbedding.attend`, :class:`SparseLinear`'s forward on its table, whose
        records are a linear layer's."""
        layer = self.layers[index]
        # A copy, not the input itself: the caller may change the input in place once its backward
        # is done (a reused buffer, an adversarial step), and the update must score what this
        # forward saw. Only update steps record, so the copy is rare.
        kept = x.detach().reshape(-1, layer.in_features).clone() if head else layer._record_of_input(x.detach())
        record = [kept, None, head]
        self._records[index].append(record)

        def grad_hook(grad: Tensor) -> None:
            # a vmapped backward (jacrev; autograd.grad(is_grads_batched=True), whose legacy batched
            # tensors cannot even be detached) carries many cotangents, not the loss's dY
            if _inside_vmap() or torch._C._functorch.is_legacy_batchedtensor(grad):
                return
            grad = to_rows(grad.detach())
            record[1] = grad if record[1] is None else record[1] + grad

        # A layer given (*, in) returns a view of its (N, out) result (a convolution's im2col path
        # too). An in-place op on that view (ReLU(inplace=True)) replaces the view's autograd
        # history, and a hook on the view would never fire; one on the (N, out) result still sees dY.
        width = layer.out_features if head else layer._output_width
        to_rows = (lambda grad: grad.reshape(-1, width)) if head else layer._record_of_output_gradient
        base = output._base
        if base is not None and base.shape == (output.numel() // width, width):
            output, to_rows = base, lambda grad: grad.reshape(-1, width)
        output.register_hook(grad_hook)


def _outside_graphs(hook: _RecordingHook):
    """``hook``, run outside the graphs of compiled models when ``torch.compile`` is in use.

    Recording copies X and hooks the output's gradient: Python side effects that Dynamo does not
    trace (it failed inside them, or warned and broke the graph at each of their calls). Wrapped
    in ``torch.compiler.disable``, the hook runs eagerly between two graphs, and a model compiled
    with ``fullgraph=True`` refuses with the reason below. The wrapping imports Dynamo (1.4 s),
    so it is done only where Dynamo is loaded already: a hook armed before that (by a RigL object
    made before ``torch.compile`` was first called, until its first update) is traced as before
    (a graph break with a warning; with ``fullgraph=True``, Dynamo's own error).
    """
    return _EagerHook(hook) if "torch._dynamo" in sys.modules else hook


class _EagerHook:
    """A :class:`_RecordingHook` that compiled code calls outside its graphs (see
    :func:`_outside_graphs`); copied, it is the hook's inert copy."""

    def __init__(self, hook: _RecordingHook):
        self.hook = hook
        self.run = torch.compiler.disable(
            hook,
            reason="snack.dst.RigL records each layer's X and dY eagerly on update steps: compile the model "
            "without fullgraph=True, or run update steps uncompiled",
        )

    def __call__(self, module, args: tuple, kwargs: dict, output) -> None:
        self.run(module, args, kwargs, output)

    def __reduce__(self):
        return self.hook.__reduce__()


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _inside_vmap() -> bool:
    stack = torch._C._functorch.get_interpreter_stack()
    return bool(stack) and any(level.key() == torch._C._functorch.TransformType.Vmap for level in stack)


class _RecordingHook:
    """The forward hook :meth:`GradientCapture.arm` puts on layer ``index``.

    A copy of the model (``copy.deepcopy``, ``torch.save``) made while it is armed gets an inert
    hook: the DST object acts on the original layers only. A copy of the DST object made together
    with the model replaces the inert hooks by its own (:meth:`GradientCapture.__setstate__`).
    """

    def __init__(self, capture: GradientCapture | None, index: int, head: bool = False):
        self.capture = weakref.ref(capture) if capture is not None else None
        self.index, self.head = index, head  # head: an embedding's attend hook

    def __call__(self, module, args: tuple, kwargs: dict, output) -> None:
        capture = self.capture() if self.capture is not None else None
        # eval passes (no_grad) never get a gradient, and a frozen layer is not updated: nothing to
        # record; nor inside torch.func.vmap, whose batched tensors must not escape it
        if capture is None or not (
            torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad
            and module.values.requires_grad
        ) or _inside_vmap():
            return
        capture.record(self.index, args[0] if args else kwargs["input"], output, self.head)

    def __reduce__(self):
        return _RecordingHook, (None, self.index, self.head)
