"""Tensor parallelism (Megatron-style, the PagedAttention paper's §4.6): one centralized scheduler on rank 0
and N-1 worker processes, each rank holding 1/N of the attention heads, KV heads and MLP columns, and 1/N of
every KV block. `shard` cuts a loaded model (its row-parallel layers summing through `all_reduce`: the group's
backend or torch's symmetric memory), `step_message` packs one step's inputs into one flat tensor,
`executor` is rank 0's side (LLMEngine talks to it), `worker` is the other ranks' loop."""
