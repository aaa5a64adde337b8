# python -m entwine_jax {bench,tune} [args]: the package's command line. `bench` is the benchmark of
# DESIGN.md (entwine_jax.bench), `tune` runs entwine_jax.tune() over the local GPUs and stores the
# winners in the user cache. Its own entry point: `python -m entwine_jax.tuning` works too, but
# runpy warns there because the package imports that module first.
import sys

USAGE = """usage: python -m entwine_jax {bench,tune} [args]
  bench   the benchmark protocol of DESIGN.md (python -m entwine_jax bench --help)
  tune    tune() over the local GPUs, winners into the user cache (python -m entwine_jax tune --help)"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("bench", "tune"):
        print(USAGE, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "bench":
        from entwine_jax import bench
        return bench.main(argv[1:])
    from entwine_jax import tuning
    return tuning.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
