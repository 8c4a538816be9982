"""``towerctl hook-report``: placeholder, being written."""


def report(socket_path: str | None = None) -> int:
    return 0
