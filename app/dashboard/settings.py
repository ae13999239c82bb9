"""Settings of ``kvmesh dashboard``, the standalone read-only dashboard: flags and ``KVMESH_``
variables, as for the router (it follows the cluster the same way, through a ``ClusterView``,
without routing)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from app.cluster.view import ViewConfig, check_read_interval
from app.core.settings import Settings

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
    event_read_interval_ms: float = Field(
        0.0,
        ge=0,
        description="read the workers' event streams at most this often (what they flush "
        "meanwhile comes in one read: fewer reads, an index up to this much later; 0: at once)",
    )

    @model_validator(mode="after")
    def _read_interval_valid(self) -> DashboardSettings:
        check_read_interval(self.event_read_interval_ms / 1000, self.max_lag_ms)
        return self

    def view_config(self) -> ViewConfig:
        return ViewConfig(
            load_interval_s=self.load_interval_s,
            max_lag_ms=self.max_lag_ms,
            step_budget_s=self.step_budget_ms / 1000,
            read_interval_s=self.event_read_interval_ms / 1000,
        )
