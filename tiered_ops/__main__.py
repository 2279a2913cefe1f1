"""``python -m tiered_ops``: the ``tiered-ops`` command line."""

from .cli.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
