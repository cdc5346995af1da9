"""`cobali synth-lora`: a LoRA adapter of random low-rank weights for a GGUF model, in llama.cpp's adapter format
(general.type "adapter", adapter.type "lora", adapter.lora.alpha; `<tensor>.lora_a` of shape rank x in and
`<tensor>.lora_b` of shape out x rank beside each adapted weight). It changes what the model says without a
download or a training run: for testing and measuring multi-adapter serving (`cobali serve --lora-modules`)."""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from cobali.config.flags import positive_int

DEFAULT_TARGETS = ("attn_q", "attn_v")


def write_random_lora(model_path: str, out: str, rank: int = 8, alpha: float = 8.0, scale: float = 0.05,
                      targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0) -> int:
    """Write the adapter; returns how many weights it adapts. ValueError when the model has none of `targets`."""
    reader = gguf.GGUFReader(model_path)
    adapted = [t for t in reader.tensors if any(t.name.endswith(f"{name}.weight") for name in targets)]
    if not adapted:
        raise ValueError(f"{model_path} has no weights named like {', '.join(targets)}")
    writer = gguf.GGUFWriter(out, bytes(reader.fields["general.architecture"].parts[-1]).decode())
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    rng = np.random.default_rng(seed)
    for tensor in adapted:
        n_in, n_out = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF lists ggml's order: columns first
        writer.add_tensor(f"{tensor.name}.lora_a", (rng.standard_normal((rank, n_in)) * scale).astype(np.float32))
        writer.add_tensor(f"{tensor.name}.lora_b", (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(adapted)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("synth-lora", help="write a LoRA adapter of random weights for a GGUF model")
    parser.add_argument("--model", default=None, help="the base GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="adapter GGUF to write")
    parser.add_argument("--rank", type=positive_int, default=8)
    parser.add_argument("--scale", type=float, default=0.05, help="standard deviation of the A and B entries")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="weights to adapt, by name (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=synth_lora_command)


def synth_lora_command(args: argparse.Namespace) -> int:
    from cobali.backends.embedded_model import embedded_model_path

    model = args.model or embedded_model_path()
    targets = tuple(t for t in args.targets.split(",") if t)
    try:
        adapted = write_random_lora(model, args.out, args.rank, float(args.rank), args.scale, targets, args.seed)
    except FileNotFoundError:
        raise ValueError(f"--model {model}: no such file") from None
    print(f"wrote {args.out}: rank {args.rank}, {adapted} weights adapted ({', '.join(targets)})")
    return 0
