"""``python -m snack.backends.cpu --build [--verbose]``: compile the native CPU kernels now.
``python -m snack.backends.cpu --prune``: delete cached builds of other sources, torch or Python."""

import argparse
import sys

from snack.backends.cpu import build, prune  # builds nothing when imported

parser = argparse.ArgumentParser(prog="python -m snack.backends.cpu", description=__doc__)
action = parser.add_mutually_exclusive_group(required=True)
action.add_argument("--build", action="store_true", help="compile (if not cached) and load the kernels")
action.add_argument("--prune", action="store_true",
                    help="delete the cached builds that this source, torch and Python would never load")
parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
args = parser.parse_args()
if args.prune:
    removed = prune()
    print(f"snack: removed {len(removed)} stale build(s)" + "".join(f"\n  {path}" for path in removed), file=sys.stderr)
else:
    print(f"snack: native CPU kernels ready at {build(verbose=args.verbose or None)}", file=sys.stderr)
