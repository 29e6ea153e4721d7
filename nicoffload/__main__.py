"""`python -m nicoffload` is the `nicoffload` command."""

from nicoffload.cli import main

main()
