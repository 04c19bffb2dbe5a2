"""router configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from services.common.config import MAX_NODES_OF_A_REQUEST, ServiceConfig, check_instance_id, check_listen, doc
from services.common.sampling_checks import NODE_MAX_STOP_SEQUENCES, NODE_MAX_STOP_TOKENS
from services.common.slo import DEFAULT_TPOT_BUDGET_MS, DEFAULT_TTFT_BUDGET_MS, Slo
from services.common.telemetry import MAX_LABEL_VALUES
from services.router.connection_rate import ConnectionRates
from services.router.http_api import DEFAULT_READ_TIMEOUT_S
from services.router.validation import InputLimits


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    """The client-facing entry point."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50100")
    instance_id: str = doc("this router's id in etcd (1 to 128 of letters, digits and . _ : @ -)", "router-0")
    http_listen: str = doc("host:port to serve the OpenAI-compatible HTTP API on (empty: no HTTP API)", "")
    http_read_timeout_s: float = doc("longest an HTTP client may take to send a request's head (from connecting, or "
                                     "from its last answer on a kept-alive connection: the connection is closed) "
                                     "and then its body (answered 408)", DEFAULT_READ_TIMEOUT_S)
    default_max_tokens: int = doc("max_tokens when a request leaves it unset", 256)
    placement_timeout_s: float = doc("longest one leader may hold a placement, admission queueing included, when "
                                     "the client set no deadline (a failover to another leader may add "
                                     "--leader-wait-s)", 60.0)
    # A dead leader's election key stands until etcd expires its lease, which etcd stretches: to at least 1.5 of
    # its election timeouts, to a whole TTL plus an election timeout after etcd's own leader changes, and not at all
    # while etcd has none (docs/etcd.md). 30 s covers one etcd election during the failover; 10 s did not.
    leader_wait_s: float = doc("how long a placement waits for a scheduler leader through a failover", 30.0)
    max_migrations: int = doc("how often one generation may move to another node after failures", 3)
    stall_floor_s: float = doc("shortest silence after which a node stream counts as stalled", 1.0)
    suspect_s: float = doc("after a node fails a stream, new placements avoid it this long", 5.0)
    stream_interval_s: float = doc("a client's stream gets at most one message this often; tokens that come in "
                                   "between are merged into the next (0: a message per node chunk)", 0.05)
    max_pending_chunks: int = doc("node chunks held for a client that is behind; when full, the router stops "
                                  "reading the node until the client reads", 256)
    live_report_interval_s: float = doc("how often the requests this router serves are reported to the scheduler "
                                        "leader, keeping their admission slots (well under its "
                                        "--admission-lease-s)", 2.0)
    max_prompt_bytes: int = doc("longest text prompt, in UTF-8 bytes, refused before it is tokenized", 1 << 20)
    max_stop_sequences: int = doc("most stop strings one request may carry", 16)
    max_stop_bytes: int = doc("most UTF-8 bytes of all a request's stop strings together", 4096)
    max_id_len: int = doc("longest request_id, tenant or workflow_id, in characters", 128)
    max_tenant_labels: int = doc("distinct tenants the latency histograms label by name, the first seen; later "
                                 "ones are 'other' (0: every one; without --auth a tenant is whatever the client "
                                 "sends)", MAX_LABEL_VALUES)
    max_requests_per_connection_per_s: float = doc(
        "requests one client connection (a gRPC channel's TCP connection, an HTTP connection) may send per "
        "second on average, past its burst; more are refused with RESOURCE_EXHAUSTED / 429 (0: no limit)", 500.0)
    connection_request_burst: int = doc("requests one connection may send at once before "
                                        "--max-requests-per-connection-per-s applies", 1000)
    auth: bool = doc("require an API key (metadata 'authorization: Bearer <key>', `baton tenants add`) on every "
                     "call; the request's tenant is then the key's, and its prefix cache is its own", False)
    slo_ttft_ms: int = doc("time to first token a request that sets no ttft_budget_ms is held to, for the "
                           "KPI", DEFAULT_TTFT_BUDGET_MS)
    slo_tpot_ms: int = doc("mean time per output token a request that sets no tpot_budget_ms is held to, "
                           "for the KPI", DEFAULT_TPOT_BUDGET_MS)

    # The public port: clients prove who they are with API keys, not certificates.
    requires_client_cert: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_instance_id("instance-id", self.instance_id)
        if self.http_listen:
            check_listen("http_listen", self.http_listen)
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens: must be positive, got {self.default_max_tokens}")
        if not 0 <= self.max_migrations < MAX_NODES_OF_A_REQUEST:
            # (At 64 or more, a request that moved that often ran on more nodes than its Finished notice may name: the
            # leader refused the notice, its cost was lost and its slot held until the sweep, helper-198.)
            raise ValueError(f"--max-migrations: must be 0 to {MAX_NODES_OF_A_REQUEST - 1} (a request runs on at most "
                             f"{MAX_NODES_OF_A_REQUEST} nodes), got {self.max_migrations}")
        if not 0 < self.http_read_timeout_s < math.inf:
            raise ValueError(f"--http-read-timeout-s: must be positive, got {self.http_read_timeout_s}")
        if self.stall_floor_s <= 0:
            raise ValueError(f"--stall-floor-s: must be positive, got {self.stall_floor_s}")
        if self.stream_interval_s < 0:
            raise ValueError(f"--stream-interval-s: must be 0 or more, got {self.stream_interval_s}")
        if self.max_pending_chunks < 1:
            raise ValueError(f"--max-pending-chunks: must be positive, got {self.max_pending_chunks}")
        if self.suspect_s < 0:
            raise ValueError(f"--suspect-s: must be 0 or more, got {self.suspect_s}")
        if self.leader_wait_s <= 0:
            raise ValueError(f"--leader-wait-s: must be positive, got {self.leader_wait_s}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"--placement-timeout-s: must be positive, got {self.placement_timeout_s}")
        if self.max_tenant_labels < 0:
            raise ValueError(f"--max-tenant-labels: must be 0 or more, got {self.max_tenant_labels}")
        if not 0 <= self.max_requests_per_connection_per_s < math.inf:
            raise ValueError("--max-requests-per-connection-per-s: must be 0 (no limit) or positive, got "
                             f"{self.max_requests_per_connection_per_s}")
        # What the router lets through, a node must take: a stop string's tokens are at most its bytes and one more
        # (a tokenizer's leading word mark), so half the node's tokens leave room for both.
        for name, most in (("max_stop_sequences", NODE_MAX_STOP_SEQUENCES),
                           ("max_stop_bytes", NODE_MAX_STOP_TOKENS // 2)):
            if getattr(self, name) > most:
                raise ValueError(f"--{name.replace('_', '-')}: at most {most} (what a node agent takes), "
                                 f"got {getattr(self, name)}")
        for name in ("live_report_interval_s", "max_prompt_bytes", "max_stop_sequences", "max_stop_bytes",
                     "max_id_len", "connection_request_burst", "slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {getattr(self, name)}")

    @property
    def slo(self) -> Slo:
        """The cluster's default SLO, which a request's own budgets override."""
        return Slo(ttft_ms=self.slo_ttft_ms, tpot_ms=self.slo_tpot_ms)

    @property
    def input_limits(self) -> InputLimits:
        return InputLimits(max_prompt_bytes=self.max_prompt_bytes, max_stop_sequences=self.max_stop_sequences,
                           max_stop_bytes=self.max_stop_bytes, max_id_len=self.max_id_len)

    def connection_rates(self) -> ConnectionRates | None:
        """A fresh per-connection rate limit as the flags set it; None with the limit off."""
        if self.max_requests_per_connection_per_s == 0:
            return None
        return ConnectionRates(self.max_requests_per_connection_per_s, self.connection_request_burst)
