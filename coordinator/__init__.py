"""The public Coordinator gRPC service: drives draft/verify cycles, streams tokens."""
