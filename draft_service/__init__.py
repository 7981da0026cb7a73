"""The Draft gRPC service: proposes K tokens per cycle, each with its q."""
