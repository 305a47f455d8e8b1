"""``room-service``: the command line (``main`` holds the Typer app; ``options`` what every subcommand shares)."""
