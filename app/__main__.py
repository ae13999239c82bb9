"""``python -m app`` is ``kvmesh``."""

import sys

from app.cli import main

sys.exit(main())
