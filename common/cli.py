"""How every covrl command reports a mistake of its user: one line on stderr, exit status 2, no traceback.

The errors a user can cause (a config key, a data row, a model directory, a placement, a missing file) are
`USER_ERRORS`; each says what was wrong and how to fix it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from common.checkpoint_dirs import CheckpointError
from common.config import ConfigError
from common.datasets import DatasetError
from common.runfiles import PlacementError

USER_ERRORS = (ConfigError, DatasetError, PlacementError, CheckpointError, FileNotFoundError)
EXIT_USAGE = 2  # as argparse exits on a bad flag


def fail(error: BaseException | str) -> int:
    """Print `error: ...` as one line on stderr; the exit status of a refused command."""
    text = " ".join(str(error).split())
    print(f"error: {text}", file=sys.stderr)
    return EXIT_USAGE

