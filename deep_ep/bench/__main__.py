"""`python -m deep_ep.bench`: see the package's docstring."""
import sys

from .cli import main

sys.exit(main())
