"""The package's logger, and log lines said once per process (a reason that
would repeat on every call: a fallback, a buffer that keeps the staging copy).
Callers use `logs.log_once(...)`, so a test can patch it in one place."""
import logging

logger = logging.getLogger("pyallreduce")
_logged = set()


def log_once(message):
    if message not in _logged:
        _logged.add(message)
        logger.warning("pyallreduce: %s", message)
