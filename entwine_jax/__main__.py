# python -m entwine_jax tune [args]: tune() over the local GPUs, the winners into the user cache
# (entwine_jax.tuning.tune); python -m entwine_jax census MODULE:FUNCTION ...: the collective census of a
# user's function (entwine_jax.census). The benchmarks are programs of the repository (benchmarks/bench.py).
import sys

PROG = "python -m entwine_jax"
USAGE = f"""usage: {PROG} {{tune,census}} [args]
  tune    tune() over the local GPUs, winners into the user cache ({PROG} tune --help)
  census  the collectives of your function's compiled program, bytes per device ({PROG} census --help)
The benchmarks are programs in the repository: python benchmarks/bench.py --help"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command not in ("tune", "census"):
        what = "no command given" if command is None else f"unknown command {command!r}"
        print(f"{PROG}: {what} (expected tune or census)\n{USAGE}", file=sys.stderr)
        return 2
    if command == "census":
        from entwine_jax import census as module
    else:
        from entwine_jax.tuning import tune as module
    try:
        return module.main(argv[1:], prog=f"{PROG} {command}")
    except SystemExit as e:  # argparse: --help (0) and usage errors (2), already printed
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
