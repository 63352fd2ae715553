"""``sparsify`` and ``densify``: turn a model's ``nn.Linear``, attention, recurrent, convolution
(and, on request, embedding) layers into :class:`SparseLinear` and its kin, and back."""

from __future__ import annotations

import fnmatch
import sys
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from snack.distributions import layer_sparsities
from snack.nn.attention import SparseMultiheadAttention
from snack.nn.conv import SparseConv2d
from snack.nn.conv1d import SparseConv1d
from snack.nn.conv3d import SparseConv3d
from snack.nn.conv_base import _SparseConvNd
from snack.nn.conv_transpose import SparseConvTranspose2d
from snack.nn.conv_transpose1d import SparseConvTranspose1d
from snack.nn.conv_transpose3d import SparseConvTranspose3d
from snack.nn.embedding import SparseEmbedding, unsupported_options
from snack.nn.embedding_bag import SparseEmbeddingBag
from snack.nn.layer import PRE_HOOKS_REASON, SparseLinear
from snack.nn.recurrent import SparseGRU, SparseLSTM, SparseRNN
from snack.nn.tied_head import SparseTiedHead
from snack.topology import linear_positions

__all__ = ["densify", "sparsify"]


# the convolutions sparsify converts (the classes themselves), and into what
SPARSE_CONVOLUTIONS: dict[type[nn.Module], type[_SparseConvNd]] = {
    nn.Conv2d: SparseConv2d, nn.Conv1d: SparseConv1d, nn.Conv3d: SparseConv3d,
    nn.ConvTranspose2d: SparseConvTranspose2d, nn.ConvTranspose1d: SparseConvTranspose1d,
    nn.ConvTranspose3d: SparseConvTranspose3d,
}


# the modules sparsify converts whole, as modules of several sparse layers (the classes
# themselves), and into what. Each sparse class has dense_weights(dense) ({sparse layer name:
# (weight, bias)}, the names its layers have), from_dense(dense, sparsity={name: ...}),
# _random_like(dense, {name: sparsity}) and to_dense_module() (densify's).
SPARSE_COMPOSITES: dict[type[nn.Module], type[nn.Module]] = {
    nn.MultiheadAttention: SparseMultiheadAttention, nn.LSTM: SparseLSTM, nn.GRU: SparseGRU, nn.RNN: SparseRNN,
}


def _conv1d_class():
    """``transformers``' ``Conv1D`` if transformers is already imported (a model using it is)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _dense_weight_and_bias(module: nn.Module, embeddings: bool) -> tuple[Tensor, Tensor | None] | None:
    """``(weight (out, in), a convolution's (out, in, kh, kw) or (out, in, k), bias)`` of a layer
    ``sparsify`` converts (with ``embeddings``, an ``nn.Embedding``'s or ``nn.EmbeddingBag``'s
    ``(num_embeddings, embedding_dim)`` table and no bias), else ``None``."""
    # not subclasses: see sparsify
    if type(module) is nn.Linear or type(module) in SPARSE_CONVOLUTIONS:
        return module.weight, module.bias
    if embeddings and type(module) in (nn.Embedding, nn.EmbeddingBag):
        return module.weight, None
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return module.weight.t(), module.bias  # Conv1D stores (in, out): y = x @ weight + bias
    return None


def _subclass_hint(linear: nn.Linear) -> str:
    """What makes a subclass of ``nn.Linear`` convertible, where something can (``sparsify`` leaves
    subclasses dense)."""
    if torch.nn.utils.parametrize.is_parametrized(linear):  # weight_norm, spectral_norm, orthogonal, ...
        return ": remove its parametrizations first (torch.nn.utils.parametrize.remove_parametrizations)"
    if isinstance(linear, nn.modules.lazy.LazyModuleMixin) and linear.has_uninitialized_params():
        return ": run a forward first, which gives it a weight"
    return ""


def _selected(names: list[str], include: Iterable[str] | None, exclude: Iterable[str] | None) -> bool:
    """Whether a module reachable under ``names`` (several when shared) is converted: one of its
    names is included, and none is excluded."""

    def matches(patterns: Iterable[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)

    return (include is None or matches(include)) and not (exclude is not None and matches(exclude))


def _patterns(value, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    patterns = list(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{name} must be a glob pattern or a list of them, got {value!r}")
    return patterns


def _modules_by_identity(root: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Each distinct submodule of ``root`` with every qualified name it is reachable under (a
    module shared between two places has two), in ``named_modules`` order."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, child in root.named_modules(remove_duplicate=False):
        found.setdefault(id(child), (child, []))[1].append(name)
    return found


def _parameter_owners(modules: dict[int, tuple[nn.Module, list[str]]]) -> dict[int, list[str]]:
    """``id(parameter)`` → the qualified names of every module that holds it directly (more than
    one module's names for a tied weight)."""
    owners: dict[int, list[str]] = {}
    for child, names in modules.values():
        for parameter in child._parameters.values():
            if parameter is not None:
                owners.setdefault(id(parameter), []).extend(names)
    return owners


def _install(root: nn.Module, converted: dict[str, nn.Module]) -> nn.Module:
    """Put each ``converted[name]`` in place of ``root``'s submodule ``name``; return the new root."""
    if "" in converted:
        return converted[""]
    for name, new in converted.items():
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
    return root


def _keep_module_state(new: nn.Module, old: nn.Module, pairs: list[tuple[Tensor | None, Tensor | None]]) -> None:
    """Give ``new`` the training mode of ``old`` and, for each ``(new parameter, old parameter)``,
    the old one's ``requires_grad`` (a frozen layer stays frozen)."""
    new.train(old.training)
    for new_param, old_param in pairs:
        if new_param is not None and old_param is not None:
            new_param.requires_grad_(old_param.requires_grad)


class _LeftDense(NamedTuple):
    """Layers ``sparsify`` selected but does not convert, each as its name and why."""

    subclassed: list[str]  # subclasses of nn.Linear
    other_convolutions: list[str]  # subclasses of the converted convolutions
    embedding_options: list[str]  # nn.Embedding with options a SparseEmbedding does not have
    hooked: list[str]  # with forward pre-hooks
    tied: list[str]  # whose parameters another module holds too


class _Tie(NamedTuple):
    """A module that shares an ``nn.Embedding``'s table, converted with it."""

    embedding: nn.Embedding  # the one converted: the first holder of the table that sparsify meets
    head: bool  # an nn.Linear output layer (a SparseTiedHead); else an nn.Embedding (the same SparseEmbedding)


class _Chosen(NamedTuple):
    """What ``sparsify`` converts: ``layers`` ``{first name: (module, all its names, weight (out, in),
    bias)}``, ``composites`` ``{first name: (module converted whole, all its names)}`` (attentions,
    recurrent layers: :data:`SPARSE_COMPOSITES`) and ``ties`` ``{first name: (module, all its names,
    its _Tie)}``."""

    layers: dict[str, tuple[nn.Module, list[str], Tensor, Tensor | None]]
    composites: dict[str, tuple[nn.Module, list[str]]]
    ties: dict[str, tuple[nn.Module, list[str], _Tie]]


def _ties(
    modules: dict[int, tuple[nn.Module, list[str]]], owners: dict[int, list[str]], include: list[str] | None,
    exclude: list[str] | None,
) -> dict[int, _Tie]:
    """``{id(module): _Tie}`` of the modules ``sparsify(embeddings=True)`` converts with the
    ``nn.Embedding`` whose weight they share: for an ``nn.Embedding`` it may convert, every other
    holder of its weight must be an ``nn.Linear`` output layer (a :class:`SparseTiedHead`: GPT-2's
    ``lm_head``) or an ``nn.Embedding`` of the same ``padding_idx`` (the same
    :class:`SparseEmbedding`: T5's encoder and decoder tables), all selected; else none is tied."""
    by_name = {name: child for child, names in modules.values() for name in names}
    ties: dict[int, _Tie] = {}
    for child, names in modules.values():
        convertible = type(child) is nn.Embedding and not (unsupported_options(child) or child._forward_pre_hooks)
        if not convertible or id(child) in ties:
            continue
        holders = {id(by_name[name]): by_name[name] for name in owners[id(child.weight)] if name not in names}
        if holders and _selected(names, include, exclude) and all(
            _shares_table(holder, child, modules[id(holder)][1], owners, include, exclude)
            for holder in holders.values()
        ):
            ties.update({i: _Tie(child, type(holder) is nn.Linear) for i, holder in holders.items()})
    return ties


def _shares_table(
    module: nn.Module, embedding: nn.Embedding, names: list[str], owners: dict[int, list[str]],
    include: list[str] | None, exclude: list[str] | None,
) -> bool:
    """Whether ``module`` (reachable under ``names``), a holder of ``embedding``'s weight, is one
    ``sparsify`` converts with it (see :func:`_ties`)."""
    if getattr(module, "weight", None) is not embedding.weight or module._forward_pre_hooks or not _selected(
        names, include, exclude
    ):  # (a module holding the table under another name is nothing sparsify converts)
        return False
    if type(module) is nn.Linear:  # an output layer: its bias its own
        return module.bias is None or set(owners[id(module.bias)]) <= set(names)
    return type(module) is nn.Embedding and module.padding_idx == embedding.padding_idx and not (
        unsupported_options(module)
    )


def _choose_layers(
    modules: dict[int, tuple[nn.Module, list[str]]], include: list[str] | None, exclude: list[str] | None,
    embeddings: bool,
) -> tuple[_Chosen, _LeftDense]:
    """The layers and composites (attentions, recurrent layers) to convert, and the selected ones
    left dense."""
    chosen, left_dense = _Chosen({}, {}, {}), _LeftDense([], [], [], [], [])
    owners = _parameter_owners(modules)
    ties = _ties(modules, owners, include, exclude) if embeddings else {}
    composite_names: list[str] = []  # an attention's out_proj is part of it: converted with it or not at all
    for child, names in modules.values():
        if any(_inside(name, composite_names) for name in names):
            continue
        if isinstance(child, tuple(SPARSE_COMPOSITES)):
            composite_names.extend(names)
        if not _selected(names, include, exclude):
            continue
        shown = names[0] or "(root)"
        if id(child) in ties:
            chosen.ties[names[0]] = (child, names, ties[id(child)])
            continue
        if type(child) in SPARSE_COMPOSITES:
            parameters = list(child.parameters())
        elif isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and embeddings and unsupported_options(child):
            left_dense.embedding_options.append(f"{shown} ({unsupported_options(child)})")
            continue
        elif (wb := _dense_weight_and_bias(child, embeddings)) is not None:
            parameters = [p for p in child._parameters.values() if p is not None]
        elif isinstance(child, (nn.Linear, *SPARSE_COMPOSITES)):
            left_dense.subclassed.append(f"{shown} ({type(child).__name__}{_subclass_hint(child)})")
            continue
        else:
            if isinstance(child, nn.modules.conv._ConvNd):
                left_dense.other_convolutions.append(f"{shown} ({type(child).__name__})")
            continue
        tied = [name for i, tie in ties.items() if tie.embedding is child for name in modules[i][1]]
        held_elsewhere = {
            other for p in parameters for other in owners[id(p)] if not _inside(other, names) and other not in tied
        }
        if child._forward_pre_hooks:
            left_dense.hooked.append(shown)
        elif held_elsewhere:
            left_dense.tied.append(f"{shown} (with {', '.join(sorted(held_elsewhere))})")
        elif type(child) in SPARSE_COMPOSITES:
            chosen.composites[names[0]] = (child, names)
        else:
            chosen.layers[names[0]] = (child, names, *wb)
    return chosen, left_dense


def _inside(name: str, prefixes: list[str]) -> bool:
    """Whether the module ``name`` is one of ``prefixes`` or inside one (``""`` is the root)."""
    return any(name == p or p == "" or name.startswith(p + ".") for p in prefixes)


def _strictly_inside(name: str, prefix: str) -> bool:
    """Whether the module ``name`` is inside the module ``prefix`` (not ``prefix`` itself)."""
    return name != prefix and _inside(name, [prefix])


def _warn_about_layers_left_dense(left_dense: _LeftDense) -> None:
    subclassed, other_convolutions, embedding_options, hooked, tied = left_dense
    if embedding_options:
        warnings.warn(
            f"sparsify left {len(embedding_options)} nn.Embedding or nn.EmbeddingBag layer(s) dense: "
            f"{', '.join(embedding_options)}. SparseEmbedding and SparseEmbeddingBag have no counterpart of max_norm "
            "or scale_grad_by_freq; exclude the layers to silence this warning.",
            stacklevel=3,
        )
    if other_convolutions:
        warnings.warn(
            f"sparsify left {len(other_convolutions)} convolution(s) dense: {', '.join(other_convolutions)}. snack "
            "converts nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d and nn.ConvTranspose3d "
            "themselves, not their subclasses (whose forward may differ); convert one deliberately with the sparse "
            "layer's from_dense, or exclude it to silence this warning.",
            stacklevel=3,
        )
    if subclassed:
        warnings.warn(
            f"sparsify left {len(subclassed)} subclass(es) of nn.Linear, nn.MultiheadAttention, nn.LSTM, nn.GRU "
            f"or nn.RNN dense: {', '.join(subclassed)}. Their owners may read .weight or their forward may differ; "
            "convert one deliberately with the sparse class's from_dense (SparseLinear, SparseMultiheadAttention, "
            "SparseLSTM, ...), or exclude it to silence this warning.",
            stacklevel=3,
        )
    if hooked:
        warnings.warn(
            f"sparsify left {len(hooked)} layer(s) dense: {', '.join(hooked)}: {PRE_HOOKS_REASON}. Remove the hooks "
            "first (e.g. prune.remove(layer, 'weight')), or exclude the layers to silence this warning.",
            stacklevel=3,
        )
    if tied:
        warnings.warn(
            f"sparsify left {len(tied)} layer(s) dense whose parameters are tied to another module's: "
            f"{', '.join(tied)}. A sparse copy would untie them; exclude the layers to silence this warning "
            "(with embeddings=True, an nn.Embedding whose other holders are nn.Linear output layers, GPT-2's lm_head, "
            "or nn.Embedding layers of its padding_idx is converted with them, if all are selected).",
            stacklevel=3,
        )


def sparsify(
    module: nn.Module,
    sparsity: float = 0.9,
    *,
    distribution: str = "uniform",
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    init: str = "magnitude",
    embeddings: bool = False,
) -> nn.Module:
    """Replace the ``nn.Linear`` layers of ``module`` (and ``transformers``' ``Conv1D``) with
    :class:`SparseLinear`, its ``nn.MultiheadAttention`` modules with
    :class:`SparseMultiheadAttention` (whose four projections count as four layers for
    ``distribution``), its ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` modules with :class:`SparseLSTM`,
    :class:`SparseGRU` and :class:`SparseRNN` (each of their weight matrices a layer for
    ``distribution``), and its ``nn.Conv2d``, ``nn.Conv1d``, ``nn.Conv3d``,
    ``nn.ConvTranspose2d``, ``nn.ConvTranspose1d`` and ``nn.ConvTranspose3d`` layers with
    :class:`SparseConv2d`, :class:`SparseConv1d`, :class:`SparseConv3d`,
    :class:`SparseConvTranspose2d`, :class:`SparseConvTranspose1d` and
    :class:`SparseConvTranspose3d`, in place.

    Args:
        sparsity: overall fraction of zero weights in ``[0, 1)`` across the converted layers.
        distribution: how that sparsity is spread over layers (see :mod:`snack.distributions`).
        include, exclude: glob patterns on qualified module names (``"encoder.*"``); a layer is
            converted when it matches some ``include`` (default: all) and no ``exclude``.
        init: ``"magnitude"`` keeps each layer's largest-magnitude weights; ``"random"`` draws a
            fresh random topology and variance-preserving init (on the meta device: once
            materialised, by ``to_empty()`` and ``reset_parameters()``). An embedding's values are
            then scaled to the dense table's root mean square, so that its rows, and a tied head's
            logits, keep the dense model's scale (GPT-2 draws its table with std 0.02, where
            ``SparseEmbedding``'s own init keeps ``nn.Embedding``'s 1; not on the meta device).
        embeddings: also replace the ``nn.Embedding`` layers with :class:`SparseEmbedding` and the
            ``nn.EmbeddingBag`` layers with :class:`SparseEmbeddingBag` (off by default: dynamic
            sparse training usually keeps embeddings dense). One with
            ``max_norm`` or ``scale_grad_by_freq`` set stays dense, with a warning; ``padding_idx``
            and ``sparse`` (and a bag's ``mode`` and ``include_last_offset``) carry over. An
            ``nn.Linear`` output layer that shares its weight
            (GPT-2's ``lm_head``, tied to ``wte``) becomes a :class:`SparseTiedHead` of the sparse
            embedding (its bias kept), and another ``nn.Embedding`` that shares it (T5's encoder and
            decoder tables) the same :class:`SparseEmbedding`, if all are selected: they stay tied,
            one table of connections, counted once by ``distribution``.

    Returns:
        ``module`` itself, or a new :class:`SparseLinear` when ``module`` is itself a layer.

    Build the optimizer after this call: the converted layers' parameters are new objects, and an
    optimizer built before holds the old dense ones (training would leave the sparse weights as
    they are, silently).

    Each new layer keeps its predecessor's training mode and frozen parameters; a layer shared
    between places becomes one shared :class:`SparseLinear` (selected when one of its names is
    included and none excluded). Hooks registered on a replaced layer are not carried over; a
    layer with forward pre-hooks (``torch.nn.utils.prune``, ``weight_norm``), whose ``.weight``
    may be stale, stays dense, with a warning, and so does one whose weight or bias is tied to
    another module (but for an output layer tied to an embedding, see ``embeddings``): a sparse
    copy would untie them.
    Grouped and depthwise convolutions are converted too (ERK weighs their ``(out, in / groups, kh,
    kw)`` kernels: a depthwise one, of few weights, gets a high density). On the CPU a sparse
    depthwise convolution is slower than a dense one on small planes (8×8 and less) and faster on
    large ones (README, *A CIFAR MobileNetV2*). Subclasses of the converted convolutions stay
    dense, with a warning.
    Subclasses of ``nn.Linear``, ``nn.MultiheadAttention`` and the recurrent layers stay dense,
    with a warning: their owners may read ``.weight`` and their ``forward`` may differ; convert one
    deliberately with the sparse class's ``from_dense`` (:meth:`SparseLinear.from_dense`, ...). An attention's
    ``out_proj`` is converted with it, never alone (the attention reads its ``.weight``). An
    ``nn.TransformerEncoder`` some of whose layers are converted gets ``use_nested_tensor = False``
    (its fast path reads the dense weights).
    """
    include, exclude = _patterns(include, "include"), _patterns(exclude, "exclude")
    if init not in ("magnitude", "random"):
        raise ValueError(f"init must be 'magnitude' or 'random', got {init!r}")
    if not isinstance(embeddings, bool):
        raise TypeError(f"embeddings must be a bool, got {type(embeddings).__name__} {embeddings!r}")
    modules = _modules_by_identity(module)
    chosen, left_dense = _choose_layers(modules, include, exclude, embeddings)
    _warn_about_layers_left_dense(left_dense)
    _warn_about_what_sparsify_missed(modules, include, exclude, chosen, embeddings)
    shapes = _weight_shapes(chosen)
    on_meta = [name for name, (_, _, weight, _) in chosen.layers.items() if weight.device.type == "meta"]
    on_meta += [name for name, (child, _) in chosen.composites.items() if next(child.parameters()).is_meta]
    if on_meta and init == "magnitude":
        raise NotImplementedError(
            f"sparsify: layers {', '.join(map(repr, on_meta))} are on the meta device, whose weights hold no values "
            "to keep the largest of: pass init='random' (to_empty() and reset_parameters() then draw each layer's "
            "topology), or sparsify after materialising the model"
        )
    per_layer = layer_sparsities(shapes, sparsity, distribution)
    converted = {}
    for name, (child, names, weight, bias) in chosen.layers.items():
        layer = _sparse_layer(child, weight, bias, per_layer[name], init)
        _keep_module_state(layer, child, [(layer.values, weight), (layer.bias, bias)])
        converted.update(dict.fromkeys(names, layer))
    for name, (child, names) in chosen.composites.items():
        sparse_class = SPARSE_COMPOSITES[type(child)]
        sparsities = {part: per_layer[f"{name}.{part}"] for part in sparse_class.dense_weights(child)}
        if init == "magnitude":
            composite = sparse_class.from_dense(child, sparsity=sparsities)
        else:
            composite = sparse_class._random_like(child, sparsities)
        converted.update(dict.fromkeys(names, composite))
    for child, names, tie in chosen.ties.values():
        embedding = converted[modules[id(tie.embedding)][1][0]]
        converted.update(dict.fromkeys(names, _sparse_head(child, embedding) if tie.head else embedding))
    _turn_off_nested_tensor_fast_paths(modules, converted)
    return _install(module, converted)


def _weight_shapes(chosen: _Chosen) -> dict[str, tuple[int, ...]]:
    """``{name: weight shape}`` of every weight ``sparsify`` converts, for the distributions: a
    composite's as its sparse layers, an attention's four projections ``{name}.q_proj``, ...
    (``nn.MultiheadAttention`` packs the first three: ERK weighs each apart, as the sparse layers
    that hold them), an LSTM's ``{name}.ih_l0``, ``{name}.hh_l0``, ..."""
    shapes = {name: tuple(weight.shape) for name, (_, _, weight, _) in chosen.layers.items()}
    for name, (child, _) in chosen.composites.items():
        for part, (weight, _) in SPARSE_COMPOSITES[type(child)].dense_weights(child).items():
            shapes[f"{name}.{part}"] = tuple(weight.shape)
    return shapes


def _turn_off_nested_tensor_fast_paths(modules: dict[int, tuple[nn.Module, list[str]]], converted: dict) -> None:
    """Set ``use_nested_tensor = False`` on each ``nn.TransformerEncoder`` some of whose layers'
    modules are converted: its fast path reads the first layer's dense weights, and the
    constructor sets that flag False for layers it cannot take (as these now are)."""
    for child, names in modules.values():
        if isinstance(child, nn.TransformerEncoder) and any(
            _inside(converted_name, [f"{n}.layers" if n else "layers" for n in names]) for converted_name in converted
        ):
            child.use_nested_tensor = False


def _sparse_layer(dense: nn.Module, weight: Tensor, bias: Tensor | None, sparsity: float, init: str) -> SparseLinear:
    """The sparse layer that replaces ``dense`` (whose ``weight`` is ``(out, in)`` or a
    convolution's ``(out, in, kh, kw)`` or ``(out, in, k)``): its largest weights, or a random topology."""
    if type(dense) in (nn.Embedding, nn.EmbeddingBag):
        sparse_class = SparseEmbedding if type(dense) is nn.Embedding else SparseEmbeddingBag
        if init == "magnitude":
            return sparse_class.from_dense(dense, sparsity=sparsity)
        options = dict(sparse=dense.sparse)
        if type(dense) is nn.EmbeddingBag:
            options.update(mode=dense.mode, include_last_offset=dense.include_last_offset)
        layer = sparse_class(
            *weight.shape, padding_idx=dense.padding_idx, sparsity=sparsity, device=weight.device, dtype=weight.dtype,
            **options,
        )
        if weight.device.type != "meta":  # (N(0, 1)'s root mean square is 1: nn.Embedding's default unchanged)
            with torch.no_grad():
                layer.values.mul_(weight.detach().double().square().mean().sqrt().to(weight.dtype))
        return layer
    sparse_convolution = SPARSE_CONVOLUTIONS.get(type(dense))
    if sparse_convolution is not None:
        if init == "magnitude":
            return sparse_convolution.from_dense(dense, sparsity=sparsity)
        return sparse_convolution._random_like(dense, sparsity)
    if init == "magnitude":
        layer = SparseLinear.from_dense(weight, sparsity=sparsity, bias=bias)
    else:
        out_features, in_features = weight.shape
        layer = SparseLinear(
            in_features, out_features, bias is not None, sparsity=sparsity, device=weight.device, dtype=weight.dtype
        )
    if type(dense) is not nn.Linear:  # transformers' Conv1D: densify makes one again (_dense_layer)
        layer._densify_to = type(dense)
    return layer


def _sparse_head(linear: nn.Linear, embedding: SparseEmbedding) -> SparseTiedHead:
    """The :class:`SparseTiedHead` of ``embedding`` (the sparse one its weight's embedding became)
    that replaces ``linear``, with a copy of its bias."""
    head = SparseTiedHead(embedding, bias=linear.bias is not None)
    if linear.bias is not None:
        with torch.no_grad():
            head.bias.copy_(linear.bias)
        head.bias.requires_grad_(linear.bias.requires_grad)
    head.training = linear.training  # (not train(): that would set the embedding's too)
    return head


def _warn_about_what_sparsify_missed(
    modules: dict[int, tuple[nn.Module, list[str]]], include: list[str] | None, exclude: list[str] | None,
    chosen: _Chosen, embeddings: bool,
) -> None:
    """Warn where a sparsify call is likely not what its caller meant: a pattern that names no
    module (``"fc*"`` for ``"0.fc"``), nothing to convert (e.g. a second call meant to raise the
    sparsity), and layers of PyTorch's encoder layers whose attention stays dense: the layer's fast
    path, which reads ``.weight``, then stays on (a sparse attention turns it off)."""
    names = [name for _, all_names in modules.values() for name in all_names if name]
    for option, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns or ():
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                warnings.warn(
                    f"sparsify: {option} pattern {pattern!r} matches no module name (names look like "
                    f"{', '.join(repr(n) for n in names[:3])}; patterns match whole qualified names)",
                    stacklevel=3,
                )
    if not chosen.layers and not chosen.composites:
        sparse = sum(isinstance(child, SparseLinear) for child, _ in modules.values())
        already = (
            f"; its {sparse} SparseLinear layer(s) keep their sparsity (snack.dst.GradualPruning prunes further)"
            if sparse else ""
        )
        selected = " selected by include/exclude" if include is not None or exclude is not None else ""
        kinds = (
            "nn.Linear, nn.MultiheadAttention, recurrent (nn.LSTM, nn.GRU, nn.RNN), 1-, 2- or 3-D (transposed) "
            "convolution, nn.Embedding or nn.EmbeddingBag" if embeddings
            else "nn.Linear, nn.MultiheadAttention, recurrent (nn.LSTM, nn.GRU, nn.RNN) or 1-, 2- or 3-D "
            "(transposed) convolution"
        )
        warnings.warn(
            f"sparsify converted no layer: the model holds no {kinds}"
            f"{selected} that it may convert{already}",
            stacklevel=3,
        )
    by_name = {name: child for child, all_names in modules.values() for name in all_names}
    converted_attentions = {id(child) for child, _ in chosen.composites.values()}
    in_fast_path_layers = [
        name for name, (_, layer_names, _, _) in chosen.layers.items()
        if any(_in_dense_attention_encoder_layer(by_name[n.rpartition(".")[0]], converted_attentions)
               for n in layer_names if n)
    ]  # fmt: skip
    if in_fast_path_layers:
        warnings.warn(
            "sparsify converted layers of nn.TransformerEncoderLayer whose self_attn stays a dense "
            f"nn.MultiheadAttention ({', '.join(in_fast_path_layers)}): "
            "in eval mode their fast path reads linear1.weight, which a SparseLinear does not have; call "
            "torch.backends.mha.set_fastpath_enabled(False) before evaluating, or convert self_attn too",
            stacklevel=3,
        )


def _in_dense_attention_encoder_layer(parent: nn.Module, converted_attentions: set[int]) -> bool:
    """Whether ``parent`` is an encoder layer whose fused fast path stays on: its ``self_attn`` is
    a dense ``nn.MultiheadAttention`` (a converted one turns the fast path off)."""
    return (
        isinstance(parent, nn.TransformerEncoderLayer)
        and isinstance(parent.self_attn, nn.MultiheadAttention)
        and id(parent.self_attn) not in converted_attentions
    )


def densify(module: nn.Module) -> nn.Module:
    """Replace every :class:`SparseLinear` in ``module`` with an equivalent ``nn.Linear`` (every
    :class:`SparseEmbedding` with an ``nn.Embedding``, every :class:`SparseEmbeddingBag` with an
    ``nn.EmbeddingBag``, and
    every sparse convolution with its ``nn.Conv2d``, ``nn.Conv1d``, ``nn.Conv3d``,
    ``nn.ConvTranspose2d``, ``nn.ConvTranspose1d`` or ``nn.ConvTranspose3d``, every
    :class:`SparseMultiheadAttention` with an ``nn.MultiheadAttention``, every
    :class:`SparseLSTM`, :class:`SparseGRU`, :class:`SparseRNN` with an ``nn.LSTM``, ``nn.GRU``,
    ``nn.RNN``), in place (training mode, frozen parameters and sharing kept, as :func:`sparsify` does).

    A layer ``sparsify`` made of ``transformers``' ``Conv1D`` (GPT-2's) becomes a ``Conv1D`` again,
    and a :class:`SparseTiedHead` an ``nn.Linear`` tied to its dense embedding, so that a
    ``transformers`` model trained sparse goes back to its own layout (``save_pretrained``,
    ``from_pretrained``).

    Returns ``module``, or the new dense layer when ``module`` is itself a sparse one.
    """
    converted, composite_names, dense_of = {}, [], {}
    modules = _modules_by_identity(module)
    heads = [(child, names) for child, names in modules.values() if isinstance(child, SparseTiedHead)]
    head_names = [name for _, names in heads for name in names]
    for child, names in modules.values():
        if any(_inside(name, composite_names) for name in names):
            continue  # a sparse layer of an attention (recurrent layer) converted whole
        # (a tied head's embedding: where the model holds it; the head becomes an nn.Linear below)
        names = [name for name in names if not any(_strictly_inside(name, head) for head in head_names)]
        if isinstance(child, tuple(SPARSE_COMPOSITES.values())):
            composite_names.extend(names)
            converted.update(dict.fromkeys(names, child.to_dense_module()))
        elif isinstance(child, SparseLinear):
            dense = _dense_layer(child)
            dense_bias = getattr(dense, "bias", None)  # (an nn.Embedding has none)
            _keep_module_state(dense, child, [(dense.weight, child.values), (dense_bias, child.bias)])
            converted.update(dict.fromkeys(names, dense))
            dense_of[id(child)] = dense
    for head, names in heads:
        converted.update(dict.fromkeys(names, _dense_head(head, dense_of[id(head.embedding)])))
    return _install(module, converted)


def _dense_layer(layer: SparseLinear) -> nn.Module:
    """The dense layer ``densify`` makes of ``layer``: built uninitialised, then written in place
    (no second dense copy, no init overwritten at once). One ``sparsify`` made of ``transformers``'
    ``Conv1D`` becomes a ``Conv1D`` again, its weight stored ``(in, out)``, so that the model's
    ``save_pretrained`` writes, and ``from_pretrained`` reads, the layout it had."""
    device, dtype = layer.values.device, layer.values.dtype
    conv1d = getattr(layer, "_densify_to", None)
    if conv1d is not None:
        with torch.device("meta"):  # (Conv1D takes no device: its init would draw the weight at once)
            dense = conv1d(layer.out_features, layer.in_features)
        dense = dense.to_empty(device=device).to(dtype)
        positions = linear_positions(layer.col, layer.row, layer.out_features)  # (in, out) row-major
        with torch.no_grad():
            dense.weight.zero_().view(-1).index_put_((positions,), layer.values)
    else:
        dense = nn.utils.skip_init(**_dense_twin(layer), device=device, dtype=dtype)
        layer._write_dense_into(dense.weight)
    if layer.bias is not None:
        with torch.no_grad():
            dense.bias.copy_(layer.bias)
    return dense


def _dense_head(head: SparseTiedHead, embedding: nn.Embedding) -> nn.Linear:
    """The ``nn.Linear`` ``densify`` makes of ``head``: its weight is ``embedding``'s (the dense
    one the head's embedding became), tied as before ``sparsify``."""
    dense = nn.utils.skip_init(
        nn.Linear, head.in_features, head.out_features, head.bias is not None, device=embedding.weight.device,
        dtype=embedding.weight.dtype,
    )
    dense.weight = embedding.weight
    if head.bias is not None:
        with torch.no_grad():
            dense.bias.copy_(head.bias)
    _keep_module_state(dense, head, [(dense.bias, head.bias)])
    return dense


def _dense_twin(layer: SparseLinear) -> dict:
    """``nn.utils.skip_init``'s arguments for the dense layer ``densify`` makes of ``layer``."""
    if isinstance(layer, _SparseConvNd):
        return dict(module_cls=layer._dense_class, **layer._dense_arguments())
    if isinstance(layer, SparseEmbeddingBag):
        return dict(module_cls=nn.EmbeddingBag, num_embeddings=layer.num_embeddings,
                    embedding_dim=layer.embedding_dim, mode=layer.mode, padding_idx=layer.padding_idx,
                    include_last_offset=layer.include_last_offset, sparse=layer.sparse)  # fmt: skip
    if isinstance(layer, SparseEmbedding):
        return dict(module_cls=nn.Embedding, num_embeddings=layer.num_embeddings, embedding_dim=layer.embedding_dim,
                    padding_idx=layer.padding_idx, sparse=layer.sparse)  # fmt: skip
    return dict(module_cls=nn.Linear, in_features=layer.in_features, out_features=layer.out_features,
                bias=layer.bias is not None)  # fmt: skip
