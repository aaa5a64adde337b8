# sitecustomize.py: entwine_jax.maxtext.enable() for MaxText's own launch (python -m
# maxtext.trainers.pre_train.train ...), unchanged. Put this folder on the run's PYTHONPATH. Other
# processes pay one meta-path finder and nothing else (docs/maxtext.md, "The switch").
"""Enable entwine_jax.maxtext in the MaxText process only, loudly.

How: a meta-path finder waits for ``absl.app`` to be imported and wraps its ``run``; when
``absl.app.run(main)`` is called by a program run as ``python -m maxtext....`` (its ``__main__``
is a ``maxtext.`` module), ``entwine_jax.maxtext.enable()`` runs first, after every import of
MaxText's and before its train step is traced. No other process imports entwine_jax or jax here.

Environment variables:
  ENTWINE_MAXTEXT=0                 off: the finder is not installed.
  ENTWINE_MAXTEXT_FALLBACK=stock    a failed enable() prints its reason and MaxText trains stock;
                                    otherwise the job stops with that reason (a RuntimeError).
  ENTWINE_MAXTEXT_STATS=- | PATH    at exit, entwine_jax.maxtext.stats() printed to stderr (-) or
                                    written to PATH as JSON.
This file shadows any other sitecustomize.py later on sys.path (Python imports only the first).
"""
import os
import sys


def _maxtext_main() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and (spec.name or "").startswith("maxtext.")


def _write_stats() -> None:
    import json
    from entwine_jax import maxtext as entwine_maxtext
    text = json.dumps(entwine_maxtext.stats(), indent=1, sort_keys=True)
    where = os.environ.get("ENTWINE_MAXTEXT_STATS", "")
    if where == "-":
        print(f"entwine_jax.maxtext.stats(): {text}", file=sys.stderr, flush=True)
    else:
        with open(where, "w") as f:
            f.write(text + "\n")


def _enable() -> None:
    if os.environ.get("ENTWINE_MAXTEXT_STATS"):
        import atexit
        atexit.register(_write_stats)
    try:
        from entwine_jax import maxtext as entwine_maxtext
        entwine_maxtext.enable()
    except Exception as e:
        why = f"entwine_jax.maxtext.enable() failed: {type(e).__name__}: {e}"
        if os.environ.get("ENTWINE_MAXTEXT_FALLBACK") == "stock":
            print(f"entwine_jax sitecustomize: {why}; ENTWINE_MAXTEXT_FALLBACK=stock: training stock MaxText",
                  file=sys.stderr, flush=True)
            return
        raise RuntimeError(f"entwine_jax sitecustomize: {why} (set ENTWINE_MAXTEXT_FALLBACK=stock to train stock "
                           "MaxText instead, or ENTWINE_MAXTEXT=0 to turn the hook off)") from e


def _wrap_run(app) -> None:
    original = app.run

    def run(main, *args, **kwargs):
        if _maxtext_main():
            _enable()
        return original(main, *args, **kwargs)
    run.__wrapped__ = original
    app.run = run


class _AbslAppFinder:
    """Finds nothing itself: lends absl.app's own spec a loader step that wraps run() once loaded."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "absl.app":
            return None
        sys.meta_path.remove(self)
        from importlib.machinery import PathFinder
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap_run(module)
        spec.loader.exec_module = exec_and_wrap
        return spec


if os.environ.get("ENTWINE_MAXTEXT", "1") != "0" and "absl.app" not in sys.modules:
    sys.meta_path.insert(0, _AbslAppFinder())
