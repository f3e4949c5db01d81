"""``rljax`` command line: train | eval | sample | export | plot | plan.

Config overrides use ml_collections' flag syntax, ``--config.algo.beta=0.02`` (or
``--config.algo.beta 0.02``), and are typed by the schema in ``rljax.config``;
``--config.imports=my_ext.py`` imports user code before the config is checked.

Exit codes: 0 success (also a SIGTERM-preempted train run that saved its checkpoint),
1 a run-time failure rljax can describe (e.g. diverged, a damaged checkpoint, a checkpoint that
cannot be written), 2 a user error (bad config, missing file, command not available), 75 the
workdir is in use by another ``rljax train`` (try again later), 130 interrupted by Ctrl-C. User errors print one line,
``rljax: error: ...``, and no traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from typing import Callable, Sequence

from rljax.errors import RljaxError, UserError

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
RUN_MODULE = "rljax.train.run"


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separates ``--config.K=V`` / ``--config.K V`` overrides from the other arguments."""
    rest, overrides = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--config."):
            if "=" in arg:
                overrides.append(arg)
            elif i + 1 < len(args):
                overrides.append(f"{arg}={args[i + 1]}")
                i += 1
            else:
                raise UserError(f"{arg} needs a value ({arg}=VALUE)")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as UserError (one line, exit 2) instead of printing."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (overrides are removed before it runs)."""
    from rljax import __version__

    parser = _Parser(prog="rljax", description="JAX-native RL post-training for LLMs.",
                     epilog="Override any config key with --config.KEY=VALUE.")
    parser.add_argument("--version", action="version", version=f"rljax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    overrides = ("Override any config key with --config.KEY=VALUE (or --config.KEY VALUE), e.g. "
                 "--config.steps=200 --config.algo.beta=0.02; values are typed by the schema "
                 "in rljax/config/. Repeat for several keys.")

    p = sub.add_parser("train", help="train (resumes if WORKDIR has a checkpoint)",
                       epilog=overrides)
    p.add_argument("--config", help="config file (.py with get_config()); default: "
                   "WORKDIR/config.json when resuming")
    p.add_argument("--workdir", required=True)
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a checkpointed WORKDIR although the config differs from its "
                   "config.json (hyper-parameters only; a new `steps` needs no flag)")
    p.add_argument("--checkpoint", type=int, metavar="STEP",
                   help="resume from this checkpoint step instead of the newest (later "
                   "checkpoints are moved aside to <step>.discarded)")

    p = sub.add_parser("eval", help="evaluate the latest checkpoint (accuracy, pass@k)",
                       epilog=overrides)
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint", help="checkpoint step or path (default: latest)")
    p.add_argument("--prm", metavar="PRM_WORKDIR",
                   help="best-of-N instead: the policy samples --best-of completions per "
                   "held-out problem and the process reward model of this run (algo.name="
                   "'prm') picks the one whose steps score best")
    p.add_argument("--best-of", type=int, default=8, metavar="N",
                   help="with --prm: samples per problem (default 8)")
    p.add_argument("--prm-beam", type=int, default=0, metavar="B",
                   help="with --prm: step-level beam search instead of best-of-N: B prefixes "
                   "kept, --best-of continuations of each per step (default 0: best-of-N)")
    p.add_argument("--prm-score", choices=("min", "last", "mean", "prod"),
                   help="with --prm: how a sample's step scores combine (default: the PRM "
                   "run's algo.prm.step_score)")

    p = sub.add_parser("sample", help="generate completions for a prompt",
                       epilog=overrides)
    p.add_argument("--workdir", help="run directory (latest checkpoint)")
    p.add_argument("--checkpoint", help="checkpoint step/path or HF model dir")
    p.add_argument("--prompt", required=True, action="append",
                   help="prompt text: the question as in the data set, e.g. '23+45=' "
                   "(repeat for several); rendered with the run's data template and chat "
                   "template, as in training; a prompt that already holds the data "
                   "template's text is used as it is")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt text to the model as it is (no templates)")

    p = sub.add_parser("export", help="write an HF model directory: safetensors, config.json, "
                       "tokenizer files", epilog=overrides)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--checkpoint", help="checkpoint step (default: latest)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files in a non-empty --out (never a run directory)")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write a PEFT adapter dir instead of merged weights")

    p = sub.add_parser("plot", help="draw learning curves from metrics.jsonl")
    p.add_argument("dir", help="run directory (or a metrics.jsonl file)")
    p.add_argument("-o", "--out", help="PNG path (default: DIR/curves.png)")

    p = sub.add_parser("plan", help="compile the steps and report memory/shapes, no training",
                       epilog=overrides)
    p.add_argument("--config", required=True)
    p.add_argument("--cost", metavar="CHIP", default=None,
                   help="also each program's FLOPs, HBM and collective bytes per device and "
                        "its roofline time on CHIP (v4, v5e, v5p, v6e, h100, h200)")
    return parser


def _run_function(name: str, command: str) -> Callable:
    """``rljax.train.run.<name>``, or UserError when that part is not built yet."""
    try:
        module = importlib.import_module(RUN_MODULE)
    except ModuleNotFoundError as e:
        if e.name not in (RUN_MODULE, "rljax.train"):
            raise  # a real missing dependency inside run.py: keep the traceback
        module = None
    fn = getattr(module, name, None)
    if fn is None:
        raise UserError(f"`rljax {command}` is not available yet "
                        f"({RUN_MODULE}.{name} is not implemented in this version)")
    return fn


# ----------------------------------------------------------------------------- commands

def cmd_train(args, overrides) -> int | None:
    from rljax.train.core import workdir as wd

    # Compared with the workdir's config.json before anything is written (refused: one line).
    cfg, resuming, changes = wd.resolve_train_config(args.config, args.workdir, overrides,
                                                     args.allow_config_change)
    fn = _run_function("train", "train")
    if resuming:
        # A workdir's config.json may name Python files; say which ones this resume runs.
        print(f"rljax: resuming from {wd.checkpoint_dir(args.workdir)}{wd.code_files_line(cfg)}",
              file=sys.stderr)
        if changes:
            print(f"rljax: config changed since the last run: {'; '.join(changes)}",
                  file=sys.stderr)
    # Take the workdir's lock before writing config.json over a running run's (train() takes
    # it again, re-entrantly; on a multi-host run only process 0 does, inside train()).
    from rljax import distributed

    with wd.removed_if_refused(args.workdir):  # a refused new run leaves no workdir behind
        release = (wd.lock(args.workdir) if distributed.detect(os.environ, query_metadata=False)
                   is None else (lambda: None))
        try:
            if not resuming:
                wd.write_config(args.workdir, cfg)  # a resumed run's is rewritten once restored
            kwargs = {"allow_config_change": args.allow_config_change}
            if args.checkpoint is not None:
                kwargs["checkpoint"] = args.checkpoint
            return fn(cfg, args.workdir, **kwargs)
        finally:
            release()


def cmd_eval(args, overrides) -> int | None:
    from rljax.train.core import workdir as wd

    cfg = wd.load_workdir_config(args.workdir, overrides)
    if args.prm:
        return _run_function("evaluate_best_of_n", "eval")(
            cfg, args.workdir, args.prm, args.best_of, args.prm_score, checkpoint=args.checkpoint,
            beams=args.prm_beam)
    return _run_function("evaluate", "eval")(cfg, args.workdir, checkpoint=args.checkpoint)


def cmd_sample(args, overrides) -> int | None:
    from rljax import config as config_lib
    from rljax.train.core import workdir as wd

    if not args.workdir and not args.checkpoint:
        raise UserError("sample needs --workdir or --checkpoint")
    if args.workdir:
        cfg = wd.load_workdir_config(args.workdir, overrides)
    else:
        cfg = config_lib.load_config(None, overrides)
    fn = _run_function("sample", "sample")
    return fn(cfg, args.workdir, prompts=args.prompt, checkpoint=args.checkpoint, raw=args.raw)


def cmd_export(args, overrides) -> int | None:
    from rljax.train.core import workdir as wd

    wd.check_export_target(args.workdir, args.out, args.overwrite)  # before loading anything
    cfg = wd.load_workdir_config(args.workdir, overrides)
    kw = {"adapter": True} if args.adapter else {}
    return _run_function("export", "export")(cfg, args.workdir, args.out,
                                             checkpoint=args.checkpoint, overwrite=args.overwrite,
                                             **kw)


def cmd_plot(args, overrides) -> int | None:
    if overrides:
        raise UserError("plot takes no --config overrides")
    from rljax.train.core.plot import plot_metrics

    print(plot_metrics(args.dir, args.out))
    return 0


def cmd_plan(args, overrides) -> int | None:
    from rljax import config as config_lib
    from rljax import plan as plan_lib

    cfg = config_lib.load_config(args.config, overrides)
    return plan_lib.run(cfg, chip=args.cost)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "sample": cmd_sample,
            "export": cmd_export, "plot": cmd_plot, "plan": cmd_plan}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rljax`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        rest, overrides = split_overrides(argv)
        args = build_parser().parse_args(rest)
        code = COMMANDS[args.command](args, overrides)
        return 0 if code is None else int(code)
    except UserError as e:
        return _fail(e, EXIT_USER_ERROR)
    except FileNotFoundError as e:  # e.g. a data or model path named in the config
        return _fail(f"{e.strerror or 'not found'}: {e.filename}" if e.filename else e,
                     EXIT_USER_ERROR)
    except RljaxError as e:
        code = _fail(e, getattr(e, "exit_code", EXIT_FAILURE))
        if getattr(e, "abandon_threads", False):
            # orbax threads of a failed save may wait forever; do not join them at exit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise  # anything else is a bug: keep its traceback
        # A writer without its own message (export's safetensors, a tokenizer file, ...).
        where = f" {e.filename}" if e.filename else ""
        code = _fail(f"cannot write{where}: {e.strerror or os.strerror(e.errno)}", EXIT_FAILURE)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as for a failed checkpoint: threads writing to that disk may hang
    except KeyboardInterrupt:
        print("rljax: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# No space, quota, read-only, too large: a file system that cannot take the write.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _fail(message, code: int) -> int:
    text = " ".join(str(message).split())  # exactly one line, whatever the message held
    print(f"rljax: error: {text}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
