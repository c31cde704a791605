"""From token ids to what a user reads: the output processor (per-request output state, stop strings), the
incremental detokenizers and chat templates. No torch."""
