"""Keep optimizer state aligned with a layer's connections when its topology changes.

An optimizer keeps per-parameter state (``optimizer.state[values]``): per-element tensors shaped
like ``values`` (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ...) and scalars (``step``). After a rewiring, element ``i`` of the new
``values`` is either the old connection ``src[i]`` or a new one (``src[i] = -1``): per-element
state is gathered at ``src``, and new connections get what the optimizer gives a fresh
parameter: zeros, except Adagrad's ``sum`` (``initial_accumulator_value``) and Rprop's
``step_size`` (the learning rate; zero would pin it at ``step_size_min``, freezing the new
connection for dozens of steps). Scalars are left as they are.
The ``values`` Parameter object itself is kept, so param groups, LR schedulers and the
optimizer's ``state_dict`` stay valid.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from snack.indexing import take_or_fill

__all__ = ["check_optimizer", "check_state", "remapped_state"]


def check_optimizer(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], *, hint: str = "") -> None:
    """Raise unless ``optimizer`` is an optimizer holding every parameter of ``params`` (name → param)
    whose state can be remapped; ``hint`` ends the message when it holds too few."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        # its history (old_dirs, old_stps) concatenates every parameter, kept in the state of
        # the first one only, which need not be a sparse layer's: no per-parameter check sees it
        raise ValueError(
            "snack.dst cannot remap torch.optim.LBFGS: its history holds all parameters flattened together, in "
            "the old connection order after a rewire; use an optimizer whose state is per element (SGD, Adam, "
            "AdamW, RMSprop, Adagrad, ...)"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in params.items() if id(p) not in held]
    if missing:
        frozen = [name for name in missing if not params[name].requires_grad]
        why = (
            f"; {frozen} {'is' if len(frozen) == 1 else 'are'} frozen (values.requires_grad is False), which an "
            "optimizer built from the trainable parameters leaves out"
            if frozen else ""
        )
        raise ValueError(
            f"the optimizer does not hold the values of sparse layer(s) {missing}{why}: build the optimizer from "
            f"the sparsified model's parameters (after snack.sparsify){hint}"
        )
    for name, p in params.items():
        check_state(optimizer, p, name)


def check_state(optimizer: torch.optim.Optimizer, param: Tensor, name: str) -> None:
    """Raise ``ValueError`` if some state of ``param`` is neither per-element nor a scalar."""
    for key, value in optimizer.state.get(param, {}).items():
        if isinstance(value, (list, tuple, dict)) and _holds_tensors(value):
            # e.g. LBFGS's history (old_dirs, old_stps): tensors in the old connection order that
            # the remap would not reach, so the next step would mix connections without a word
            raise ValueError(
                f"cannot remap optimizer state {key!r} of {name}.values: it holds tensors inside a "
                f"{type(value).__name__} (e.g. LBFGS's history); snack.dst supports optimizers whose state is per "
                "element (SGD, Adam, AdamW, RMSprop, Adagrad, ...)"
            )
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
            raise ValueError(
                f"cannot remap optimizer state {key!r} of {name}.values: shape {tuple(value.shape)} is neither "
                f"per-element {tuple(param.shape)} nor a scalar; snack.dst supports optimizers whose state is "
                "per element (SGD, Adam, AdamW, RMSprop, Adagrad, ...)"
            )


def _holds_tensors(container) -> bool:
    items = container.values() if isinstance(container, dict) else container
    return any(
        isinstance(item, Tensor) and item.dim() > 0 or isinstance(item, (list, tuple, dict)) and _holds_tensors(item)
        for item in items
    )


def remapped_state(optimizer: torch.optim.Optimizer, param: Tensor, src: Tensor, name: str) -> dict | None:
    """The state of ``param`` after a rewiring, without changing the optimizer.

    Args:
        src: ``(nnz_new,)`` int64; ``src[i]`` is the old position of new element ``i``, ``-1``
            for a new connection.

    Returns:
        a new state dict (``None`` if ``param`` has no state yet): per-element tensors
        ``(nnz_new,)`` with kept entries copied and fresh ones (module docstring) for new
        connections; other entries the same objects as before.
    """
    state = optimizer.state.get(param)
    if not state:
        return None
    check_state(optimizer, param, name)
    fresh = _fresh_values(optimizer, param)
    new_state = {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            new_state[key] = take_or_fill(value, src, fresh.get(key, 0.0))
        else:
            new_state[key] = value
    return new_state


def _fresh_values(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, float]:
    """Per-element state keys that ``optimizer`` starts at a non-zero value for ``param``."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if isinstance(optimizer, torch.optim.Adagrad):
        return {"sum": float(group["initial_accumulator_value"])}
    if isinstance(optimizer, torch.optim.Rprop):
        return {"step_size": float(group["lr"])}
    return {}
