"""One module per `kiln` subcommand; each has `register(subparsers)`, which sets the parser's `run`."""
