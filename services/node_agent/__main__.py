"""python -m services.node_agent"""

import asyncio
import sys

from services.common.config import parse_config
from services.common.reconnect import SERVER_PINGS_CALLERS_OPTIONS
from services.common.server import serve, setup_logging
from services.common.telemetry import Telemetry
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.factory import build_host
from services.node_agent.servicer import NodeAgentService


async def main() -> int:
    config = parse_config(NodeAgentConfig, "BATON_NODE")
    setup_logging(config.log_level)
    telemetry = Telemetry(f"node_agent/{config.node_id}", config.otel_exporter, config.channel_credentials(),
                          config.metrics_listen, config.node_id)
    host = build_host(config)
    return await serve(NodeAgentService(config, host, telemetry), config.listen, telemetry,
                       grace_s=config.shutdown_grace_s, credentials=config.server_credentials(),
                       options=SERVER_PINGS_CALLERS_OPTIONS)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
