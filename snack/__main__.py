"""``python -m snack`` is the ``snack`` command."""

import sys

from snack.cli import main

sys.exit(main())
