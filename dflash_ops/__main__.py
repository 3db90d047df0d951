"""``python -m dflash_ops``: the ``dflash-ops`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
