"""``python -m snack.backends.cpu --build [--verbose]``: compile the native CPU kernels now."""

import argparse
import os
import sys

parser = argparse.ArgumentParser(prog="python -m snack.backends.cpu", description=__doc__)
parser.add_argument("--build", action="store_true", required=True, help="compile (if not cached) and load the kernels")
parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
args = parser.parse_args()
if args.verbose:
    os.environ["SNACK_BUILD_VERBOSE"] = "1"  # read by build(), which importing the package runs

from snack.backends.cpu import build  # noqa: E402

print(f"snack: native CPU kernels ready at {build()}", file=sys.stderr)
