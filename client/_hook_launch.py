"""towerctl for hooks and wrappers, without what ``site`` costs every process.

Run as ``<python> -I -S <this file's absolute path> COMMAND ...`` (what ``towerctl hooks
install`` wires): the same command line and behaviour as ``towerctl COMMAND ...``, but
with ``-S`` no ``site`` runs, so neither the venv's ``.pth`` files (an editable install's
import finder: pathlib, fnmatch and re, ~9-13 ms a process) nor pip's console-script
wrapper (``import re``) are paid; ``-I`` keeps PYTHON* variables, the user's site and the
current directory off ``sys.path``.

This file then puts on ``sys.path`` what ``site`` would have: the environment's
``site-packages`` (msgspec and the other dependencies, for the commands that need them),
found from ``sys.executable`` (the venv's ``bin/python``) by string arithmetic (no
``sysconfig``, no ``os``; without site ``sys.prefix`` is the base interpreter's), and
makes ``towerd`` importable from this file's own location, ``<root>/client/``: ``<root>``
is the ``towerd`` package directory, ``site-packages/towerd`` for a regular (wheel)
install, the checkout itself for an editable one (``protocol/``, ``client/`` and
``daemon/`` at its top). Then it runs :func:`towerd.client.entry.main`.

Stdlib only, no imports at all before towerd's own: it must cost nothing.
"""

import sys


def _towerd_root(script: str) -> str:
    """The directory that holds towerd's ``client/``, ``protocol/`` and ``daemon/``."""
    if not script.startswith("/"):
        import posix

        script = f"{posix.getcwd()}/{script}"
    return script.rpartition("/")[0].rpartition("/")[0]


def _site_packages(root: str) -> list[str]:
    """Where ``site`` would have found the dependencies: the site-packages of the venv
    this Python was started from (``sys.executable`` is ``<venv>/bin/python``; without
    site, ``sys.prefix`` is the base interpreter's, not the venv's), else of
    ``sys.prefix``, and the one holding towerd itself for a wheel install."""
    import posix

    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    venv = sys.executable.rpartition("/")[0].rpartition("/")[0]
    candidates = []
    if venv and _exists(posix, f"{venv}/pyvenv.cfg"):
        candidates.append(f"{venv}/lib/{version}/site-packages")
    candidates.append(f"{sys.prefix}/lib/{version}/site-packages")
    above = root.rpartition("/")[0]  # a wheel install: the site-packages holding towerd/
    if above.endswith(("/site-packages", "/dist-packages")):
        candidates.append(above)
    found: list[str] = []
    for path in candidates:
        if path not in found and path not in sys.path and _exists(posix, path):
            found.append(path)
    return found


def _exists(posix: object, path: str) -> bool:
    try:
        posix.stat(path)  # type: ignore[attr-defined]
    except OSError:
        return False
    return True


def _prepare(script: str) -> None:
    root = _towerd_root(script)
    towerd = type(sys)("towerd")  # a namespace package rooted here, as the wheel's is
    towerd.__path__ = [root]
    sys.modules.setdefault("towerd", towerd)
    sys.path.extend(_site_packages(root))


if __name__ == "__main__":
    _prepare(__file__)
    from towerd.client.entry import main

    main()
