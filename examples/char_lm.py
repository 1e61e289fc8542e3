"""Character-level language model on rnnkern: train, resume, sample.

Train an LSTM on the documentation that ships with Python (no download), plot its
perplexity, and sample from it:

    python examples/char_lm.py --cell lstm --hidden 256 --epochs 10 \\
        --checkpoint lm.pt --plot perplexity.png --sample "The "

Continue training the same checkpoint up to 20 epochs, or only sample from it:

    python examples/char_lm.py --checkpoint lm.pt --resume --epochs 20
    python examples/char_lm.py --checkpoint lm.pt --epochs 0 --sample "def " --temperature 0.7

Data-parallel on two CPU processes (gloo; on GPUs add --device cuda for nccl):

    torchrun --standalone --nproc-per-node 2 examples/char_lm.py --batch 16 ...

``--batch`` is the number of streams per process.  ``--backend torch`` runs the
same model on torch.nn's modules: the baseline for timing rnnkern's backends.
The logic lives in ``examples/char_lm_train.py`` (:mod:`char_lm_train`, next to
this script).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import char_lm_train as char_lm  # examples/char_lm_train.py, next to this script


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help, unless the help already says
    what happens by default (argparse's ArgumentDefaultsHelpFormatter would add a
    second default) or there is no value to show (``None``, a flag's ``False``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def parse_args(argv=None) -> argparse.Namespace:
    d = char_lm.Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--cell", choices=char_lm.CELLS, default=d.cell,
                   help="recurrent cell (gru_reset_before: the classic GRU)")
    m.add_argument("--layers", type=int, default=d.layers, help="stacked recurrent layers")
    m.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    m.add_argument("--embed", type=int, default=d.embed, help="embedding width")
    m.add_argument("--one-hot", action="store_true", help="one-hot input instead of an embedding")
    m.add_argument("--backend", choices=char_lm.BACKENDS, default=d.backend,
                   help="rnnkern backend, or 'torch' for torch.nn's modules (the baseline)")
    m.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    m.add_argument("--dtype", choices=list(char_lm.DTYPES), default=d.dtype,
                   help="bfloat16/float16 train in mixed precision (float32 parameters, autocast)")
    m.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: torch's; torchrun sets 1)")
    t = p.add_argument_group("training")
    t.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 training text (default: Python's own documentation, pydoc_data)")
    t.add_argument("--max-chars", type=int, default=None, help="use only the text's first MAX_CHARS characters (default: all)")
    t.add_argument("--held-out", type=float, default=d.held_out,
                   help="fraction of the text (its end) kept for held-out perplexity")
    t.add_argument("--sampler", choices=char_lm.SAMPLERS, default=d.sampler,
                   help="sequential: streams read at offsets, state carried (truncated BPTT); "
                        "random: chunks at random offsets, state reset per batch")
    t.add_argument("--bptt", type=int, default=d.bptt, help="characters per truncated-BPTT chunk")
    t.add_argument("--batch", type=int, default=d.batch, help="parallel streams per process")
    t.add_argument("--epochs", type=int, default=d.epochs,
                   help="total epochs (a resumed run continues up to this count)")
    t.add_argument("--steps-per-epoch", type=int, default=None, help="cap on batches per epoch (default: the whole text)")
    t.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    t.add_argument("--clip", type=float, default=d.clip, help="max global gradient norm (0: off)")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the initial weights and of the random sampler")
    t.add_argument("--checkpoint", metavar="FILE", default=None, help="saved after every epoch")
    t.add_argument("--resume", action="store_true", help="continue training --checkpoint")
    t.add_argument("--plot", metavar="PNG", default=None, help="perplexity per epoch")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = p.add_argument_group("sampling")
    s.add_argument("--sample", metavar="PROMPT", default=None,
                   help="after training (or from --checkpoint alone), print text continuing PROMPT")
    s.add_argument("--length", type=int, default=400, help="characters to sample")
    s.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest character")
    s.add_argument("--sample-seed", type=int, default=0, help="seed of the sampling")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> char_lm.Config:
    return char_lm.Config(
        cell=args.cell, layers=args.layers, hidden=args.hidden, embed=0 if args.one_hot else args.embed,
        backend=args.backend, device=args.device, dtype=args.dtype, bptt=args.bptt, batch=args.batch,
        epochs=args.epochs, lr=args.lr, clip=args.clip, sampler=args.sampler, held_out=args.held_out,
        seed=args.seed, text=args.text, max_chars=args.max_chars, steps_per_epoch=args.steps_per_epoch,
        checkpoint=args.checkpoint, resume=args.resume, plot=args.plot,
        progress=not args.no_progress)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.epochs == 0 and args.checkpoint:
        # Nothing to train: load the checkpoint (to sample from it).
        model, vocab, history = char_lm.load_model(args.checkpoint, args.backend, args.device,
                                                   args.dtype)
        last = history[-1] if history else None
        if last is not None:
            print(f"{args.checkpoint}: {model.cell}, {model.layers} x {model.hidden}, "
                  f"{last.epoch} epochs, held-out perplexity {last.held_out_ppl}", file=sys.stderr)
    else:
        cfg = config_from_args(args)
        trained = char_lm.train(cfg)
        model, vocab = trained.model, trained.vocab
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.sample is not None and rank == 0:
        text = char_lm.generate(model, vocab, args.sample, args.length, args.temperature,
                                seed=args.sample_seed)
        print(text)
    char_lm.shutdown_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker skips the interpreter's teardown: there, gloo's threads
        # met C++ static destruction and aborted the process ("terminate called
        # without an active exception", about 1 run in 40, after the barrier and
        # destroy_process_group).  Every file the run writes is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
