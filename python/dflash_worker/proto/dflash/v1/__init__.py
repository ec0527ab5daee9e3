"""Generated gRPC stubs for dflash.v1 (scripts/gen-proto.sh); do not edit."""
