"""Errors that are the caller's mistake: shown as one clear line, never as a traceback."""


class UserError(Exception):
    """Bad input (unknown model, missing file, corrupt weights, ...); the CLI prints it and exits 2."""


def require_extra(module: str, extra: str = "bench"):
    """Import `module`, a dependency of an optional extra (training and benchmarks: matplotlib,
    jiwer), or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{module} is not installed: pip install 'sglang-omni-flash[{extra}]'") from None


def run_command(main, name: str) -> int:
    """The exit status of a command (`whisper-flash ...` or a benchmark script): `main()`, with a
    user's mistake (a bad manifest line, an unknown model) printed as one line naming the command,
    and exit status 2; never a traceback."""
    import sys

    try:
        return int(main() or 0)
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
