"""The engine: sequences, block manager, scheduler, cache engine, model runner, sampler, LLMEngine, AsyncEngine."""
