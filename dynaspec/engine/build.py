"""An engine ready to serve a user's config: ``Engine(config)``, then the profile that
``"dynamic_config_path": "auto"`` asks for. It sits above the engine and the profiler (which steps
the engine), so the engine never imports the profiler."""

from __future__ import annotations

from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.profiler import auto_profile


def build_engine(config: EngineConfig) -> Engine:
    """``Engine(config)``; with ``"dynamic_config_path": "auto"``, profiled on first use (a cached
    profile is read back) and choosing K by the goodput policy made from the profile."""
    engine = Engine(config)
    if engine.profile_pending:
        engine.profile_auto(auto_profile)
    return engine
