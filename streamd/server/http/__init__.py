"""The HTTP routes: OpenAI-compatible completions and chat, the Responses API, vLLM's tokenizer routes, the
server info the page reads, and the guard every HTTP request passes first."""
