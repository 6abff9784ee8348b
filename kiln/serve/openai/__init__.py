"""The OpenAI-compatible API: completions and chat routes, request parsing, response formatting and tool
calls."""
