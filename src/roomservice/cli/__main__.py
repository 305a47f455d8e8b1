"""``python -m roomservice.cli``."""

from roomservice.cli.main import main

main()
