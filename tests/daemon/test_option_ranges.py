"""Every numeric daemon option declares its range (daemon/config.py ``Number``), and a
value outside it, ``nan`` or an infinity, is refused at start with the option's name:
exit 2, nothing opened. Before, ``--hello-timeout nan`` started a daemon that failed
every connection with a traceback, ``--checkpoint-interval -1`` and ``--retention-days
nan`` crashed it after start-up had begun, and ``--max-frame 0`` / ``--max-connections
0`` started one that refused every request."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from towerd.daemon.config import DaemonConfig, Number, options, parse_args
from towerd_testing import Daemon

NUMERIC = [
    (name, spec)
    for name, spec in options()
    if isinstance(spec.default, int | float) and not isinstance(spec.default, bool)
]


def test_every_numeric_option_declares_its_range() -> None:
    assert len(NUMERIC) >= 25, [name for name, _ in NUMERIC]
    untyped = [
        name
        for name, spec in NUMERIC
        if not isinstance(spec.metadata["argparse"].get("type"), Number)
    ]
    assert not untyped, f"numeric options without a declared range: {untyped}"


@pytest.mark.parametrize("name", [name for name, _ in NUMERIC])
def test_out_of_range_values_are_refused_by_name(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = dict(NUMERIC)[name]
    flag, number = spec.metadata["flag"], spec.metadata["argparse"]["type"]
    # Its default and the least value it allows are accepted.
    assert getattr(parse_args([flag, str(spec.default)]), name) == spec.default
    assert getattr(parse_args([flag, str(number.least)]), name) == number.least
    too_high = str(int(number.ceiling * 2))
    below = str(number.least / 10 or -0.5)
    for bad in ("nan", "inf", "-inf", "-1", below, too_high, "", "twelve"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([f"{flag}={bad}"])  # "=": argparse takes "-inf" alone for an option
        assert exit_info.value.code == 2, (flag, bad)
        error = capsys.readouterr().err
        assert f"argument {flag}:" in error, (flag, bad, error)
        assert "out of range" in error or "is not" in error, (flag, bad, error)


def test_the_range_is_said_in_words() -> None:
    assert Number(float, 0.001).describe() == "a number >= 0.001 and <= 315360000"
    assert Number(int, 1024, most=1 << 30).describe() == "an integer >= 1024 and <= 1073741824"


def test_defaults_are_inside_their_ranges() -> None:
    config = DaemonConfig()
    for name, spec in NUMERIC:
        assert spec.metadata["argparse"]["type"](str(getattr(config, name))) == spec.default


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--hello-timeout", "nan"),  # served, then every connection failed in a callback
        ("--checkpoint-interval", "-1"),  # crashed after start-up began
        ("--retention-days", "nan"),  # crashed after start-up began
        ("--max-frame", "0"),  # served, refusing every request frame_too_large
        ("--max-connections", "0"),  # served, refusing every connection
    ],
)
def test_the_real_daemon_refuses_the_lines_that_used_to_start_it_broken(
    make_daemon: Callable[..., Daemon], flag: str, value: str
) -> None:
    daemon = make_daemon()
    proc = daemon.spawn(flag, value)
    assert proc.wait(30) == 2, daemon.log()
    log = daemon.log()
    assert f"argument {flag}: '{value}' is out of range" in log, log
    assert not daemon.socket_path.exists()
    assert not (daemon.state_dir / "towerd.db").exists()  # nothing opened, nothing written
