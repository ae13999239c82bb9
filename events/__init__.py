"""kvmesh KV event wire format, Redis Streams transport and cluster prefix index."""
