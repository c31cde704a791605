"""The engine's plain-Python core: sequences, the block manager and prefix cache, the scheduler and its plan,
token-level stops, admission, and the request registry with its deadlines. Nothing here imports torch (a test
checks it in a fresh interpreter), so the memory and scheduling decisions are testable exhaustively in
milliseconds."""
