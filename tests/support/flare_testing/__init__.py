"""Helpers the test suites of flare-core and its recipe plugins share: parity drivers
(`flare_testing.parity`) and tiny checkpoints written the way publishers write them
(`flare_testing.deepseek`). Installed for tests only (README's test command, .ci/run): no
shipped package imports it."""
