"""`uniradix serve`: SGLang's native HTTP API and OpenAI's over one engine, with sessions
and Prometheus metrics. The engine runs on its own scheduler thread (runner.py); the
HTTP side (app.py, routes_*.py) parses, queues and streams, and never steps it."""
from .settings import ServerConfig

__all__ = ["ServerConfig"]
