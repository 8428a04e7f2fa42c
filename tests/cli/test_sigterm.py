"""The artifact-writing commands unwind on SIGTERM as on Ctrl-C (exit 143, one line, their cleanup run)."""

import os
import signal
import time

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.console import Terminated, unwinds_on_sigterm


def _terminated_here(*args, **kwargs):
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        raise AssertionError("no SIGTERM handler: the signal would end the test run")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises at the next bytecode, well before this ends
    raise AssertionError("SIGTERM did not unwind the command")


def test_sigterm_unwinds_through_the_commands_cleanup_and_the_handler_comes_back():
    cleaned = []

    @unwinds_on_sigterm
    def writes():
        try:
            _terminated_here()
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        writes()
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("command, work", [
    (["export", "--target", "t", "--draft", "none", "--output", "{tmp}/art"], "specdec.exporter.pipeline.run_export"),
    (["distill", "{tmp}"], "specdec.exporter.distill.pipeline.run_distill"),
    (["phrases", "{tmp}"], "specdec.exporter.phrases.build_phrases"),
])
def test_every_command_that_writes_an_artifact_exits_143_in_one_line_on_sigterm(tmp_path, monkeypatch, command,
                                                                                   work):
    monkeypatch.setattr(work, _terminated_here)
    result = CliRunner().invoke(main, [part.format(tmp=tmp_path) for part in command])
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert result.output.strip().splitlines()[-1] == "terminated"
