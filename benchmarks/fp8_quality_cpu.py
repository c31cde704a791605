"""Issue 28's quality figure for FP8 weights, measured on the CPU with the default model's real weights.

The default model is a GGUF; FP8 quantizes a float checkpoint. So the weights are first dequantized to bfloat16 by
transformers and saved (`convert`), and that checkpoint, unquantized, is the reference. FP8 matmuls cannot run on
the CPU (`fp8.unsupported_reason` refuses them at load). This script lifts that check, so `Fp8Linear` runs its
plain-torch reference. That is the arithmetic the GPU runs: e4m3 codes, a float32 scale per output channel, per-token
activation scales, exact products. Only cuBLAS's accumulation order and its bfloat16 rounding of the product differ.
Then it runs `streamd bench quality` against the same checkpoint.

    python benchmarks/fp8_quality_cpu.py CHECKPOINT_DIR [bench quality flags...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def convert(out: Path) -> None:
    """The default GGUF's weights, dequantized to bfloat16 by transformers, saved as a float checkpoint at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamd.engine.worker.model_loader import default_gguf_path

    gguf = default_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)  # a GGUF-quantized model does not save; a fresh one of its weights does
    model = type(loaded)(type(loaded.config).from_dict(settings)).to(torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main() -> int:
    from streamd.bench import quality
    from streamd.engine.worker import fp8

    checkpoint = Path(sys.argv[1])
    if not (checkpoint / "config.json").is_file():
        convert(checkpoint)
    fp8.unsupported_reason = lambda device: None  # the reference FP8 GEMM on the CPU (module doc)
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    args = parser.parse_args(["--model", str(checkpoint), "--set", "model.quantization=fp8", *sys.argv[2:]])
    return quality.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
