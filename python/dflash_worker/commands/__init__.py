"""Entry points of `dflash-worker` subcommands, one module each."""
