"""When DST updates happen and how much they change (separate from *what* they change).

Steps are counted from 1: step ``t`` is the ``t``-th call of ``dst.step()``, made after the
``t``-th ``optimizer.step()``.
"""

from __future__ import annotations

import math

from snack.dst.checks import check_fraction, check_int

__all__ = ["DropSchedule", "cubic_sparsity"]

SCHEDULES = ("cosine", "constant")


class DropSchedule:
    """Update steps and drop fraction of SET/RigL (and GraNet's regrowth).

    An update happens at every step ``t`` with ``t % update_every == 0`` and
    ``t <= end_step``, where ``end_step = floor(stop_fraction · total_steps)``: no updates after
    that, so the final topology gets the rest of training to settle (RigL's ``end_step``).

    The fraction of each layer's connections replaced at update step ``t`` is

    * ``"constant"``: ``drop_fraction``;
    * ``"cosine"``: ``drop_fraction · (1 + cos(π · t / end_step)) / 2``, decaying to 0 at
      ``end_step`` (RigL's cosine decay).
    """

    def __init__(self, drop_fraction: float, update_every: int, total_steps: int, stop_fraction: float, kind: str):
        self.drop_fraction = check_fraction(drop_fraction, "drop_fraction")
        self.update_every = check_int(update_every, "update_every", 1)
        self.total_steps = check_int(total_steps, "total_steps", 1)
        self.stop_fraction = check_fraction(stop_fraction, "stop_fraction")
        if kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
        self.kind = kind
        # rounded first: 0.29 · 100 is 28.999999999999996 in binary floating point
        self.end_step = math.floor(round(self.stop_fraction * self.total_steps, 9))

    def is_update_step(self, step: int) -> bool:
        return step >= 1 and step % self.update_every == 0 and step <= self.end_step

    def why_static(self) -> str | None:
        """Why no update step replaces a connection although ``drop_fraction`` > 0 (e.g.
        ``total_steps`` given in epochs), or ``None`` when one does (or ``drop_fraction`` is 0)."""
        steps = range(self.update_every, self.end_step + 1, self.update_every)
        # the fraction never grows with the step: the first update step decides
        if self.drop_fraction == 0 or (steps and self.fraction(steps[0]) > 0):
            return None
        why = f"updates stop after step {self.end_step} of {self.total_steps}"
        if steps:  # only the last step, where the cosine decay ends
            why += f", and step {self.end_step}, the only update step, has a drop fraction of 0"
        return why

    def fraction(self, step: int) -> float:
        if self.kind == "constant":
            return self.drop_fraction
        return self.drop_fraction * 0.5 * (1.0 + math.cos(math.pi * min(step, self.end_step) / self.end_step))


def cubic_sparsity(step: int, initial: float, final: float, start_step: int, end_step: int) -> float:
    """Sparsity at ``step`` on the cubic ramp of Zhu & Gupta (2017), *To prune, or not to prune*:

        s_t = s_f + (s_i - s_f) · (1 - (t - t_0) / (t_end - t_0))³   for t_0 ≤ t ≤ t_end,

    ``s_i`` before ``t_0`` and ``s_f`` after ``t_end``. It prunes fast early, while the network
    still has redundant weights, and slowly near the end.
    """
    if step <= start_step:
        return initial
    if step >= end_step:
        return final
    progress = (step - start_step) / (end_step - start_step)
    return final + (initial - final) * (1.0 - progress) ** 3
