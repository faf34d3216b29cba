"""`mars-hf generate`: chat with a model through MARS decoding; `--show-chunks` shows each forward."""

from __future__ import annotations

import argparse
import logging
import sys

from mars_hf.models.chat_inputs import chat_inputs
from mars_hf.models.eos import eos_token_ids, trim_at_eos
from mars_hf.tools.loading import DEFAULT_BLOCK_SIZE, load_model_and_tokenizer

logger = logging.getLogger(__name__)

HELP = "Generate text with MARS decoding (prompts in, chat template applied, text out)."

# Background colours that cycle over forward passes, like the paper's Figure 1.
CHUNK_COLOURS = ["\033[48;5;153m", "\033[48;5;223m", "\033[48;5;194m", "\033[48;5;225m", "\033[48;5;230m"]
RESET = "\033[0m"
DEFAULT_TAU = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="One or more user messages (decoded together as a batch).")
    parser.add_argument(
        "--model",
        default=None,
        help="Model folder or Hub id (default: the embedded SmolLM2-135M-Instruct); 'embedded-mars' is the "
        "MARS model shipped with mars-hf; 'synthetic' the tiny model trained on the synthetic counting "
        "language (trained once, then cached).",
    )
    parser.add_argument(
        "--tau",
        "--mars-threshold",
        dest="tau",
        type=float,
        default=None,
        help=f"MARS threshold τ (default {DEFAULT_TAU} for a MARS-trained model; 1.0, i.e. one token per "
        "forward, for a model without MARS training). τ = 1 equals ordinary decoding.",
    )
    parser.add_argument(
        "--window", type=int, default=None, help="MARS window W (default: config.mars block_size)."
    )
    parser.add_argument(
        "--acceptance",
        choices=["probability", "entropy", "margin", "verify"],
        default="probability",
        help="Confidence metric compared with τ, or 'verify': lossless verified decoding (the masks' "
        "predictions are drafts the model checks; output = ordinary decoding; --tau is then a proposal floor).",
    )
    parser.add_argument(
        "--layout",
        choices=["auto", "linear", "quadratic"],
        default=None,
        help="Draft layout of --acceptance verify (default, eager: 'auto', the step planner sizes each step from the "
        "forward cost measured on this machine, cached under $MARS_HF_HOME; with --compile: 'linear', the fixed feed).",
    )
    parser.add_argument(
        "--cache", choices=["cursor", "block", "none"], default=None, help="MARS KV-cache scheme."
    )
    parser.add_argument("--cache-block", type=int, default=None, help="Block C of the 'block' cache scheme.")
    parser.add_argument("--do-sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="Random seed (sampling).")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--system", default=None, help="Optional system message.")
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="Block size recorded for a model that has no MARS metadata yet (its mask token is untrained).",
    )
    add_dtype_argument(parser)
    add_tau_window_argument(parser)
    parser.add_argument(
        "--cpu-kernels",
        choices=["auto", "packed", "stock"],
        default="auto",
        help="Linear layers on CPU (mars_cpu_kernels; docs/accelerators.md). auto (default here): packed oneDNN "
        "weights where a short measurement finds them faster and the copy fits in memory; packed: always; stock: "
        "torch's default kernels (generate's own default). Which ran is printed to stderr.",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="transformers' fast path: a static cache and the forward compiled by Inductor "
        "(cache_implementation='static' + compile_config, no weight freezing). Each step width compiles once: about "
        "a minute on two cores the first time, about 15 s in a later process (Inductor's and AOTAutograd's on-disk "
        "caches), so it pays for long or repeated generation, not for one short answer (default: off, eager). "
        "Which path ran is printed to stderr.",
    )
    parser.add_argument(
        "--show-chunks",
        action="store_true",
        help="Colour the text by forward pass (tokens accepted together share a colour) and end with the "
        "number of forwards and tokens per forward.",
    )
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="With --show-chunks, separate chunks with '|' instead of colours.",
    )


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype auto|float32|bfloat16|float16|float64`` (the commands that load a model share it)."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help="Precision to load the model in. auto (default): bfloat16 where this CPU computes bf16 natively "
        "and a short probe measures it faster, float32 elsewhere (the choice is logged).",
    )


def add_tau_window_argument(parser: argparse.ArgumentParser) -> None:
    """``--tau-window planned|fixed``: how τ rows feed their masks (the commands that decode with τ share it)."""
    from mars_hf.tools.bench.configurations import DEFAULT_TAU_WINDOW, TAU_WINDOWS

    parser.add_argument(
        "--tau-window",
        default=DEFAULT_TAU_WINDOW,
        choices=TAU_WINDOWS,
        help="How τ < 1 feeds masks. planned (default here): the step planner sizes each step's mask group from "
        "what τ has kept and the step's cost (mars_planner=True), so masks that τ's own acceptance says do not "
        "pay are not fed; it changes which tokens τ can accept (MARS_SPEC §8). fixed: the paper's "
        "window W at every step (generate's own default). Which ran is printed to stderr.",
    )


def split_chunks(tokens: list[int], accepted: list[int]) -> list[list[int]]:
    """Cut one row's new tokens into the groups accepted by each forward (0 counts are skipped)."""
    chunks, start = [], 0
    for count in accepted:
        if count <= 0 or start >= len(tokens):
            continue
        chunks.append(tokens[start : start + count])
        start += count
    if start < len(tokens):  # pragma: no cover - accepted_counts always covers the output
        chunks.append(tokens[start:])
    return chunks


def render_chunks(tokenizer, chunks: list[list[int]], colour: bool = True) -> str:
    """Decode chunk by chunk as differences of prefix decodes (so merges across chunks stay right)."""
    pieces, done, previous = [], [], ""
    for chunk in chunks:
        done = done + chunk
        text = tokenizer.decode(done, skip_special_tokens=True)
        piece, previous = text[len(previous) :], text
        if not piece:
            continue
        if colour:
            code = CHUNK_COLOURS[len(pieces) % len(CHUNK_COLOURS)]
            # Colour each line of the piece separately so a background never runs across a line end.
            pieces.append("\n".join(f"{code}{line}{RESET}" if line else "" for line in piece.split("\n")))
        else:
            pieces.append(piece)
    return ("" if colour else "|").join(pieces)


def run(args) -> int:
    import torch
    from transformers import set_seed

    from mars_hf.decoding.acceptance import one_token_per_step
    from mars_hf.decoding.cpu_kernels import last_kernels
    from mars_hf.tools.bench.configurations import tau_feed_kwargs

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mars_hf.models.precision").setLevel(logging.INFO)  # say which dtype --dtype auto chose
    if args.window is not None and args.window < 1:
        print(f"--window must be >= 1, got {args.window}.", file=sys.stderr)
        return 2
    model, tokenizer, trained = load_model_and_tokenizer(
        args.model, block_size=args.window or args.block_size, dtype=args.dtype
    )
    tau = args.tau
    verify = args.acceptance == "verify"
    if tau is None and not verify:
        if args.acceptance != "probability":
            print(f"--acceptance {args.acceptance} needs an explicit --tau.", file=sys.stderr)
            return 2
        tau = DEFAULT_TAU if trained else 1.0
        if not trained:
            logger.warning("Using --tau 1.0 (one token per forward) because the mask token is untrained.")
    inputs = chat_inputs(tokenizer, args.prompt, args.system)
    set_seed(args.seed)
    generate_kwargs = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "return_dict_in_generate": True,
        "pad_token_id": tokenizer.pad_token_id,
        "mars_acceptance": args.acceptance,
        "mars_cpu_kernels": args.cpu_kernels,
    }
    if tau is not None:
        generate_kwargs["mars_threshold"] = tau
    plans_tau = not verify and args.tau_window == "planned" and not one_token_per_step(args.acceptance, tau)
    if plans_tau:
        generate_kwargs.update(tau_feed_kwargs(args.tau_window))
    for name, value in (
        ("temperature", args.temperature),
        ("top_k", args.top_k),
        ("top_p", args.top_p),
        ("mars_block_size", args.window),
        ("mars_cache", args.cache),
        ("mars_cache_block", args.cache_block),
        ("mars_layout", args.layout),
    ):
        if value is not None:
            generate_kwargs[name] = value
    if args.compile:
        from mars_hf.tools.bench.configurations import compiled_path

        # one answer: compile time matters more than a step's (a later process then compiles in about 15 s)
        generate_kwargs.update(compiled_path(device=str(model.device), freezing=False))
        generate_kwargs.pop("mars_cpu_kernels")  # the compiler chooses the kernels
    elif not plans_tau:
        # eager: the planner on the step costs measured here (generate times nothing unless asked); a planned τ
        # window plans on generate's assumed curve instead (nothing timed: the same command gives the same text)
        generate_kwargs["mars_cost_probe"] = True
    with torch.no_grad():
        output = model.generate(**inputs, **generate_kwargs)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    feed = f"; τ window: {'planned per step' if plans_tau else 'fixed'} (--tau-window)" if not verify else ""
    if args.compile:
        print(f"[path: static cache, compiled forward (--compile); {dtype}{feed}]", file=sys.stderr)
    else:
        print(
            f"[path: eager; {dtype}; linear layers: {last_kernels(model)} (--cpu-kernels {args.cpu_kernels}){feed}]",
            file=sys.stderr,
        )
    prompt_length = inputs["input_ids"].shape[1]
    eos_ids = eos_token_ids(model, tokenizer)
    rows = [
        trim_at_eos(output.sequences[i, prompt_length:].tolist(), eos_ids) for i in range(len(args.prompt))
    ]
    for index, tokens in enumerate(rows):
        if len(rows) > 1:
            print(f"### {args.prompt[index]}")
        if args.show_chunks:
            accepted = output.accepted_counts[:, index].tolist()
            print(render_chunks(tokenizer, split_chunks(tokens, accepted), colour=not args.no_color))
        else:
            print(tokenizer.decode(tokens, skip_special_tokens=True))
    if args.show_chunks:
        generated = sum(len(tokens) for tokens in rows)
        forwards = int(output.num_forwards)
        per_forward = generated / (forwards * len(rows))
        print(
            f"\n[{forwards} forwards, {generated} tokens, {per_forward:.2f} tokens per forward"
            + (f" per sequence, batch {len(rows)}" if len(rows) > 1 else "")
            + (
                f"; verify, {int(output.drafts_accepted.sum())} of {int(output.drafts_proposed.sum())} drafts kept"
                if verify
                else f"; tau={tau:g}"
            )
            + "]"
        )
    return 0
