# python -m entwine_jax {bench,tune} [args]: the package's command line. `bench` is the benchmark of
# docs/performance.md (entwine_jax.bench), `tune` runs entwine_jax.tune() over the local GPUs and stores the
# winners in the user cache. Its own entry point: `python -m entwine_jax.tuning` works too, but
# runpy warns there because the package imports that module first.
import sys

PROG = "python -m entwine_jax"
USAGE = f"""usage: {PROG} {{bench,tune}} [args]
  bench   time the fused ops against XLA ({PROG} bench --help)
  tune    tune() over the local GPUs, winners into the user cache ({PROG} tune --help)"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command not in ("bench", "tune"):
        what = "no command given" if command is None else f"unknown command {command!r}"
        print(f"{PROG}: {what} (expected bench or tune)\n{USAGE}", file=sys.stderr)
        return 2
    if command == "bench":
        from entwine_jax import bench as module
    else:
        from entwine_jax import tuning as module
    try:
        return module.main(argv[1:], prog=f"{PROG} {command}")
    except SystemExit as e:  # argparse: --help (0) and usage errors (2), already printed
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
