"""Generated protobuf and gRPC stubs (see scripts/gen-proto.sh); do not edit by hand."""
