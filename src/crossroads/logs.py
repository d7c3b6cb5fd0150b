"""Log output for ``crossroads serve``: plain text, or one JSON object per line
(``--log-format json``) for log shippers (journald, Loki, Elasticsearch)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """``{"time": ISO 8601 UTC, "level", "logger", "message"[, "exception"]}``,
    plus ``"worker"`` in a worker of ``--workers N``."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str, worker: int | None = None) -> None:
    """Send the process's logs to stderr in ``log_format`` ("text" or "json");
    ``worker``: this process is that worker of ``--workers N``, and every line
    says so (``crossroads[w1]:``, or ``"worker": 1``)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(worker))
    elif worker is not None:
        handler.setFormatter(
            logging.Formatter(TEXT_FORMAT.replace("%(name)s", f"%(name)s[w{worker}]"))
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
