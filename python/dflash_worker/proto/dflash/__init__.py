"""Generated stubs for the `dflash` protobuf package."""
