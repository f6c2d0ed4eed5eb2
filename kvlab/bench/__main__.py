"""`python -m kvlab.bench`: see `kvlab.bench.cli`."""

from .cli import main

main()
