"""The fuzzers' budget: short and reproducible in the test suite, long and random in a campaign.

    make fuzz                                   # ~10 minutes per fuzzer, random seeds
    make fuzz FUZZ_HTTP_SCALE=100 FUZZ_GRPC_SCALE=300

By default (scale 1) every fuzz test runs its own bounded number of examples, derandomized, so the
suite is reproducible and takes seconds. With TANDEM_FUZZ_SCALE=N each runs N times as many, from
a random seed (hypothesis prints it with any failure, with the shrunk example)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("TANDEM_FUZZ_SCALE", "1")))


def fuzz_settings(max_examples: int, *checks: HealthCheck) -> settings:
    """Settings of a fuzz test that runs `max_examples` examples in the suite (times SCALE in a campaign)."""
    return settings(max_examples=max_examples * SCALE, deadline=None, derandomize=SCALE == 1, database=None,
                    suppress_health_check=[HealthCheck.too_slow, *checks])
