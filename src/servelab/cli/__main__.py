"""``python -m servelab.cli``: the `servelab` command."""

from servelab.cli import main

main()
