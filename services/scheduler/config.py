"""scheduler configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from baton.protocol import LIVE_IDS_PER_REPORT
from services.common.auth import TenantRecord
from services.common.block_hash import MAX_OVERLAP_BLOCKS
from services.common.config import ServiceConfig, check_instance_id, doc
from services.common.errors import shown
from services.common.slo import DEFAULT_TPOT_BUDGET_MS, DEFAULT_TTFT_BUDGET_MS
from services.common.telemetry import MAX_LABEL_VALUES
from services.scheduler.admission import TenantLimits
from services.scheduler.policies import POLICIES

# What --tenant-limits may set of a tenant (its record's admission fields).
_LIMIT_FIELDS = tuple(field.name for field in dataclasses.fields(TenantLimits))


def parse_tenant_limits(text: str) -> dict[str, TenantLimits]:
    """--tenant-limits as TenantLimits by tenant; ValueError naming what is wrong."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("expected an object of tenants")
        limits = {}
        for tenant, fields in raw.items():
            if not isinstance(fields, dict):
                raise ValueError(f"{tenant}={shown(fields)}: expected an object of limits")
            if unknown := set(fields) - set(_LIMIT_FIELDS):
                raise ValueError(f"{tenant}.{sorted(unknown)[0]}: unknown field; known: {', '.join(_LIMIT_FIELDS)}")
            try:
                # Its limits checked as a tenant's record checks them: "2" for a limit failed every Place of the
                # tenant with a TypeError, 0 refused it for ever, NaN, 2.5 and true passed as unlimited, 3 and 1
                # (helper-189). Not its name: without --auth a tenant is any the routers take ("team/a").
                TenantRecord(tenant="limits", **fields)
            except ValueError as exc:
                raise ValueError(f"{tenant}.{exc}") from None
            limits[tenant] = TenantLimits(**fields)
        return limits
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--tenant-limits={text!r}: {exc}") from None


@dataclass(frozen=True)
class SchedulerConfig(ServiceConfig):
    """Places each request on a node."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50200")
    instance_id: str = doc("this replica's id in etcd (1 to 128 of letters, digits and . _ : @ -)", "scheduler-0")
    load_timeout_s: float = doc("a node silent for longer than this is no candidate", 10.0)
    kvindex_timeout_s: float = doc("deadline of an overlap query, however many replicas it asks (hedged: the next "
                                   "one after a fifth of it, for at most a tenth of the queries beyond 10 in 10 s); "
                                   "past it, place without cache info", 0.25)
    max_overlap_blocks: int = doc("most leading blocks of a prompt an overlap query asks about (no more than the "
                                  "kvindexes' --max-overlap-blocks); a longer prompt's cache matches in these only",
                                  MAX_OVERLAP_BLOCKS)
    policy: str = doc("placement policy: baton, dynamo, llm_d, sglang, least_loaded or round_robin", "baton")
    prefill_load_scale: float = doc("weight of prefill blocks in the KV/load cost (dynamo policy)", 1.0)
    retry_ratio: float = doc("retries (migrations) allowed as a fraction of requests over 10 s, or of the streams "
                             "in flight when more", 0.2)
    retry_min_per_s: float = doc("retries allowed per second whatever the request rate", 5.0)
    max_queued: int = doc("most requests the admission queue holds (memory bound)", 10_000)
    model_plan_interval_s: float = doc("how often the leader plans model loads and unloads", 1.0)
    model_swap_idle_s: float = doc("a node idle this long may have its model swapped for one in demand; a node drained "
                                   "for a swap must have had its models at least this long (and their load time)", 10.0)
    model_idle_unload_s: float = doc("unload a model idle this long on a node if another keeps it warm; 0: never",
                                     0.0)
    model_load_timeout_s: float = doc("deadline of one LoadModel call", 300.0)
    task_timeout_s: float = doc("a task with no request for this long has ended (failed unless complete)", 300.0)
    admission_lease_s: float = doc("an admitted request keeps its tenant's concurrency slot this long unless a "
                                   "router reports it live again (or it ends); several of the routers' "
                                   "--live-report-interval-s", 15.0)
    tenant_limits: str = doc('per tenant, JSON: {"acme": {"weight": 2, "max_concurrency": 64, '
                             '"tokens_per_minute": 1000000}}; a record of `baton tenants` overrides its tenant\'s '
                             'entry', "{}")
    slo_ttft_ms: int = doc("time to first token the placement policy aims at for a request that sets no "
                           "ttft_budget_ms (the routers' --slo-ttft-ms); not a deadline: admission refuses "
                           "only on budgets the request sets", DEFAULT_TTFT_BUDGET_MS)
    slo_tpot_ms: int = doc("mean time per output token the placement policy aims at for a request that sets no "
                           "tpot_budget_ms (the routers' --slo-tpot-ms)", DEFAULT_TPOT_BUDGET_MS)
    max_id_len: int = doc("longest tenant a Place may name, in characters (the routers' --max-id-len); a request "
                          "or workflow id may be twice as long and one more (scoped by its tenant)", 128)
    max_tenant_labels: int = doc("distinct tenants the admission metrics label by name, the first seen; later ones "
                                 "are 'other' (0: every one; a Place may name any tenant)", MAX_LABEL_VALUES)
    max_live_ids: int = doc("most request ids (and workflow ids) one ReportLiveRequests may carry; at least the "
                            f"{LIVE_IDS_PER_REPORT} a router sends per report (it splits a longer list)",
                            LIVE_IDS_PER_REPORT)
    auth: bool = doc("GetRecentDecisions and GetClusterState need an API key (metadata 'authorization: Bearer "
                     "<key>'): an administrator's sees everything, a tenant's only its own decisions", False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_instance_id("instance-id", self.instance_id)
        if self.load_timeout_s <= 0:
            raise ValueError(f"--load-timeout-s: must be positive, got {self.load_timeout_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.max_queued < 1:
            raise ValueError(f"--max-queued: must be positive, got {self.max_queued}")
        parse_tenant_limits(self.tenant_limits)
        if self.retry_ratio < 0 or self.retry_min_per_s < 0:
            raise ValueError("--retry-ratio and --retry-min-per-s must be 0 or more")
        for name in ("model_plan_interval_s", "model_load_timeout_s", "task_timeout_s", "admission_lease_s",
                     "max_id_len", "max_overlap_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {getattr(self, name)}")
        if self.model_swap_idle_s < 0 or self.model_idle_unload_s < 0:
            raise ValueError("--model-swap-idle-s and --model-idle-unload-s must be 0 or more")
        if self.max_live_ids < LIVE_IDS_PER_REPORT:
            raise ValueError(f"--max-live-ids: must be at least {LIVE_IDS_PER_REPORT}, the request ids a router "
                             f"reports at once (fewer would refuse its reports and free its requests' slots), got "
                             f"{self.max_live_ids}")
        if self.max_tenant_labels < 0:
            raise ValueError(f"--max-tenant-labels: must be 0 or more, got {self.max_tenant_labels}")
        if self.kvindex_timeout_s <= 0:
            raise ValueError(f"--kvindex-timeout-s: must be positive, got {self.kvindex_timeout_s}")
