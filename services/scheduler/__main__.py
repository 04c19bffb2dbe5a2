"""python -m services.scheduler"""

import asyncio
import sys

from services.common.config import parse_config
from services.common.server import serve, setup_logging
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerService


async def main() -> int:
    config = parse_config(SchedulerConfig, "BATON_SCHEDULER")
    setup_logging(config.log_level)
    telemetry = Telemetry("scheduler", config.otel_exporter, config.channel_credentials(), config.metrics_listen,
                          config.instance_id)
    return await serve(SchedulerService(config, telemetry), config.listen, telemetry,
                       grace_s=config.shutdown_grace_s, credentials=config.server_credentials())


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
