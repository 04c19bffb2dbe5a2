"""python -m services.router"""

import asyncio
import sys

from services.common.config import parse_config
from services.common.server import serve, setup_logging
from services.common.telemetry import Telemetry
from services.router.config import RouterConfig
from services.router.servicer import RouterService


async def main() -> int:
    config = parse_config(RouterConfig, "BATON_ROUTER")
    setup_logging(config.log_level)
    telemetry = Telemetry("router", config.otel_exporter, config.channel_credentials(), config.metrics_listen,
                          config.instance_id)
    service = RouterService(config, telemetry)
    if not await service.open_http():
        await service.close()
        return 2
    return await serve(service, config.listen, telemetry, grace_s=config.shutdown_grace_s,
                       credentials=config.server_credentials())


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
