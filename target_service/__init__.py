"""The Target gRPC service: verifies a cycle's drafts in one forward pass."""
