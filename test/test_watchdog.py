"""--watchdog-timeout: a scheduler iteration past the timeout ends the scheduler, and requests
get an error naming the watchdog instead of waiting forever."""

from __future__ import annotations

import time

import pytest

import sglang_vericache
from sglang_vericache.managers.tokenizer_manager import GenerateError
from sglang_vericache.managers.watchdog import EXIT_CODE, StepWatchdog, describe_exit
from sglang_vericache.server_args import ServerArgs


def test_a_step_past_the_timeout_fires_once_with_its_elapsed_time():
    fired = []
    w = StepWatchdog(0.2, on_timeout=fired.append)
    with w.step():
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(fired) == 1 and fired[0] > 0.2 and w.fired


def test_short_steps_and_idle_time_never_fire():
    fired = []
    w = StepWatchdog(1.0, on_timeout=fired.append)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        with w.step():
            time.sleep(0.01)
        time.sleep(0.05)  # idle between steps: not watched
    time.sleep(1.2)
    assert fired == [] and not w.fired


def test_exit_message_names_the_watchdog():
    assert describe_exit(1) == "the scheduler process exited with code 1"
    assert describe_exit(EXIT_CODE).startswith(
        f"the scheduler process exited with code {EXIT_CODE} (its watchdog"
    )


def test_default_is_300_s_on_cuda_and_off_on_a_cpu():
    assert ServerArgs().watchdog_timeout_s is None
    assert ServerArgs(device="cuda").watchdog_timeout_s == 300.0
    assert ServerArgs(watchdog_timeout=5).watchdog_timeout_s == 5


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="--watchdog-timeout must be > 0 seconds, got 0"):
        ServerArgs(watchdog_timeout=0)


def test_a_hung_scheduler_fails_requests_with_the_watchdog_named(default_model_dir):
    # A 1 ms timeout: any prefill forward runs past it, as a hung one would.
    with sglang_vericache.Engine(
        model_path=default_model_dir, max_total_tokens=1024, watchdog_timeout=0.001
    ) as eng:
        with pytest.raises(GenerateError, match=f"exited with code {EXIT_CODE} \\(its watchdog"):
            eng.generate("def f(x): return x " * 20, {"max_new_tokens": 5})
        with pytest.raises(GenerateError, match="the scheduler is not running"):
            eng.generate("def g(y):", {"max_new_tokens": 5})
