"""`server/tenants.py` on its own: who a request is for the fair share and the metrics, never its raw key; and
the engine's per-tenant stats summed per label as /metrics exports them."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from streamd.config import ServerConfig
from streamd.engine.stats import EngineStats, KVCacheStats, SchedulerStats, TenantStats
from streamd.server.metrics import Metrics
from streamd.server.tenants import Tenants, tenant_totals

SECRET = "sk-secret-of-bob"


def test_a_key_is_its_configured_name_or_a_digest_never_itself() -> None:
    tenants = Tenants(ServerConfig(api_keys=["sk-alice", SECRET], tenants=["alice=sk-alice"]))  # auto: by key
    assert tenants.of("sk-alice", "u1") == tenants.of("sk-alice")
    assert (tenants.of("sk-alice").name, tenants.of("sk-alice").label) == ("alice", "alice")
    bob = tenants.of(SECRET)
    assert bob.name.startswith("key-") and SECRET not in bob.name and bob.label == "other"
    assert bob == tenants.of(SECRET)  # stable: one fair share per key
    assert tenants.of(None).name == tenants.of("").name == "default"  # no key ("" as auth.api_key has it)


def test_user_and_none_modes() -> None:
    by_user = Tenants(ServerConfig(tenants=["carol=u-carol"]))  # auto without keys: by the body's user
    assert by_user.of(None, "u-carol").name == "carol"
    assert by_user.of(None, "u-dave").name.startswith("user-") and by_user.of(None, "u-dave").label == "other"
    nobody = Tenants(ServerConfig(api_keys=[SECRET], tenant_from="none"))
    assert nobody.of(SECRET, "u-dave").name == "default"


def test_metrics_sum_unnamed_tenants_as_other_and_never_show_a_key() -> None:
    tenants = Tenants(ServerConfig(api_keys=["sk-alice", SECRET], tenants=["alice=sk-alice"]))
    stats = [TenantStats("alice", 10, 5, 1, 20.0), TenantStats(tenants.of(SECRET).name, 7, 3, 0, 13.0),
             TenantStats("key-0000", 100, 50, 2, 200.0)]
    assert [(t.tenant, t.prompt_tokens, t.output_tokens, t.preemptions) for t in tenant_totals(stats, tenants.label)] \
        == [("other", 107, 53, 2), ("alice", 10, 5, 1)]
    engine = SimpleNamespace(stats=lambda: _engine_stats(stats))
    text = generate_latest(Metrics(engine, tenants.label).registry).decode()  # type: ignore[arg-type]
    assert 'streamd_tenant_prompt_tokens_total{tenant="other"} 107.0' in text
    assert 'streamd_tenant_preemptions_total{tenant="alice"} 1.0' in text
    assert SECRET not in text and "key-" not in text


def _engine_stats(tenants: list[TenantStats]) -> EngineStats:
    kv = KVCacheStats(blocks_total=1, blocks_free=1, blocks_cached=0, swap_blocks_total=0, swap_blocks_free=0,
                      swapped_out_blocks=0, swapped_in_blocks=0, prefix_queried_tokens=0, prefix_hit_tokens=0,
                      allocated_blocks=0, copied_blocks=0)
    sched = SchedulerStats(num_running=0, num_waiting=0, num_swapped=0, preemptions_swap=0, preemptions_recompute=0,
                           recomputed_tokens=0, tenants=tenants)
    return EngineStats(kv, sched, num_requests=0, generated_tokens=0)
