"""python -m services.kvindex"""

import asyncio
import sys

from services.common.config import parse_config
from services.common.server import serve, setup_logging
from services.common.telemetry import Telemetry
from services.kvindex.config import KVIndexConfig
from services.kvindex.servicer import KVIndexService


async def main() -> int:
    config = parse_config(KVIndexConfig, "BATON_KVINDEX")
    setup_logging(config.log_level)
    telemetry = Telemetry("kvindex", config.otel_exporter, config.channel_credentials(), config.metrics_listen,
                          config.instance_id)
    return await serve(KVIndexService(config, telemetry), config.listen, telemetry,
                       grace_s=config.shutdown_grace_s, credentials=config.server_credentials())


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
