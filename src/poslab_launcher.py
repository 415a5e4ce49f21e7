"""The ``poslab`` command's entry point, outside the package: importing poslab takes seconds (torch and
transformers load), and a Ctrl-C then would escape as a traceback before ``poslab.cli.main`` could catch it.
(``python -m poslab`` imports the package before any of its code runs, so it keeps Python's traceback there.)"""
import sys


def main() -> int:
    try:
        from poslab.cli import main as poslab_main
    except KeyboardInterrupt:
        print("poslab: interrupted", file=sys.stderr)
        return 130
    return poslab_main()
