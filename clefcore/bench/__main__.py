"""``python -m clefcore.bench``: the same as ``clefcore bench``."""

from . import main

raise SystemExit(main())
