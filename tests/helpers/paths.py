"""Where things are: the repository root, the built-in model, and the Hub commit ids of the test Hub cache."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_MODEL = os.path.join(REPO, "assets", "arith-base")
HUB_SHA = "0123456789abcdef0123456789abcdef01234567"  # refs/main of acme/arith-base in the `hub_cache` fixture
HUB_OLD = "fedcba9876543210fedcba9876543210fedcba98"  # an older snapshot beside it
