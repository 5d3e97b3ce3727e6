"""`python -m autofit.cli`: the `autofit` command."""

from autofit.cli import main

main()
