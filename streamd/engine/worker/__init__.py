"""Execution on a device: loading the model, the KV pools (cache engine), paged attention, fused layers, CUDA
graphs, the model runner and the executors (one rank, or tensor-parallel ranks), and speculative decoding's
draft model (`draft_model.py`). The only room of the engine that runs a model; it takes its orders from the
core's `SchedulerOutput`."""
