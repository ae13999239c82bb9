"""kvmesh services: worker, router, dashboard, CLI."""
