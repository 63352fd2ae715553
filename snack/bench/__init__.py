"""The layer benchmark behind ``snack bench``.

* :mod:`snack.bench.variants` — dense, dense+mask, torch.sparse CSR and snack layers;
* :mod:`snack.bench.timing` — device-synchronised, interleaved timing;
* :mod:`snack.bench.roofline` — this machine's bandwidth and GEMM peak, and the roofline bound;
* :mod:`snack.bench.harness` — the grid, the interleaved measurement, ratios and memory;
* :mod:`snack.bench.page_faults` — page faults per call, and glibc told to keep freed memory;
* :mod:`snack.bench.report` — terminal table, JSON/CSV, plot;
* :mod:`snack.bench.cli` — ``add_arguments(parser)`` / ``run(args)`` for the ``snack`` command.

Programmatic use::

    from snack.bench import Grid, keep_freed_memory, measure_machine, run_grid
    keep_freed_memory()  # as `snack bench` does: no variant faults in fresh pages every call
    machine = measure_machine(torch.device("cpu"))
    times, memory = run_grid(Grid(sizes=((4096, 4096),), sparsities=(0.9,), batches=(32,)), machine, torch.device("cpu"))
"""

from snack.bench.harness import Grid, MemoryRecord, TimeRecord, run_grid
from snack.bench.page_faults import keep_freed_memory
from snack.bench.roofline import Machine, measure_machine

__all__ = ["Grid", "Machine", "MemoryRecord", "TimeRecord", "keep_freed_memory", "measure_machine", "run_grid"]
