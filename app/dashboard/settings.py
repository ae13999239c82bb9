"""Settings of ``kvmesh dashboard``, the standalone read-only dashboard: flags and ``KVMESH_``
variables, as for the router (it follows the cluster the same way, without routing)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from app.core.settings import Settings
from app.router.settings import RouterSettings

__all__ = ["DashboardSettings"]


class DashboardSettings(Settings):
    model_config = SettingsConfigDict(env_prefix="KVMESH_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, ge=0, le=65_535, description="port to listen on")
    load_interval_s: float = Field(0.25, gt=0, description="how often to read the workers' load")
    max_lag_ms: float = Field(2_000.0, gt=0, description="index older than this is stale")
    step_budget_ms: float = Field(
        10.0, gt=0, description="longest the consumer holds the event loop at a time"
    )

    def router_settings(self) -> RouterSettings:
        """The router's settings that the shared runtime reads (routing itself stays off)."""
        shared = ("redis_url", "log_level", "host", "port", "load_interval_s", "max_lag_ms")
        values = {name: getattr(self, name) for name in (*shared, "step_budget_ms")}
        return RouterSettings(**values)
