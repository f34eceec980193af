"""One module per `mla` verb (see mla.cli.COMMANDS)."""
