"""What the server writes to its logs: API keys sent as `?key=` (Gemini's way) are redacted from
the access log's request lines."""

from __future__ import annotations

import logging
import re

_KEY = re.compile(r"([?&]key=)[^&\s]*")


class RedactKeys(logging.Filter):
    """Replaces the value of every `key=` query parameter in a record's text with `***`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _KEY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        if isinstance(record.msg, str):
            record.msg = _KEY.sub(r"\1***", record.msg)
        return True


REDACT_KEYS = RedactKeys()


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once: addFilter ignores a second call).
    Called at startup, after uvicorn has configured its loggers."""
    logging.getLogger("uvicorn.access").addFilter(REDACT_KEYS)
