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
    telemetry = Telemetry("router", config.otel_exporter, config.metrics_listen)
    return await serve(RouterService(config, telemetry), config.listen, telemetry)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
