"""HTTP server: OpenAI, Anthropic and Ollama-compatible APIs over the runtime engine (aiohttp)."""

from flare_core.server.app import build_app
from flare_core.server.serve import ServeError, drain, serve, serve_async

__all__ = ["ServeError", "build_app", "drain", "serve", "serve_async"]
