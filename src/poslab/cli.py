"""The ``poslab`` command: a thin layer over the library. Each subcommand lives next to the code it
drives, in a module with ``register(subparsers)``; this file only lists those modules and turns
user errors into one line on stderr with exit code 2."""
from __future__ import annotations

import argparse
import importlib
import io
import os
import select
import sys
import traceback

import torch  # every command imports it anyway; here only for its OutOfMemoryError

from poslab.errors import PoslabError, cut

CPU_ALLOCATOR = "DefaultCPUAllocator"  # in the message of torch's failed CPU allocations
CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool that a closed output pipe stopped

COMMAND_MODULES = [
    "poslab.demo",
    "poslab.tasks.cli",
    "poslab.data.cli",
    "poslab.train.cli",
    "poslab.analysis.cli",
    "poslab.models.dstg",
    "poslab.experiments.cli",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise PoslabError(f"{message} (see '{self.prog} --help')")  # which command: the help it names

    def parse_known_args(self, args=None, namespace=None):
        """Also records the innermost command that parsed (a subcommand parses before the command that called
        it returns): arguments nobody knew are reported by the top parser, which would name its own help."""
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "command_prog"):
            namespace.command_prog = self.prog
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="poslab", description="Build, train and dissect Transformers whose positional information is explicit.")
    from poslab import __version__

    parser.add_argument("--version", action="version", version=f"poslab {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    try:
        if sys.stdout is not None:  # None: started with its descriptor closed
            sys.stdout.flush()  # here, not at exit, where a closed pipe would print "Exception ignored ..."
    except BrokenPipeError:
        _drop_stdout()
        return code or CLOSED_PIPE
    return code


def _main(argv: list[str] | None) -> int:
    try:
        args, extras = build_parser().parse_known_args(argv)
        if extras:
            raise PoslabError(f"unrecognized arguments: {' '.join(extras)} (see '{args.command_prog} --help')")
        return int(args.func(args) or 0)
    except PoslabError as err:
        _error(str(err))
        return _failed()
    except OSError as err:  # unreadable input, unwritable output: the user's to fix
        if isinstance(err, BrokenPipeError) and _stdout_closed():
            # The reader of stdout left (`poslab ... | head`): stop quietly, as Unix tools do.
            _drop_stdout()
            return CLOSED_PIPE
        _error(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "))
        return _failed()
    except (MemoryError, torch.cuda.OutOfMemoryError) as err:  # numpy's and CUDA's: sizes it cannot hold
        _out_of_memory(err)
        return _failed()
    except RuntimeError as err:
        # torch's CPU allocator reports a failed allocation as a plain RuntimeError; so does gloo a collective
        # whose peer left (a rank that failed, and said why). Anything else is a bug.
        if _peer_left(err):
            _error("a collective operation with the other processes of this job failed, most likely because "
                   f"another rank stopped (its own message says why): {cut((str(err).splitlines() or [''])[0])}")
            return _failed()
        if CPU_ALLOCATOR not in str(err):
            raise
        _out_of_memory(err)
        return _failed()
    except KeyboardInterrupt as err:
        from poslab.train.parallel import launched_as_rank_zero

        if launched_as_rank_zero():  # under torchrun every rank stops alike: one line, not one each
            print("poslab: interrupted" + (f"; {err}" if str(err) else ""), file=sys.stderr)
        return 130


def _peer_left(err: RuntimeError) -> bool:
    """Whether ``err`` came out of a torch.distributed call in a job of several processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, torch.distributed.DistError) or bool(frames) and (
        f"torch{os.sep}distributed{os.sep}" in frames[-1].filename)


def _failed() -> int:
    """Exit code 2, called while the error is still being handled. Under torchrun a rank that fails alone
    leaves at once, by os._exit, once the error is printed (the code's own clean-up, its finally blocks, has
    already run): leaving the handler frees the error's traceback and with it DDP's reducer, whose process
    group joins gloo's worker threads with the GIL held while a worker waits for the GIL; the rank then hung
    (about one failure in four), torchrun never learned of it, and the other ranks waited in their collective
    for its timeout."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # a closed pipe, stream or descriptor (None)
                pass
        os._exit(2)
    return 2


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced by a stream without a file
        return None


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader left, rather than another pipe (a worker's, a socket) breaking."""
    fd = _stdout_fd()
    if fd is None or not hasattr(select, "poll"):  # Windows has no poll: report the error rather than guess
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _drop_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it once more at exit, which would fail on the closed pipe."""
    fd = _stdout_fd()
    if fd is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _out_of_memory(err: BaseException) -> None:
    what = cut(str(err).split("\n")[0])
    _error(f"out of memory{f' ({what})' if what else ''}; lower the sizes in the config (train.batch_size, "
           "model.d_model, model.n_layers, data sizes) or free memory")


def _error(message: str) -> None:
    """One line, whatever the message holds (a path may contain a line break)."""
    print("poslab: error: " + message.replace("\n", "\\n"), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
