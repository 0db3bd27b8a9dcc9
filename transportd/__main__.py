"""``python -m transportd``: the command line (cli/), the same as the ``transportd`` command."""

from transportd.cli import main

main()
