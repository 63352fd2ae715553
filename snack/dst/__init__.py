"""Dynamic Sparse Training on truly sparse layers: SET, RigL, gradual pruning, GraNet (gradual
pruning with RigL's regrowth), MEST (random growth under a soft memory bound), SRigL (RigL keeping
every output's fan-in), and :class:`DropGrow`, the base for writing new drop-and-grow algorithms.

Connections are pruned and regrown in the sparse format itself; no dense weight or mask is
ever built, and RigL forms its gradient scores in blocks of at most 2**20 entries (the whole
gradient only for a layer that small). Usage::

    model = snack.sparsify(net, sparsity=0.9, distribution="erk")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    dst = snack.dst.RigL(model, opt, drop_fraction=0.3, update_every=100, total_steps=T)
    for x, y in data:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        dst.step()          # True when the topology changed

Modules: :mod:`~snack.dst.prune_grow` (drop/grow primitives), :mod:`~snack.dst.update` (the
generic update), :mod:`~snack.dst.optim_state` (optimizer state remap),
:mod:`~snack.dst.schedules`, :mod:`~snack.dst.capture` (X/dY hooks for RigL),
:mod:`~snack.dst.base` (what every algorithm shares), :mod:`~snack.dst.algorithms`, :mod:`~snack.dst.granet`,
:mod:`~snack.dst.mest`, :mod:`~snack.dst.srigl`,
:mod:`~snack.dst.layers` (the ``layers=`` argument), :mod:`~snack.dst.distributed` (several ranks, DDP),
:mod:`~snack.dst.sharded` (FSDP-sharded layers).
"""

from snack.dst.algorithms import SET, DropGrow, GradualPruning, RigL
from snack.dst.base import DynamicSparsity
from snack.dst.granet import GraNet
from snack.dst.mest import MEST
from snack.dst.prune_grow import gradient_grow, gradient_grow_rows, magnitude_drop, random_grow
from snack.dst.schedules import DropSchedule, cubic_sparsity
from snack.dst.srigl import SRigL
from snack.dst.update import rewire

__all__ = [
    "SET",
    "DropGrow",
    "DropSchedule",
    "DynamicSparsity",
    "GraNet",
    "GradualPruning",
    "MEST",
    "RigL",
    "SRigL",
    "cubic_sparsity",
    "gradient_grow",
    "gradient_grow_rows",
    "magnitude_drop",
    "random_grow",
    "rewire",
]
